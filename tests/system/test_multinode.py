"""Multi-node training rehearsed on one machine: `drafter train` starts two torchrun agents (2 nodes x 1 rank)
that run the same command and meet at a c10d rendezvous on 127.0.0.1; the store is S3 (moto over HTTP) and
the S3 credentials are only in the environment the agents start with. One node's agent is SIGKILLed after a
committed checkpoint; the rerun resumes from it and ends where an uninterrupted run does. The checkpoints are
in the work dir both nodes see, as on the cluster's shared volume (infra/k8s/trainer-workers.yaml).

The Kubernetes launcher (the train stage creating the node Job and waiting for it) is checked against a
stand-in of the API server's Job endpoints: there is no cluster here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from harness.json_http import send_json
from pipeline.config import load_config
from pipeline.manifest import read_listed, read_manifest
from pipeline.ops.kube_api import KubernetesApi
from pipeline.records import read_dataset
from pipeline.stages.train import training_fingerprint
from pipeline.storage import open_store
from pipeline.training.nodes import (
    KubernetesJob,
    TrainingFailed,
    job_for_run,
    load_job_manifest,
    node_launcher,
)
from tests.conftest import REPO, captured_dataset, free_port, storage_config, tiny_config_dict


@pytest.fixture(scope="module")
def setup(tmp_path_factory, s3_endpoint, tiny_target_dir):
    tmp = tmp_path_factory.mktemp("multinode")
    data = tiny_config_dict(storage_config("s3", tmp, s3_endpoint))
    data["prompts"].update({"num_samples": 24, "shard_size": 12, "eval_fraction": 0.0})
    data["generate"]["max_new_tokens"] = 16
    data["capture"]["parity"] = {"samples": 0}
    data["train"].update(
        {
            "epochs": 2,
            "ttt_steps": 2,
            "micro_batch_size": 2,
            "nproc": 1,
            "nodes": 2,
            "rendezvous_endpoint": "127.0.0.1",
            "rendezvous_timeout_s": 60,
            "checkpoint_every_steps": 2,
            "log_every": 1,
        }
    )
    config = load_config(data=data)
    store = open_store(config.storage)
    dataset_uri = captured_dataset(config, store, "mn")
    config_path = tmp / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    return {
        "config": config,
        "config_path": config_path,
        "store": store,
        "dataset": dataset_uri,
        "tmp": tmp,
        "environment": _environment_without_credentials(tmp, s3_endpoint),
    }


def _environment_without_credentials(tmp: Path, s3_endpoint: str) -> dict[str, str]:
    """Where the S3 server is, and nowhere a credential could come from: no credentials file, no instance
    metadata (the config has no credential setting)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    environment.update(
        {
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "absent"),
            "AWS_CONFIG_FILE": str(tmp / "absent"),
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": s3_endpoint,
        }
    )
    return environment


def _credentials() -> dict[str, str]:
    """What the agents' environment adds, as IRSA adds them to a pod's."""
    return {"AWS_ACCESS_KEY_ID": "multinode-agent", "AWS_SECRET_ACCESS_KEY": "multinode-agent-secret"}


class TrainStage:
    """`drafter train` in its own session, its stderr in a file (a full pipe would stall the nodes)."""

    def __init__(self, setup, run_id: str, attempt: str):
        command = [
            sys.executable,
            "-m",
            "pipeline.cli",
            "train",
            "--config",
            str(setup["config_path"]),
            "--run-id",
            run_id,
            "--dataset",
            setup["dataset"],
            f"train.rendezvous_port={free_port()}",
        ]
        self.stderr_path = setup["tmp"] / f"{run_id}-{attempt}.stderr"
        with open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(
                command,
                cwd=REPO,
                env={**setup["environment"], **_credentials()},
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=60)


