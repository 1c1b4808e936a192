"""`airflow_local down`: it stops the sessions its components lead, and only those."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from harness import airflow_local
from pipeline.processes import session_members, start_time


def _session_with_a_child():
    """A session leader (as `up` starts a component) with a child in a process group of its own (as the
    scheduler starts a task runner)."""
    script = "; ".join(
        [
            "import os, subprocess, time",
            "subprocess.Popen(['sleep', '60'], preexec_fn=os.setpgrp)",
            "time.sleep(60)",
        ]
    )
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while _commands(leader.pid) != ["python", "sleep"]:
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)
    return leader


def _commands(session: int) -> list[str]:
    names = []
    for pid in session_members(session):
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except FileNotFoundError:
            pass
    return sorted("python" if name.startswith("python") else name for name in names)


def _pid_file(home, pid: int, started: int | None) -> None:
    home.mkdir(exist_ok=True)
    (home / "pids.json").write_text(
        json.dumps({"port": 1, "pids": {"api-server": pid}, "started": {"api-server": started}})
    )


def test_down_stops_a_components_whole_session_but_not_a_process_that_reused_its_pid(tmp_path):
    leader = _session_with_a_child()
    try:
        # pids.json from another boot: the PID now belongs to a process started at another time
        _pid_file(tmp_path, leader.pid, (start_time(leader.pid) or 0) + 1)
        airflow_local.down(tmp_path, grace_s=1)
        assert _commands(leader.pid) == ["python", "sleep"] and not (tmp_path / "pids.json").exists()
        _pid_file(tmp_path, leader.pid, start_time(leader.pid))
        airflow_local.down(tmp_path, grace_s=1)
        assert session_members(leader.pid) == []  # the leader and the child in its own group
    finally:
        subprocess.run(["pkill", "-9", "-s", str(leader.pid)], check=False)
        leader.wait(timeout=10)
