"""One table from a failure to its exit code (pipeline.failures): each kind of failure raised through each
entry point, `drafter <stage>`, `drafter run` and a task pod (a process that imported pipeline.tasks with
DRAFTER_PERMANENT_EXIT_CODES=1), ends with the code the README's table gives it
(tests.builders.FAILURE_KINDS)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from pipeline import cli, run
from pipeline.stages import gate, prompts
from pipeline.stages import report as report_stage
from tests.builders import FAILURE_KINDS, failure
from tests.conftest import REPO, storage_config, tiny_config_dict

KINDS = sorted(FAILURE_KINDS)


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(storage_config("file", tmp_path, None))))
    return path


def raising(kind: str):
    def run_stage(*args, **kwargs):
        raise failure(kind)

    return run_stage


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_stage_exits_with_the_tables_code(kind, config_path, monkeypatch):
    monkeypatch.setattr(gate, "run", raising(kind))
    assert cli.main(["gate", "--config", str(config_path), "--run-id", "r1"]) == FAILURE_KINDS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_run_exits_with_the_tables_code(kind, config_path, monkeypatch):
    """The run's first stage raises: a failure propagates out of `drafter run`; a rejection or an
    inconclusive benchmark stops the run, which still writes its summary and report, then exits."""
    monkeypatch.setattr(prompts, "run", raising(kind))
    data = {"run_id": "r1", "target": "tiny-test", "samples": 0, "tokens": 0, "cond_acc": []}
    monkeypatch.setattr(run, "_data_summary", lambda *args: {**data, "stop_reason": "none"})

    def reported(config, inputs, run_id, store):
        return report_stage.Output(
            uri="file:///r", kind="report", link="file:///r.html", outcome="-", plots=[]
        )

    monkeypatch.setattr(report_stage, "run", reported)
    assert cli.main(["run", "--config", str(config_path), "--run-id", "r1"]) == FAILURE_KINDS[kind]


POD = """
import sys
from pipeline import tasks
from pipeline.stages import gate
from tests.builders import failure

def raising(*args, **kwargs):
    raise failure(sys.argv[1])

gate.run = raising
tasks.run_stage_task("gate", sys.argv[2], "r1")
"""


def test_a_task_pod_exits_with_the_tables_code(config_path):
    """Every kind at once, a pod process each (the deployment's DRAFTER_PERMANENT_EXIT_CODES=1)."""
    env = {**os.environ, "DRAFTER_PERMANENT_EXIT_CODES": "1", "PYTHONPATH": str(REPO)}
    pods = {
        kind: subprocess.Popen(
            [sys.executable, "-c", POD, kind, str(config_path)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for kind in KINDS
    }
    codes = {kind: pod.wait(timeout=300) for kind, pod in pods.items()}
    for kind, pod in pods.items():
        assert pod.stderr is not None
        shown = pod.stderr.read().decode()
        pod.stderr.close()
        assert "Traceback" in shown, (kind, shown[-2000:])  # the pod's log keeps the traceback
    assert codes == FAILURE_KINDS