def _workdir(setup, run_id: str) -> Path:
    store, config = setup["store"], setup["config"]
    dataset = read_dataset(store, setup["dataset"])
    return config.storage.run_workdir(run_id) / f"train-{training_fingerprint(config, dataset)}"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _processes_running(needle: str) -> list[int]:
    """Live processes whose command line mentions needle (this run's worker spec)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "cmdline").read_bytes().decode(errors="replace"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def _result(setup, run_id: str) -> tuple[dict, list[dict]]:
    store, prefix = setup["store"], f"runs/{run_id}/train"
    manifest = read_manifest(store, prefix, kind="train")
    metrics = [
        json.loads(line) for line in read_listed(store, prefix, manifest, "metrics.jsonl").splitlines()
    ]
    return manifest, metrics


def test_a_rank_without_the_agents_credentials_cannot_read_the_spec(setup):
    """The S3 store answers only with the credentials the agents carry: the ranks below got them from
    their agents' environment, nothing else provides them."""
    spec = setup["store"].uri("runs/no-credentials/train/worker_spec.json")
    setup["store"].put_bytes("runs/no-credentials/train/worker_spec.json", b"{}")
    worker = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "train-worker", "--spec", spec],
        cwd=REPO,
        env=setup["environment"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode != 0 and "this rank has no AWS credentials" in worker.stderr


def test_two_nodes_killed_mid_epoch_resume_from_the_committed_checkpoint(setup):
    straight = TrainStage(setup, "mn-straight", "only")
    assert straight.finish() == 0, straight.stderr()[-3000:]
    straight_manifest, straight_metrics = _result(setup, "mn-straight")
    assert straight_manifest["result"]["nodes"] == 2 and straight_manifest["result"]["world_size"] == 2

    spec = setup["store"].uri("runs/mn-killed/train/worker_spec.json")
    checkpoints = _workdir(setup, "mn-killed") / "checkpoints"
    stage = TrainStage(setup, "mn-killed", "killed")
    try:
        agents = _wait_for_agents(stage)
        assert len(set(agents.values())) == 1  # every node runs the same command
        _wait_for_a_committed_step_checkpoint(stage, checkpoints)
        os.killpg(list(agents)[1], signal.SIGKILL)  # node 1: its agent's process group; its rank dies with it
    finally:
        code = stage.finish(timeout=120)
    assert code != 0  # node 0 cannot finish alone: the stage stops it and fails
    assert _wait_until_none_running(spec) == []
    committed = (checkpoints / "latest").read_text().strip()
    assert committed.startswith("step-") and not (checkpoints.parent / "train_result.json").exists()

    rerun = TrainStage(setup, "mn-killed", "rerun")
    assert rerun.finish() == 0, rerun.stderr()[-3000:]
    assert f"resumed from checkpoint {committed}" in rerun.stderr() and _wait_until_none_running(spec) == []
    manifest, metrics = _result(setup, "mn-killed")
    result = manifest["result"]
    assert result["nodes"] == 2 and result["epochs_run"] == 2 and result["stop_reason"] == "completed"
    assert result["global_steps"] == straight_manifest["result"]["global_steps"]
    assert result["global_steps"] - result["steps_this_attempt"] == int(committed.removeprefix("step-"))
    steps = [line["global_step"] for line in metrics if line["kind"] == "interval"]
    assert steps == list(range(1, result["global_steps"] + 1))  # continued, none twice
    assert manifest["history"] == straight_manifest["history"]

    def measured(lines: list[dict]) -> list[dict]:  # the interval records, less their wall-clock rate
        return [
            {k: v for k, v in line.items() if k != "tokens_per_s"}
            for line in lines
            if line["kind"] == "interval"
        ]

    assert measured(metrics) == measured(straight_metrics)


def _wait_for_agents(stage: TrainStage, timeout: float = 120) -> dict[int, bytes]:
    """The stage's two node agents, with their command lines (once they run torchrun)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        agents = {pid: _command_line(pid) for pid in _children(stage.process.pid)}
        if len(agents) == 2 and all(b"torch.distributed.run" in command for command in agents.values()):
            return agents
        if stage.process.poll() is not None:
            pytest.fail(f"the train stage exited before starting its nodes: {stage.stderr()[-3000:]}")
        time.sleep(0.05)
    pytest.fail("the train stage did not start two node agents")


def _wait_for_a_committed_step_checkpoint(stage: TrainStage, checkpoints: Path, timeout: float = 300) -> str:
    """The tag `latest` names once a mid-epoch checkpoint is committed (every rank's files are written)."""
    latest = checkpoints / "latest"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tag = latest.read_text().strip() if latest.exists() else ""
        if tag.startswith("step-"):
            return tag
        if stage.process.poll() is not None:
            pytest.fail(f"training ended before its first checkpoint: {stage.stderr()[-3000:]}")
        time.sleep(0.01)
    pytest.fail("no checkpoint was committed")


def _wait_until_none_running(needle: str, timeout: float = 30) -> list[int]:
    """Processes of the run still alive after timeout; ranks die with their agent a moment after it."""
    deadline = time.monotonic() + timeout
    while (running := _processes_running(needle)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in running:
        os.kill(pid, signal.SIGKILL)  # nothing may outlive the test, even when it fails
    return running


class JobsApiStandIn(ThreadingHTTPServer):
    """The Job endpoints of a Kubernetes API server on 127.0.0.1: a created Job finishes with `outcome`
    after `reads_until_done` status reads."""

    def __init__(self, outcome: str = "Complete", reads_until_done: int = 2):
        super().__init__(("127.0.0.1", 0), _JobsHandler)
        self.outcome, self.reads_until_done = outcome, reads_until_done
        self.jobs: dict[str, dict] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.reads = 0

    def finished(self, job: dict, outcome: str) -> dict:
        return {**job, "status": {"conditions": [{"type": outcome, "status": "True"}]}}


class _JobsHandler(BaseHTTPRequestHandler):
    def _answer(self, status: int, body: dict) -> None:
        send_json(self, status, json.dumps(body).encode())

    def _name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    def do_POST(self):  # noqa: N802 (http.server's naming)
        api = self._record()
        job = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if job["metadata"]["name"] in api.jobs:
            return self._answer(409, {"message": "jobs.batch already exists"})
        api.jobs[job["metadata"]["name"]] = job
        self._answer(201, job)

    def do_GET(self):  # noqa: N802
        api = self._record()
        job = api.jobs.get(self._name())
        if job is None:
            return self._answer(404, {"message": "not found"})
        api.reads += 1
        if api.reads >= api.reads_until_done and not job.get("status"):
            job = api.jobs[self._name()] = api.finished(job, api.outcome)
        self._answer(200, job)

    def do_DELETE(self):  # noqa: N802
        api = self._record()
        self._answer(200 if api.jobs.pop(self._name(), None) else 404, {})

    def do_PATCH(self):  # noqa: N802 (a merge patch of the Job's ownerReferences, what the launcher patches)
        api = self._record()
        patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        job = api.jobs.get(self._name())
        if job is None or self.headers["Content-Type"] != "application/merge-patch+json":
            return self._answer(404 if job is None else 415, {})
        owners = patch["metadata"]["ownerReferences"]
        meta = {key: value for key, value in job["metadata"].items() if key != "ownerReferences"}
        job["metadata"] = {**meta, **({"ownerReferences": owners} if owners else {})}
        self._answer(200, job)

    def _record(self) -> JobsApiStandIn:
        self.server.calls.append((self.command, self.path, self.headers.get("Authorization", "")))
        return self.server

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def jobs_api(tmp_path):
    servers = []

    def start(**behaviour) -> tuple[JobsApiStandIn, KubernetesApi]:
        server = JobsApiStandIn(**behaviour)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        token = tmp_path / "token"
        token.write_text("service-account-token\n")
        return server, KubernetesApi(f"http://127.0.0.1:{server.server_address[1]}", token, None)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _kubernetes_settings(tmp_path, nodes: int = 3):
    train = {
        "nproc": 8,
        "nodes": nodes,
        "launcher": "kubernetes",
        "rendezvous_timeout_s": 1800,
        "rendezvous_endpoint": "drafter-trainer-0.drafter-trainer.drafter.svc.cluster.local",
    }
    return load_config(
        data={"storage": {"root": str(tmp_path)}, "target": {"name": "t"}, "train": train}
    ).train


JOBS = "/apis/batch/v1/namespaces/drafter/jobs"
SPEC = "s3://drafter-pipeline/kimi/runs/r1/train/worker_spec.json"


def test_the_kubernetes_launcher_creates_the_node_job_waits_for_it_and_removes_it(tmp_path, jobs_api):
    server, api = jobs_api()
    settings = _kubernetes_settings(tmp_path)
    assert isinstance(node_launcher(settings), KubernetesJob)
    assert KubernetesJob(settings, api, poll_s=0.01).train(SPEC, "r1", tmp_path / "train.log") == 0
    assert [(method, path) for method, path, _ in server.calls] == [
        ("POST", JOBS),
        ("GET", f"{JOBS}/drafter-trainer"),
        ("GET", f"{JOBS}/drafter-trainer"),
        ("DELETE", f"{JOBS}/drafter-trainer"),
    ]
    assert {auth for _, _, auth in server.calls} == {"Bearer service-account-token"}
    assert (
        "kubectl -n drafter logs -l batch.kubernetes.io/job-name=drafter-trainer"
        in (tmp_path / "train.log").read_text()
    )
    assert server.jobs == {}


def test_the_node_job_carries_the_run_and_a_failed_one_stays_for_its_logs(tmp_path, jobs_api):
    server, api = jobs_api(outcome="Failed")
    assert (
        KubernetesJob(_kubernetes_settings(tmp_path), api, poll_s=0.01).train(
            SPEC, "r1", tmp_path / "train.log"
        )
        == 1
    )
    job = server.jobs["drafter-trainer"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    assert job["spec"]["template"]["metadata"]["annotations"] == {
        "drafter/run-id": "r1",
        "drafter/worker-spec": SPEC,
        "drafter/nodes": "3",
    }
    assert "DELETE" not in {method for method, _, _ in server.calls}
    # the next attempt replaces it
    server.outcome = "Complete"
    server.reads = 0
    assert (
        KubernetesJob(_kubernetes_settings(tmp_path), api, poll_s=0.01).train(
            SPEC, "r1", tmp_path / "train.log"
        )
        == 0
    )
    assert [method for method, _, _ in server.calls][-6:] == [
        "POST",
        "GET",
        "DELETE",
        "POST",
        "GET",
        "DELETE",
    ]
    assert server.jobs == {}


def test_in_a_task_pod_the_node_job_is_owned_by_it_never_outlives_its_timeout_and_a_failed_one_is_disowned(
    tmp_path, jobs_api, monkeypatch
):
    """The train task's pod owns the Job it creates (deleted with the pod: a killed task frees its GPUs) and
    gives it the task's timeout as its deadline; a failed Job is disowned, kept for its node logs; a running
    one of the same run is adopted."""
    from pipeline.task_pod import TASK_POD_NAME_ENV, TASK_POD_UID_ENV, TASK_TIMEOUT_ENV

    monkeypatch.setenv(TASK_POD_NAME_ENV, "drafter-train-x1")
    monkeypatch.setenv(TASK_POD_UID_ENV, "3f6c-uid")
    monkeypatch.setenv(TASK_TIMEOUT_ENV, "1080000")
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "drafter-train-x1", "uid": "3f6c-uid"}
    server, api = jobs_api(outcome="Failed")
    settings = _kubernetes_settings(tmp_path)
    assert KubernetesJob(settings, api, poll_s=0.01).train(SPEC, "r1", tmp_path / "train.log") == 1
    posted = next(path for method, path, _ in server.calls if method == "POST")
    assert posted == JOBS
    job = server.jobs["drafter-trainer"]
    assert job["spec"]["activeDeadlineSeconds"] == 1080000
    assert "ownerReferences" not in job["metadata"]  # disowned once it failed
    assert [method for method, _, _ in server.calls][-1] == "PATCH"
    assert "kept for its pods' logs" in (tmp_path / "train.log").read_text()

    server.jobs.clear()
    running = job_for_run(load_job_manifest(settings.kubernetes_job), settings, SPEC, "r1")
    server.jobs["drafter-trainer"] = running  # an earlier attempt's, still running
    server.outcome, server.reads = "Complete", 0
    monkeypatch.setenv(TASK_POD_NAME_ENV, "drafter-train-x2")
    assert KubernetesJob(settings, api, poll_s=0.01).train(SPEC, "r1", tmp_path / "train.log") == 0
    adopted = [path for method, path, _ in server.calls if method == "PATCH"]
    assert len(adopted) == 2 and running["metadata"]["ownerReferences"] == [
        {**owner, "name": "drafter-train-x2"}
    ]


def test_a_running_node_job_is_waited_for_by_its_run_and_refused_to_another(tmp_path, jobs_api):
    server, api = jobs_api(reads_until_done=3)
    settings = _kubernetes_settings(tmp_path)
    running = job_for_run(load_job_manifest(settings.kubernetes_job), settings, SPEC, "r1")
    server.jobs["drafter-trainer"] = running  # its supervisor (an earlier train task) died
    with pytest.raises(TrainingFailed, match="is training run r1"):
        KubernetesJob(settings, api, poll_s=0.01).train(
            SPEC.replace("r1", "r2"), "r2", tmp_path / "train.log"
        )
    assert KubernetesJob(settings, api, poll_s=0.01).train(SPEC, "r1", tmp_path / "train.log") == 0
    assert [method for method, _, _ in server.calls].count("POST") == 2 and server.jobs == {}
    assert "waiting for the running Job drafter/drafter-trainer" in (tmp_path / "train.log").read_text()


def test_the_kubernetes_launcher_refuses_a_manifest_that_disagrees_and_a_machine_outside_a_cluster(
    tmp_path, monkeypatch
):
    with pytest.raises(TrainingFailed, match="disagrees with the train settings"):
        KubernetesJob(_kubernetes_settings(tmp_path).model_copy(update={"nproc": 4}), poll_s=0.01).train(
            SPEC, "r1", tmp_path / "train.log"
        )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(TrainingFailed, match="outside one; here use train.launcher torchrun"):
        KubernetesJob(_kubernetes_settings(tmp_path), poll_s=0.01).train(SPEC, "r1", tmp_path / "train.log")
