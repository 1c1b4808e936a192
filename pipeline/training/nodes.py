"""The training nodes: the one command every node runs, and the launchers that start the nodes.

Every node runs a torchrun agent, which starts `drafter train-worker --spec <uri>` once per rank. One node
runs `--standalone`; several meet at a c10d rendezvous on node 0 (rendezvous_endpoint:rendezvous_port).
An agent hands its own environment to its ranks, so the credentials of the pod (IRSA) or of the Airflow
worker reach every rank; nothing is started over SSH. Ranks read the worker spec from the object store, so
the spec needs no filesystem shared between nodes; the checkpoints do (infra/k8s/trainer-workers.yaml).

The train stage is the caller: it writes the spec, starts the nodes through a launcher, waits for them and
publishes what rank 0 wrote into the work directory.
- LocalAgents (train.launcher torchrun): the agents are child process groups of the caller, on this
  machine; several of them meeting on 127.0.0.1 rehearse a cluster run.
- KubernetesJob (train.launcher kubernetes): the agents run in the pods of the Indexed Job in
  train.kubernetes_job, which the caller creates in the cluster it runs in and waits for.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import yaml

from pipeline.config import TrainConfig
from pipeline.config_base import ConfigError, resolve_project_path
from pipeline.ops.kube_api import KubernetesApi, KubernetesApiError, NotInCluster
from pipeline.processes import start_process_group, stop_process_group
from pipeline.storage import StorageConfig
from pipeline.task_pod import task_pod_owner, task_timeout_s
from pipeline.user_files import UserFile

log = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    pass


def torchrun_args(settings: TrainConfig, spec_uri: str, run_id: str, nodes: str | None = None) -> list[str]:
    """torchrun's arguments, the same on every node. `nodes` stands in for settings.nodes where the count
    arrives later (the Kubernetes pods read it from their annotations)."""
    worker = ["--module", "pipeline.cli", "train-worker", "--spec", spec_uri]
    if settings.launcher == "torchrun" and settings.nodes == 1:
        return ["--standalone", "--nproc-per-node", str(settings.nproc)] + worker
    endpoint = f"{settings.rendezvous_endpoint}:{settings.rendezvous_port}"
    # No restarts: a lost node fails every node, and the next attempt resumes all of them from the last
    # committed checkpoint. A node started before node 0 keeps trying to reach its store for the read
    # timeout, then waits for the others for the join timeout.
    timeout = settings.rendezvous_timeout_s
    return [
        "--nnodes",
        nodes or str(settings.nodes),
        "--nproc-per-node",
        str(settings.nproc),
        "--max-restarts",
        "0",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"join_timeout={timeout},read_timeout={timeout}",
    ] + worker


class NodeLauncher(Protocol):
    def train(self, spec_uri: str, run_id: str, log_path: Path) -> int:
        """Start every node and wait for all of them; 0 when every node finished training."""


def node_launcher(settings: TrainConfig, storage: StorageConfig | None = None) -> NodeLauncher:
    environment = storage_environment(storage) if storage is not None else {}
    if settings.launcher == "kubernetes":
        return KubernetesJob(settings, environment=environment)
    return LocalAgents(settings, environment)


def storage_environment(storage: StorageConfig) -> dict[str, str]:
    """What every rank needs, besides credentials, to read the worker spec from the configured store: an
    S3-compatible endpoint and the region, as the standard AWS variables (the spec holds the rest)."""
    environment = {}
    if storage.endpoint_url:
        environment["AWS_ENDPOINT_URL_S3"] = storage.endpoint_url
    if storage.region:
        environment["AWS_DEFAULT_REGION"] = storage.region
    return environment


class LocalAgents:
    """Every node's agent as a child process group of this process, on this machine."""

    stop_grace_s = 15.0  # for an agent to stop its workers after SIGTERM

    def __init__(self, settings: TrainConfig, environment: dict[str, str] | None = None):
        self.settings, self.environment = settings, environment or {}

    def train(self, spec_uri: str, run_id: str, log_path: Path) -> int:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *torchrun_args(self.settings, spec_uri, run_id),
        ]
        log.info("launching training, %d node(s) here: %s", self.settings.nodes, " ".join(command))
        environment = {**_agent_environment(), **self.environment}
        agents = []
        try:
            for _ in range(self.settings.nodes):
                agents.append(start_process_group(command, environment))
            readers = [
                _copy_output(agent, log_path, f"[node {i}] " if len(agents) > 1 else "")
                for i, agent in enumerate(agents)
            ]
            code = _first_failure(agents)
        finally:
            # a job missing a node cannot finish: the first failure stops the others
            for agent in agents:
                stop_process_group(agent, self.stop_grace_s)
        for reader in readers:
            reader.join(timeout=self.stop_grace_s)
        return code


