"""A local Airflow for the drafter DAGs: api-server, scheduler, dag-processor and triggerer, all on
127.0.0.1, with a login from a file. It runs the `airflow` commands as separate processes (this module
imports nothing from Airflow) and stops them by PID.

    python -m harness.airflow_local up [--home .drafter/airflow] [--port 8080]
    python -m harness.airflow_local down [--home ...]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.config_base import PROJECT_ROOT
from pipeline.processes import session_members, start_time
from pipeline.retrying import poll_until

COMPONENTS = {
    "api-server": ["api-server", "--host", "127.0.0.1", "--port", "{port}"],
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
}
USER = "admin"


def airflow_env(home: Path, port: int, overrides: dict[str, str | None] | None = None) -> dict[str, str]:
    """The components' environment; `overrides` set variables, or remove them where the value is None."""
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        # Airflow's own re-parse interval (30 s): every parse of the three files under dags/ costs the
        # dag-processor about a CPU-second, so parsing them every 5 s took 9.6 CPU-s a minute against 2.0
        # (an idle Airflow, 60 s each). The DAG files are parsed once at start either way.
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "DRAFTER_DEPLOYMENT": os.environ.get(
            "DRAFTER_DEPLOYMENT", str(PROJECT_ROOT / "configs/deployment/local.yaml")
        ),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "PYTHONUNBUFFERED": "1",
    }
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def login_file(home: Path) -> Path:
    """{"admin": "<password>"}, created once with a random password; the UI and REST API use it."""
    path = home / "passwords.json"
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({USER: secrets.token_urlsafe(12)}))
        path.chmod(0o600)
    return path


def _airflow() -> str:
    return str(Path(sys.executable).with_name("airflow"))


def wait_healthy(port: int, timeout_s: float) -> None:
    import requests

    def healthy() -> bool:
        try:
            health = requests.get(f"http://127.0.0.1:{port}/api/v2/monitor/health", timeout=30).json()
        except (requests.RequestException, ValueError):
            return False
        return all(health.get(part, {}).get("status") == "healthy" for part in ("metadatabase", "scheduler"))

    if not poll_until(healthy, timeout_s, poll_s=1.0):
        raise RuntimeError(f"Airflow on 127.0.0.1:{port} did not become healthy in {timeout_s:.0f}s")


def up(
    home: Path,
    port: int,
    timeout_s: float = 300,
    env: dict[str, str | None] | None = None,
    gpu_pool_slots: int = 1,
) -> dict[str, int]:
    """Start the four components; returns their PIDs (also written to <home>/pids.json). The drafter_gpu
    pool gets `gpu_pool_slots` (one GPU-bound task at a time on a workstation, by default)."""
    home = home.resolve()
    login_file(home)
    component_env = airflow_env(home, port, env)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    subprocess.run([_airflow(), "db", "migrate"], env=component_env, check=True, capture_output=True)
    subprocess.run(
        [_airflow(), "pools", "set", "drafter_gpu", str(gpu_pool_slots), "GPU-bound drafter tasks"],
        env=component_env,
        check=True,
        capture_output=True,
    )
    pids = {name: _start_component(name, home, port, component_env) for name in COMPONENTS}
    started = {name: start_time(pid) for name, pid in pids.items()}
    (home / "pids.json").write_text(json.dumps({"port": port, "pids": pids, "started": started}))
    try:
        wait_healthy(port, timeout_s)
    except RuntimeError:
        down(home)
        raise
    return pids


def _start_component(name: str, home: Path, port: int, component_env: dict[str, str]) -> int:
    """One component in a session of its own, its output appended to <home>/logs/<name>.log; its PID."""
    log = open(home / "logs" / f"{name}.log", "ab")
    command = [_airflow()] + [a.format(port=port) for a in COMPONENTS[name]]
    return subprocess.Popen(
        command,
        env=component_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=PROJECT_ROOT,
        start_new_session=True,
    ).pid


def restart(home: Path, name: str, env: dict[str, str | None] | None = None, grace_s: float = 20.0) -> int:
    """Stop one component (SIGTERM, then SIGKILL after grace_s) and start it again with the environment
    `up` gave it (`env`: the same overrides); its new PID. What it held only in memory is gone."""
    home = home.resolve()
    recorded = json.loads((home / "pids.json").read_text())
    pid = recorded["pids"][name]
    sessions = [pid] if _ours(pid, recorded["started"].get(name)) else []
    _stop_sessions(sessions, grace_s)
    new = _start_component(name, home, recorded["port"], airflow_env(home, recorded["port"], env))
    recorded["pids"][name], recorded["started"][name] = new, start_time(new)
    (home / "pids.json").write_text(json.dumps(recorded))
    return new


def down(home: Path, grace_s: float = 20.0) -> None:
    """SIGTERM every process of the components' sessions (the task runners the scheduler starts lead
    process groups of their own there), then SIGKILL what is left after grace_s (a running task's runner
    can take that long: the scheduler waits for it)."""
    pid_file = home.resolve() / "pids.json"
    if not pid_file.exists():
        return
    recorded = json.loads(pid_file.read_text())
    started = recorded.get("started") or {}
    sessions = [pid for name, pid in recorded["pids"].items() if _ours(pid, started.get(name))]
    _stop_sessions(sessions, grace_s)
    pid_file.unlink()


def _stop_sessions(sessions: list[int], grace_s: float) -> None:
    """SIGTERM every process of these sessions, then SIGKILL what is left after grace_s."""
    _signal_sessions(sessions, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _left(sessions):
        time.sleep(0.2)
    _signal_sessions(sessions, signal.SIGKILL)
    _left(sessions)


def _ours(pid: int, recorded_start: int | None) -> bool:
    """Whether the session `pid` leads is still this Airflow's: not when a process started at another time
    holds the PID (pids.json outlived a reboot or a crash). A leader that is gone leaves its session's
    processes to stop."""
    now = start_time(pid)
    return now is None or recorded_start is None or now == recorded_start


def _signal_sessions(sessions: list[int], sig: int) -> None:
    for session in sessions:
        for pid in session_members(session):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _left(sessions: list[int]) -> list[int]:
    """The components' processes still running. A component that `up` started in this same process is
    reaped first: as a zombie it would count as running until the grace period ran out."""
    for pid in sessions:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # started by another process (`airflow_local up`), or reaped already
    return [pid for session in sessions for pid in session_members(session)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--home", default=str(PROJECT_ROOT / ".drafter" / "airflow"))
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    home = Path(args.home)
    if args.action == "down":
        down(home)
        print("stopped")
        return
    up(home, args.port)
    print(f"Airflow UI: http://127.0.0.1:{args.port}  user: {USER}  password: in {login_file(home)}")
    print(f"stop with: python -m harness.airflow_local down --home {home}")


if __name__ == "__main__":
    main()
