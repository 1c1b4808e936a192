"""The production rehearsal (`make rehearsal`): the Kubernetes deployment and a Kimi-like target, end
to end on a local cluster. Every @task.kubernetes task of both DAGs runs as a pod through the cncf
provider's own code; the run ends with a pull from S3 into a serving pod."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, TEST_CACHE

POD_TASKS = {"drafter_data": {"configure", "prompts", "generate_shard", "responses", "parity", "capture_shard",
                              "captures"},
             "drafter_train": {"configure", "train", "evaluate", "benchmark", "promote"}}


@pytest.mark.slow
def test_the_production_path_runs_end_to_end_on_a_local_cluster(tmp_path):
    # no credentials from the test process: pods and the Airflow worker get theirs from IAM roles
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AIRFLOW", "DRAFTER_"))}
    out = subprocess.run([sys.executable, "-m", "pipeline.dev.rehearsal", "--workspace", str(tmp_path / "ws"),
                          "--cache", str(TEST_CACHE)], env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and lines[-1] == "rehearsal=passed", (out.stdout[-4000:], out.stderr[-6000:])
    pods = [line for line in lines if line.startswith("pod ")]
    ran = {(line.split()[2].rsplit(".", 1)[0], line.split()[2].rsplit(".", 1)[1]) for line in pods}
    for dag_id, tasks in POD_TASKS.items():
        assert {(dag_id, task) for task in tasks} <= ran, (dag_id, sorted(ran))
    # served twice: the first promotion, then again after the cron run's promotion was rolled back
    served = [line for line in lines if line.startswith("serving ") and "EAGLE3" in line]
    assert len(served) == 2 and served[0].split(":")[0] == served[1].split(":")[0], served
    assert not (tmp_path / "ws").exists() or not any((tmp_path / "ws").iterdir())  # the workspace is removed


COMMANDS = ("docker ", "kubectl ", "helm ", "aws ", "drafter ", "curl ", "airflow ")


def test_every_runbook_command_is_rehearsed_or_marked_for_a_real_cluster():
    from pipeline.dev.rehearsal import REAL_CLUSTER, REHEARSED, RUNBOOK, Runbook, runbook_commands

    commands = [line.strip() for line in RUNBOOK.read_text().splitlines()
                if line.startswith("    ") and line.strip().startswith(COMMANDS)]
    assert len(commands) >= 20
    unmarked = [c for c in commands if not c.endswith((REHEARSED, REAL_CLUSTER))]
    assert not unmarked, unmarked
    # the rehearsal has a way to run each [rehearsed] command (it also checks each one ran, in order)
    for command in runbook_commands(REHEARSED):
        assert command.startswith(Runbook.HANDLED), command
    assert any(c.startswith("drafter ") for c in runbook_commands(REHEARSED))