def _agent_environment() -> dict[str, str]:
    """This process's environment, S3 credentials included: every agent hands it on to its ranks."""
    environment = dict(os.environ)
    environment.setdefault("DS_ACCELERATOR", _accelerator())
    environment.setdefault("PYTHONUNBUFFERED", "1")
    return environment


def _accelerator() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _first_failure(agents: list) -> int:
    """0 once every agent exited cleanly, else the exit code of the first one seen failing."""
    while True:
        codes = [agent.poll() for agent in agents]
        for node, code in enumerate(codes):
            if code not in (None, 0):
                if len(agents) > 1:
                    log.error("node %d's agent exited with code %d; stopping the other nodes", node, code)
                return code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)


def _copy_output(agent, log_path: Path, prefix: str) -> threading.Thread:
    """A thread appending the agent's lines to the log (whole lines, so agents can share it) and showing
    the informative ones."""

    def copy() -> None:
        with open(log_path, "a", buffering=1) as log_file:
            for line in agent.stdout:
                log_file.write(prefix + line)
                if _worth_showing(line):
                    sys.stderr.write(prefix + line)

    reader = threading.Thread(target=copy, name=f"train-output-{agent.pid}", daemon=True)
    reader.start()
    return reader


def _worth_showing(line: str) -> bool:
    noisy = (
        "UserWarning",
        "warnings.warn",
        "return func(",
        "OMP_NUM_THREADS",
        "*****",
        "[WARNING]",
        "Setting OMP",
        "[INFO] [",
        "Loading weights",
    )
    return bool(line.strip()) and not any(marker in line for marker in noisy)


# The pods of the Job read the run's values from these annotations (the manifest's downward API); torchrun's
# arguments in the manifest name them as the environment variables Kubernetes expands.
RUN_ID_ANNOTATION = "drafter/run-id"
SPEC_ANNOTATION = "drafter/worker-spec"
NODES_ANNOTATION = "drafter/nodes"
POD_RUN_ID, POD_SPEC, POD_NODES = "$(DRAFTER_RUN_ID)", "$(DRAFTER_WORKER_SPEC)", "$(DRAFTER_NODES)"
NODE_CONTAINER = "node"


def load_job_manifest(path: str) -> dict[str, Any]:
    """The Indexed Job of train.kubernetes_job: a ConfigError naming where it was looked for when the image
    does not hold it (a relative path resolves against DRAFTER_HOME, the image's WORKDIR)."""
    location = resolve_project_path(path)
    if not location.is_file():
        home = os.environ.get("DRAFTER_HOME")
        raise ConfigError(
            f"train.kubernetes_job {path}: no file at {location} "
            + (f"(DRAFTER_HOME={home}); " if home else "(no DRAFTER_HOME set); ")
            + "the image running this stage must hold it (docker/pipeline.Dockerfile and "
            "docker/trainer.Dockerfile copy infra/k8s/trainer-workers.yaml), or name a file on a mounted "
            "volume"
        )
    text = UserFile(location, "train.kubernetes_job", ConfigError, path).read_text()
    jobs = [doc for doc in yaml.safe_load_all(text) if doc and doc.get("kind") == "Job"]
    if len(jobs) != 1 or jobs[0]["spec"].get("completionMode") != "Indexed":
        raise TrainingFailed(f"{location} must hold exactly one Job, with completionMode Indexed")
    return jobs[0]


