"""Process-lifetime helpers for the launchers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server or process group started on this machine (a fixed port
    can be taken by another run of the same thing)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies, so a killed `drafter train`
    (a task timeout, a preempted pod) leaves no training processes behind. A no-op elsewhere."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def start_process_group(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A child leading its own process group, so it can be stopped (or killed) without its siblings, that
    dies with this process. Its stdout and stderr come back merged as text lines.

    Call from the main thread: the kernel ties the parent-death signal to the thread that forked."""
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )


def stop_process_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group a `start_process_group` child leads; SIGKILL it if it is still there after
    grace_s."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        process.wait()


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from its third field (the state) on, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """Linux: when the process started (clock ticks after boot), or None when it is gone. With the PID it
    tells a process from a later one that was given the same PID."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def session_members(session_id: int) -> list[int]:
    """Linux: the live (not zombie) processes of a session, from /proc. A process started with
    start_new_session leads a session that holds whatever it starts in process groups of their own."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None:
            continue  # gone while /proc was read
        state, session = fields[0], int(fields[3])
        if session == session_id and state != "Z":
            members.append(int(entry.name))
    return members
