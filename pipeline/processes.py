"""Process-lifetime helpers for the launchers."""

from __future__ import annotations


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies, so a killed `drafter train`
    (a task timeout, a preempted pod) leaves no training processes behind. A no-op elsewhere."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