def node_container(job: dict[str, Any]) -> dict[str, Any]:
    containers = [c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == NODE_CONTAINER]
    if len(containers) != 1:
        raise TrainingFailed(f"Job {job['metadata']['name']} has no container named {NODE_CONTAINER!r}")
    return containers[0]


def node_gpus(job: dict[str, Any]) -> int:
    """The GPUs each node pod of the Job holds: its node container's nvidia.com/gpu request (else limit)."""
    resources = node_container(job).get("resources") or {}
    wanted = (resources.get("requests") or {}).get("nvidia.com/gpu") or (resources.get("limits") or {}).get(
        "nvidia.com/gpu"
    )
    return int(wanted or 0)


def job_for_run(
    job: dict[str, Any],
    settings: TrainConfig,
    spec_uri: str,
    run_id: str,
    environment: dict[str, str] | None = None,
    owner: dict[str, Any] | None = None,
    deadline_s: int | None = None,
) -> dict[str, Any]:
    """The manifest's Job for one run: as many pods as nodes, the annotations they read the run id, the
    spec URI and the node count from, and `environment` on the node container. Its node command must be
    the one these settings make. Given an `owner` (the train task's pod), the Job is deleted with its pods
    once the owner is gone; given `deadline_s` (the task's timeout), it fails and its pods stop once it has
    run that long (activeDeadlineSeconds, the manifest's when shorter): it never outlives its task."""
    container = node_container(job)
    expected = ["torchrun", *torchrun_args(settings, POD_SPEC, POD_RUN_ID, POD_NODES)]
    found = container.get("command", []) + container.get("args", [])
    if found != expected:
        raise TrainingFailed(
            f"the node command of Job {job['metadata']['name']} ({settings.kubernetes_job}) "
            f"disagrees with the train settings:\n  manifest: {' '.join(found)}\n  "
            f"settings: {' '.join(expected)}"
        )
    job = copy.deepcopy(job)
    if environment:
        node = node_container(job)
        node["env"] = [v for v in node.get("env", []) if v["name"] not in environment]
        node["env"] += [{"name": name, "value": value} for name, value in environment.items()]
    job["spec"]["completions"] = job["spec"]["parallelism"] = settings.nodes
    if owner is not None:
        job["metadata"]["ownerReferences"] = [owner]
    if deadline_s is not None:
        given = job["spec"].get("activeDeadlineSeconds")
        job["spec"]["activeDeadlineSeconds"] = min(deadline_s, given) if given else deadline_s
    job["metadata"].setdefault("annotations", {})[RUN_ID_ANNOTATION] = run_id
    pod = job["spec"]["template"].setdefault("metadata", {})
    pod.setdefault("annotations", {}).update(
        {RUN_ID_ANNOTATION: run_id, SPEC_ANNOTATION: spec_uri, NODES_ANNOTATION: str(settings.nodes)}
    )
    return job


