"""The production rehearsal (`make rehearsal`): the Kubernetes deployment and a Kimi-like target, end
to end on a local cluster. Every @task.kubernetes task of both DAGs runs as a pod through the cncf
provider's own code; the run ends with a pull from S3 into a serving pod."""

import os
import subprocess
import sys

from tests.conftest import REPO, TEST_CACHE

POD_TASKS = {
    "drafter_data": {
        "configure",
        "prompts",
        "generate_fleet_up",
        "generate_shard",
        "responses",
        "generate_fleet_down",
        "capture_fleet_up",
        "parity",
        "capture_shard",
        "captures",
        "capture_fleet_down",
    },
    "drafter_train": {"configure", "train", "evaluate", "benchmark", "promote"},
}


def test_the_production_path_runs_end_to_end_on_a_local_cluster(tmp_path, root):
    # no credentials from the test process: pods and the Airflow worker get theirs from IAM roles
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AIRFLOW", "DRAFTER_"))}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.rehearsal",
            "--workspace",
            str(tmp_path / "ws"),
            "--cache",
            str(TEST_CACHE),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0:  # pytest shows a failed test's captured output whole; an assertion's repr is cut
        print(out.stdout[-30000:])
        print(out.stderr[-30000:], file=sys.stderr)
    assert out.returncode == 0 and lines[-1] == "rehearsal=passed", (out.stdout[-4000:], out.stderr[-6000:])
    pods = [line for line in lines if line.startswith("pod ")]
    ran = {(line.split()[2].rsplit(".", 1)[0], line.split()[2].rsplit(".", 1)[1]) for line in pods}
    for dag_id, tasks in POD_TASKS.items():
        assert {(dag_id, task) for task in tasks} <= ran, (dag_id, sorted(ran))
    # the SGLang fleets ran as StatefulSet pods only around their stages
    fleets = [line for line in lines if line.startswith("generate fleet ")]
    assert (
        len(fleets) == 1
        and "generate fleet sglang/sglang-generate: 2 replica(s)" in fleets[0]
        and "capture fleet sglang/sglang-capture-aux: 1 replica(s)" in fleets[0]
    ), fleets
    assert {"sglang-generate-0", "sglang-generate-1", "sglang-capture-aux-0"} <= {
        line.split()[1].rstrip(":") for line in pods
    }
    # training on 2 nodes (an Indexed Job) lost a node after a checkpoint; the retry resumed from it
    multi = [line for line in lines if line.startswith("multi-node training:")]
    assert len(multi) == 1 and "lost after checkpoint step-" in multi[0] and "resumed at step" in multi[0], (
        multi
    )
    assert sum(line.startswith("pod drafter-trainer-") for line in pods) >= 4, pods  # 2 nodes x 2 attempts
    # served three times, each version pinned: the first promotion, the cron run's, then the first again
    # after the rollback; a pod evicted after the cron run's promotion came back on the pinned first version
    served = [line.split(":")[0] for line in lines if line.startswith("serving ") and "EAGLE3" in line]
    assert len(served) == 3 and served[0] == served[2] != served[1], served
    drain = [line for line in lines if line.startswith("drain: ")]
    assert len(drain) == 1 and f"serves the pinned {served[0].split()[1]}," in drain[0], (drain, served)
    assert any(line.startswith("serving setting: ") for line in lines), lines
    # the runbook's notifier connections carried the promotion and the broken run's failure
    alerts = [line for line in lines if line.startswith("alerts: ")]
    assert len(alerts) == 1 and "promotion of " in alerts[0] and "configure failure" in alerts[0], alerts
    # the retraining watches, polled in a pod of the triggerer as the Helm values make it
    watches = [line for line in lines if line.startswith("watches (in the triggerer's pod): ")]
    assert len(watches) == 1 and "served acceptance: 1 replica(s)" in watches[0], watches
    # lineage of the pod tasks, through Airflow's OpenLineage provider: the prompts to the promoted version
    lineage = [line for line in lines if line.startswith("lineage: ")]
    assert len(lineage) == 1 and "/drafters/kimi-k2.5/versions/" in lineage[0], lineage
    assert not (tmp_path / "ws").exists() or not any((tmp_path / "ws").iterdir())  # the workspace is removed
