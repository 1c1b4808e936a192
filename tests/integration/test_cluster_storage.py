"""The local cluster's kubelet storage walk (harness/cluster.py) over containers that come and go. The
walk runs every second over every running pod, from the disk-pressure thread and each pod's storage
watch; a container whose first process exits between the listing and the walk is usual, and must count
as holding nothing, not stop the thread (a rehearsal once lost its disk-pressure eviction that way:
"container base has no running process to exec into")."""

import subprocess

import pytest

from harness.cluster import ClusterError, ContainerRun, _writable_layer_bytes
from pipeline.processes import _stat_fields


def _run_of(process: subprocess.Popen) -> ContainerRun:
    """A ContainerRun around `process` standing in for its `unshare` (what the walk reads of it)."""
    run = ContainerRun.__new__(ContainerRun)
    run.name, run.process = "base", process
    return run


@pytest.fixture
def process_without_children():
    """An `unshare` whose forked first process has exited while it has not (yet)."""
    process = subprocess.Popen(["sleep", "30"])
    yield process
    process.kill()
    process.wait()


def test_a_container_whose_first_process_exited_holds_nothing_and_stops_no_walk(process_without_children):
    run = _run_of(process_without_children)
    assert run.first_pid() is None
    assert _writable_layer_bytes(run) == 0
    with pytest.raises(ClusterError, match="no running process to exec into"):  # exec still refuses it
        run.init_pid()


def test_a_container_whose_unshare_is_gone_holds_nothing():
    process = subprocess.Popen(["true"])
    process.wait()
    run = _run_of(process)
    assert run.first_pid() is None
    assert _writable_layer_bytes(run) == 0


def test_a_running_first_process_is_found():
    process = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        run = _run_of(process)
        first = run.init_pid()
        # the child `sh` forked (its command line may still be sh's until it has exec'd sleep)
        assert run.first_pid() == first and int(_stat_fields(first)[1]) == process.pid  # its parent PID
        assert _writable_layer_bytes(run) == 0  # its /tmp is still this machine's: not a container's layer
    finally:
        subprocess.run(["pkill", "-P", str(process.pid)], check=False)
        process.wait()