def job_outcome(job: dict[str, Any]) -> str | None:
    """Complete or Failed once the Job has finished, else None."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return condition["type"]
    return None


class KubernetesJob:
    """The node agents in the pods of an Indexed Job, created by this process in its own cluster.

    While it runs, the Job is owned by the train task's pod (pipeline.task_pod): a task killed (its pod
    deleted) takes the Job and its GPUs with it, and the Job's deadline is the task's timeout. A Job that
    failed is disowned, so it stays for its pods' logs until the next attempt replaces it (or its
    ttlSecondsAfterFinished); one of the same run that is still running (its supervisor died) is adopted
    and waited for instead of started twice."""

    api_errors_tolerated = 10  # consecutive failed status reads (an API server upgrade) before giving up

    def __init__(
        self,
        settings: TrainConfig,
        api: KubernetesApi | None = None,
        poll_s: float = 10.0,
        environment: dict[str, str] | None = None,
    ):
        self.settings, self.api, self.poll_s, self.environment = settings, api, poll_s, environment or {}

    def train(self, spec_uri: str, run_id: str, log_path: Path) -> int:
        owner = task_pod_owner(os.environ)
        job = job_for_run(
            load_job_manifest(self.settings.kubernetes_job),
            self.settings,
            spec_uri,
            run_id,
            self.environment,
            owner,
            task_timeout_s(os.environ),
        )
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        api = self.api or _in_cluster_api()
        with open(log_path, "a", buffering=1) as log_file:
            if owner is None:
                _note(
                    log_file, f"not in a task pod: nothing deletes Job {namespace}/{name} if this is killed"
                )
            started = self._start(api, job, run_id, owner)
            _note(
                log_file,
                f"{started} Job {namespace}/{name}: {self.settings.nodes} node(s) x "
                f"{self.settings.nproc} ranks; node logs: kubectl -n {namespace} logs "
                f"-l batch.kubernetes.io/job-name={name} --prefix",
            )
            outcome = self._wait(api, namespace, name)
            _note(log_file, f"Job {namespace}/{name}: {outcome}")
            if outcome != "Complete":
                self._keep_for_its_logs(api, namespace, name, owner, log_file)
                return 1
        api.delete_job(namespace, name)
        return 0

    @staticmethod
    def _keep_for_its_logs(api: KubernetesApi, namespace: str, name: str, owner, log_file) -> None:
        """Disown a finished Job, so its pods (which hold nothing once they ended) keep their logs after this
        task's pod is deleted; a failure to is told, not raised: the Job then goes with the pod."""
        if owner is None:
            return
        try:
            api.set_job_owners(namespace, name, None)
            _note(log_file, f"Job {namespace}/{name} kept for its pods' logs until the next attempt")
        except KubernetesApiError as err:
            _note(
                log_file,
                f"Job {namespace}/{name} could not be kept for its logs ({err}): it goes with this pod",
            )

    def _start(
        self, api: KubernetesApi, job: dict[str, Any], run_id: str, owner: dict[str, Any] | None
    ) -> str:
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        for _ in range(3):
            if api.create_job(namespace, job):
                return "created"
            existing = api.read_job(namespace, name)
            training = (existing["metadata"].get("annotations") or {}).get(RUN_ID_ANNOTATION)
            if job_outcome(existing) is None:
                if training == run_id:
                    if owner is not None:  # adopted: it goes with this task's pod from now on
                        api.set_job_owners(namespace, name, [owner])
                    return "waiting for the running"
                raise TrainingFailed(
                    f"Job {namespace}/{name} is training run {training}; one multi-node training "
                    f"runs at a time: wait for it, or delete it to stop it"
                )
            api.delete_job(namespace, name)  # a finished attempt's Job, kept until now for its logs
            time.sleep(self.poll_s)
        raise TrainingFailed(f"Job {namespace}/{name} from an earlier attempt is still being deleted")

    def _wait(self, api: KubernetesApi, namespace: str, name: str) -> str:
        errors = 0
        while True:
            try:
                outcome = job_outcome(api.read_job(namespace, name))
                errors = 0
            except KubernetesApiError as err:
                errors += 1
                if not err.transient or errors > self.api_errors_tolerated:
                    raise TrainingFailed(f"lost track of Job {namespace}/{name}: {err}") from err
                log.warning("reading Job %s/%s failed (%s); trying again", namespace, name, err)
                outcome = None
            if outcome:
                return outcome
            time.sleep(self.poll_s)


def _note(log_file, message: str) -> None:
    log.info("%s", message)
    log_file.write(message + "\n")


def _in_cluster_api() -> KubernetesApi:
    try:
        return KubernetesApi.in_cluster()
    except NotInCluster as err:
        raise TrainingFailed(
            "train.launcher 'kubernetes' creates the node Job from a pod of the cluster, and "
            "this process runs outside one; here use train.launcher torchrun"
        ) from err
