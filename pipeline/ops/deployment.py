"""Where pipeline tasks run: in the scheduler's worker process (local) or in Kubernetes pods.

This is read when DAGs are parsed (from the file named by DRAFTER_DEPLOYMENT, default
configs/deployment/local.yaml), so it holds only placement: images, namespace, service account,
resources per stage, volumes, the Airflow pool of GPU-bound tasks, retries and timeouts, and the run
config scheduled runs use. What a run does stays in that run config (or the one picked when triggering).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt, ValidationError, field_validator, model_validator

from pipeline.benchmark_settings import ENGINE_NAMES
from pipeline.config import ConfigError, validation_problems
from pipeline.config_base import Strict, refuse_unknown, resolve_project_path
from pipeline.ops.alerts import ALERT_EVENTS, AlertEvent
from pipeline.ops.fleets import ServerFleet
from pipeline.ops.usage import Rates
from pipeline.ops.watch import RetrainWatch
from pipeline.stages import STAGES
from pipeline.yaml_files import read_yaml_file

DEFAULT_DEPLOYMENT = "configs/deployment/local.yaml"


class PodMount(Strict):
    """A volume a stage's pod mounts: a PVC, a ConfigMap or a Secret (never AWS keys: IRSA does S3)."""

    kind: Literal["pvc", "configmap", "secret"]
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    path: str = Field(pattern=r"^/")
    read_only: bool = True


class Toleration(Strict):
    key: str
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


# Steps placed like stages that are not stages of a run themselves: `configure` reads the run config
# (mounted in pods) once, so nothing downstream needs the file; `fleet` scales an SGLang fleet up
# before its stage and down after it (pipeline.ops.fleets).
PLACED_STEPS = ("configure", "fleet", *STAGES)


ImageName = Literal["pipeline", "trainer", "sglang", "vllm"]
# The stages whose pod follows the run's engine: the run-config setting naming it (`<section>.<field>`) and
# its values. Parity runs the capture engine; training's pod follows its launcher: with `kubernetes` it only
# creates the Job of node pods and waits for it, so it needs no GPU of its own.
ENGINE_STAGES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "generate": ("generate", "engine", ("hf", "sglang", "vllm")),
    "parity": ("capture", "engine", ("hf", "sglang", "inprocess")),
    "capture": ("capture", "engine", ("hf", "sglang", "inprocess")),
    "benchmark": ("benchmark", "engine", ENGINE_NAMES),
    "train": ("train", "launcher", ("torchrun", "kubernetes")),
}


def run_engines(config: Any) -> dict[str, str]:
    """The engine of each stage in ENGINE_STAGES for a run config: what its pod is placed by."""
    return {
        stage: getattr(getattr(config, section), field)
        for stage, (section, field, _) in ENGINE_STAGES.items()
    }


def usage_rates(table: dict[str, Any], config: Any) -> Rates:
    """A run's rates from the deployment's usage table (DeploymentConfig.usage_table): each stage's GPUs as
    placed for the run's engines. Training's: its pod's times its nodes with the torchrun launcher; with the
    kubernetes launcher its pod's (it only watches) and the node Job's, nodes times the GPUs its manifest
    (train.kubernetes_job) has each node pod hold."""
    engines = run_engines(config)
    gpus = {}
    for stage, entry in table["stages"].items():
        held = entry["engines"].get(engines.get(stage), entry["gpus"])
        if stage == "train" and config.train.launcher == "kubernetes":
            from pipeline.training.nodes import load_job_manifest, node_gpus

            held += config.train.nodes * node_gpus(load_job_manifest(config.train.kubernetes_job))
        elif stage == "train":
            held *= config.train.nodes
        gpus[stage] = held
    return Rates(gpus=gpus, fleet_gpus_per_replica=table["fleets"], gpu_hour_usd=table["gpu_hour_usd"])


class EnginePlacement(Strict):
    """A stage's pod for one engine of its section, where it differs from the stage's own placement: a
    vLLM benchmark in the vLLM image; in-process capture in the SGLang image on a GPU node."""

    image: ImageName | None = None
    cpu: str | None = None
    memory: str | None = None
    gpus: int | None = Field(None, ge=0)


class ScratchVolume(Strict):
    """Node-local scratch for a stage's pod: an emptyDir of `size` at `path`, the pod's TMPDIR (where the
    capture client spills hidden states and spools shard parts), and as much ephemeral storage requested
    and limited for its container, so that the scheduler places the pod on a node with the room and the
    kubelet evicts it only past what it asked for. Without one, TMPDIR is the container's root disk,
    which a pod that requests no ephemeral storage shares with every other pod of its node."""

    path: str = Field("/scratch", pattern=r"^/")
    size: str = Field(pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)$", description="e.g. 64Gi")


class StageResources(Strict):
    image: ImageName = "pipeline"
    engines: dict[str, EnginePlacement] = Field(
        default_factory=dict,
        description="generate, parity, capture and benchmark: the pod's image and resources by the run "
        "config's engine (train: by train.launcher), where they differ from the stage's own; applied when "
        "the pod is created",
    )
    cpu: str = "1"
    memory: str = "4Gi"
    gpus: int = Field(0, ge=0)
    timeout_minutes: int = Field(60, ge=1)
    retries: int = Field(1, ge=0)
    use_pool: bool | None = Field(None, description="run in the GPU pool (default: when it asks for GPUs)")
    mounts: list[PodMount] = Field(default_factory=list, description="extra volumes of this stage's pod")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of this stage's pod")
    scratch: ScratchVolume | None = Field(
        None, description="node-local scratch for the pod's temporary files (its TMPDIR), requested as such"
    )

    def for_engine(self, engine: str | None) -> StageResources:
        """This stage's placement when its pod runs `engine` (its own where `engines` names none)."""
        placement = self.engines.get(engine) if engine else None
        if placement is None:
            return self
        return self.model_copy(update=placement.model_dump(exclude_none=True))


class PodUser(Strict):
    """Who every task pod runs as, whatever its image: one uid and group for all, so that a file one
    stage writes on a shared volume (evaluate's candidate drafter) another may replace (promote)."""

    uid: int = Field(50000, ge=1, description="runAsUser; never 0 (runAsNonRoot is set)")
    gid: int = Field(0, ge=0, description="runAsGroup")

    def security_context(self) -> dict[str, Any]:
        return {"runAsUser": self.uid, "runAsGroup": self.gid, "runAsNonRoot": True}


class KubernetesPlacement(Strict):
    namespace: str = "drafter"
    service_account: str = Field(
        "drafter-pipeline", description="IRSA / workload identity role with S3 access"
    )
    images: dict[ImageName, str]
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    run_as: PodUser = Field(
        default_factory=PodUser,
        description="the uid and group of every task pod (its securityContext), whatever its image's USER",
    )
    node_selector_gpu: dict[str, str] = Field(default_factory=dict)
    gpu_tolerations: list[Toleration] = Field(
        default_factory=list, description="GPU node pools are usually tainted (nvidia.com/gpu:NoSchedule)"
    )
    gpu_shm_size: str | None = Field(
        "64Gi",
        description="a memory-backed /dev/shm of this size on GPU pods "
        "(NCCL and data loaders; the runtime's default is 64 MB)",
    )
    schedule_timeout_seconds: int = Field(
        1800, ge=1, description="how long a pod may wait for a node: a GPU node scale-up takes minutes"
    )
    startup_timeout_seconds: int = Field(
        1800,
        ge=1,
        description="how long a scheduled pod may take to start: pulling a multi-GB image takes minutes",
    )
    volumes: list[PodMount] = Field(
        default_factory=list,
        description="volumes every task pod mounts: the model weights and prompt files the run configs name",
    )
    config_volume_claim: str | None = Field(None, description="PVC with run configs, mounted at /etc/drafter")
    cache_volume_claim: str | None = Field(
        None,
        description="PVC for storage.local_cache (shared by the training "
        "launcher and workers), mounted at cache_path",
    )
    cache_path: str = "/data/drafter-cache"
    fleets: dict[Literal["generate", "capture"], ServerFleet] = Field(
        default_factory=dict,
        description="SGLang StatefulSets kept at 0 replicas between runs: scaled up to the "
        "stage's sglang.urls before the stage and back to 0 after it",
    )

    def common_mounts(self) -> list[PodMount]:
        """What every task pod mounts, whatever its stage."""
        mounts = list(self.volumes)
        if self.config_volume_claim:
            mounts.append(PodMount(kind="pvc", name=self.config_volume_claim, path=CONFIG_MOUNT_PATH))
        if self.cache_volume_claim:
            mounts.append(
                PodMount(kind="pvc", name=self.cache_volume_claim, path=self.cache_path, read_only=False)
            )
        return mounts


CONFIG_MOUNT_PATH = "/etc/drafter"

DAG_IDS = ("drafter_data", "drafter_train")


class NotifierConfig(Strict):
    """Where alerts go, through an Airflow notifier: `slack` (the Slack provider's incoming-webhook
    notifier), `email` (the SMTP provider's) or `webhook` (the HTTP provider's, a JSON POST). The address
    and every secret (webhook token, SMTP password, an Authorization header) live in the Airflow
    connection `conn_id`, never here."""

    kind: Literal["slack", "email", "webhook"]
    conn_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,249}$")
    events: list[AlertEvent] = Field(
        default_factory=lambda: list(ALERT_EVENTS),
        min_length=1,
        description="which alerts: failure, rejection, promotion, inconclusive, deadline (default: all)",
    )
    to: list[str] = Field(default_factory=list, description="email: the recipients")
    from_email: str | None = Field(None, description="email: the sender (default: the connection's)")
    endpoint: str = Field("", description="webhook: the path under the connection's host")

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> NotifierConfig:
        if self.kind == "email" and not self.to:
            raise ValueError("an email notifier needs `to` (its recipients)")
        if self.kind != "email" and (self.to or self.from_email):
            raise ValueError(f"`to` and `from_email` are for email notifiers, not {self.kind}")
        if self.kind != "webhook" and self.endpoint:
            raise ValueError(f"`endpoint` is for webhook notifiers, not {self.kind}")
        if len(set(self.events)) != len(self.events):
            raise ValueError(f"events named twice: {self.events}")
        return self


class DeploymentConfig(Strict):
    executor: Literal["local", "kubernetes"] = "local"
    run_config: str = Field(
        "configs/local.yaml",
        description="the run config of scheduled runs (the retraining cron) and the trigger form's default",
    )
    gpu_pool: str = Field("drafter_gpu", description="Airflow pool that GPU-bound tasks share")
    gpu_pool_slots: PositiveInt = Field(
        2,
        description="the pool's size as the runbook sets it (`airflow pools set`): how many shard tasks "
        "share a fleet at once, which the plan checks each shard's time at",
    )
    retry_delay_seconds: int = Field(60, ge=0)
    aws_conn_id: str | None = Field(
        "aws_default", description="connection holding S3 credentials (local executor)"
    )
    gpu_hour_usd: float | None = Field(
        None,
        ge=0,
        description="the price of one GPU-hour: each run's cost per stage (summary, report, status)",
    )
    retrain_cron: str | None = Field(
        "0 4 * * 0",
        description="drafter_train also runs on this cron (UTC); null: only when a dataset is published",
    )
    watch: RetrainWatch | None = Field(
        None,
        description="retraining triggers besides the cron and a published dataset: the serving fleet's "
        "acceptance under a floor (drafter_train), another target revision served (drafter_data, then "
        "drafter_train on its dataset); polled by Airflow's triggerer",
    )
    stages: dict[str, StageResources] = Field(default_factory=dict)
    kubernetes: KubernetesPlacement | None = None
    notifiers: list[NotifierConfig] = Field(
        default_factory=list,
        description="where alerts go: failed tasks, gate rejections, promotions, inconclusive benchmarks, "
        "runs past their deadline",
    )
    deadline_minutes: dict[str, float] = Field(
        default_factory=dict,
        description="per DAG: a run still going this long after it was queued sends a deadline alert",
    )

    @field_validator("deadline_minutes")
    @classmethod
    def _positive_deadlines(cls, deadlines: dict[str, float]) -> dict[str, float]:
        refuse_unknown(deadlines, DAG_IDS, "deadlines for unknown DAGs")
        wrong = {dag: minutes for dag, minutes in deadlines.items() if not minutes > 0}
        if wrong:
            raise ValueError(f"a deadline is a positive number of minutes: {wrong}")
        return deadlines

    def notifiers_for(self, event: str) -> list[NotifierConfig]:
        """The notifiers that take an alert of this kind."""
        return [notifier for notifier in self.notifiers if event in notifier.events]

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, stages: dict[str, StageResources]) -> dict[str, StageResources]:
        refuse_unknown(stages, PLACED_STEPS, "unknown stages")
        return stages

    @model_validator(mode="after")
    def _kubernetes_has_placement(self) -> DeploymentConfig:
        if self.executor == "kubernetes" and self.kubernetes is None:
            raise ValueError("executor 'kubernetes' needs a kubernetes section (images, namespace, volumes)")
        problems = [
            problem for name, stage in self.stages.items() for problem in _engine_problems(name, stage)
        ]
        if self.kubernetes is not None:
            named = {
                name: {stage.image, *(p.image for p in stage.engines.values() if p.image)}
                for name, stage in self.stages.items()
            }
            problems += [
                f"stages.{name} runs in image {image!r}, which kubernetes.images does not name"
                for name, images in named.items()
                for image in sorted(images - set(self.kubernetes.images))
            ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def stage(self, name: str) -> StageResources:
        if name not in PLACED_STEPS:
            raise ConfigError(f"unknown stage {name!r}")
        return self.stages.get(name, StageResources())

    def task_options(self, name: str) -> dict[str, Any]:
        """Airflow task arguments for a stage: retries, timeout, and the GPU pool when it needs GPUs."""
        import datetime as dt

        stage = self.stage(name)
        options: dict[str, Any] = {
            "retries": stage.retries,
            "retry_delay": dt.timedelta(seconds=self.retry_delay_seconds),
            "execution_timeout": dt.timedelta(minutes=stage.timeout_minutes),
        }
        if stage.use_pool if stage.use_pool is not None else stage.gpus > 0:
            options["pool"] = self.gpu_pool
        return options

    def fleet(self, stage: str) -> dict[str, Any] | None:
        """The StatefulSet serving a stage's SGLang URLs (None: no fleet to scale, the servers are
        managed elsewhere), as plain data for a task's arguments."""
        fleets = self.kubernetes.fleets if self.kubernetes else {}
        return fleets[stage].model_dump() if stage in fleets else None

    def plan_limits(self) -> dict[str, Any]:
        """The limits a run's plan must fit (pipeline.ops.plan_fit): the train task's timeout, the shard
        tasks' timeouts with the shards in flight at once, and the DAGs' deadlines, as plain data."""
        return {
            "train_timeout_minutes": self.stage("train").timeout_minutes,
            "shard_timeout_minutes": {
                name: self.stage(name).timeout_minutes for name in ("generate", "capture")
            },
            "shards_in_flight": self.gpu_pool_slots,
            "deadline_minutes": dict(self.deadline_minutes),
        }

    def usage_table(self) -> dict[str, Any]:
        """What a run's tasks hold by stage and engine, the GPU price and the limits its plan must fit, as
        plain data: the configure step prices the run with it (`usage_rates`) and refuses a run that cannot
        finish within `limits` (pipeline.ops.plan_fit); tasks in pods have no deployment config."""
        fleets = self.kubernetes.fleets if self.kubernetes else {}
        return {
            "limits": self.plan_limits(),
            "gpu_hour_usd": self.gpu_hour_usd,
            "stages": {
                name: {
                    "gpus": stage.gpus,
                    "engines": {e: p.gpus for e, p in stage.engines.items() if p.gpus is not None},
                }
                for name, stage in self.stages.items()
            },
            "fleets": {stage: fleet.gpus_per_replica for stage, fleet in fleets.items()},
        }

    def follows_engine(self, name: str) -> bool:
        """Whether a stage's pod is placed by the run's engine (its `engines` name any)."""
        return bool(self.stage(name).engines)

    def pod_mounts(self, name: str) -> list[PodMount]:
        """Every volume a stage's pod mounts (the common ones, then the stage's own)."""
        if self.kubernetes is None:
            return []
        return self.kubernetes.common_mounts() + list(self.stage(name).mounts)

    def pod_options(self, name: str) -> dict[str, Any]:
        """Arguments of a Kubernetes pod for a stage (image, namespace, resources, GPU placement, volumes),
        as placed for no particular engine: `placed_fields` re-places a pod that follows the run's engine."""
        placement = self._kubernetes()
        stage = self.stage(name)
        from kubernetes.client import models as k8s

        from pipeline.exit_codes import POD_EXIT_CODES_ENV
        from pipeline.task_pod import TASK_POD_NAME_ENV, TASK_POD_UID_ENV, TASK_TIMEOUT_ENV

        def own(field_path: str) -> Any:
            selector = k8s.V1ObjectFieldSelector(field_path=field_path)
            return k8s.V1EnvVarSource(field_ref=selector)

        return {
            "namespace": placement.namespace,
            "service_account_name": placement.service_account,
            "image_pull_policy": placement.image_pull_policy,
            "name": f"drafter-{name}",
            "security_context": placement.run_as.security_context(),
            # DeepSpeed's accelerator is found in the pod (pipeline.stages.train): a GPU request is not a GPU
            "env_vars": {
                POD_EXIT_CODES_ENV: "1",
                TASK_TIMEOUT_ENV: str(stage.timeout_minutes * 60),
                **({"TMPDIR": stage.scratch.path} if stage.scratch else {}),
                **stage.env,
            },
            # the pod's own name and uid: what it starts in the cluster (the trainer Job) it owns, so that
            # goes when the pod does (pipeline.task_pod)
            "pod_runtime_info_envs": [
                k8s.V1EnvVar(name=TASK_POD_NAME_ENV, value_from=own("metadata.name")),
                k8s.V1EnvVar(name=TASK_POD_UID_ENV, value_from=own("metadata.uid")),
            ],
            "get_logs": True,
            "do_xcom_push": True,
            "schedule_timeout_seconds": placement.schedule_timeout_seconds,
            "startup_timeout_seconds": placement.startup_timeout_seconds,
            **self.placed_fields(name, None),
        }

    def placed_fields(self, name: str, engine: str | None) -> dict[str, Any]:
        """The pod fields that depend on where a stage runs, for a pod running `engine`: image, resources,
        GPU node selector, tolerations and shared memory, and the volumes."""
        from kubernetes.client import models as k8s

        placement = self._kubernetes()
        stage = self.stage(name).for_engine(engine)
        limits = {"cpu": stage.cpu, "memory": stage.memory}
        if stage.gpus:
            limits["nvidia.com/gpu"] = str(stage.gpus)
        mounts = self.pod_mounts(name)
        volumes = [_volume(k8s, f"mount-{i}", mount) for i, mount in enumerate(mounts)]
        volume_mounts = [
            k8s.V1VolumeMount(name=f"mount-{i}", mount_path=mount.path, read_only=mount.read_only)
            for i, mount in enumerate(mounts)
        ]
        if stage.scratch:
            limits["ephemeral-storage"] = stage.scratch.size
            volumes.append(
                k8s.V1Volume(
                    name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=stage.scratch.size)
                )
            )
            volume_mounts.append(k8s.V1VolumeMount(name="scratch", mount_path=stage.scratch.path))
        if stage.gpus and placement.gpu_shm_size:
            volumes.append(
                k8s.V1Volume(
                    name="dshm",
                    empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=placement.gpu_shm_size),
                )
            )
            volume_mounts.append(k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"))
        on_gpus = stage.gpus > 0
        return {
            "image": placement.images[stage.image],
            "container_resources": k8s.V1ResourceRequirements(requests=dict(limits), limits=limits),
            "node_selector": dict(placement.node_selector_gpu) if on_gpus else {},
            "tolerations": [k8s.V1Toleration(**t.model_dump()) for t in placement.gpu_tolerations]
            if on_gpus
            else [],
            "volumes": volumes,
            "volume_mounts": volume_mounts,
        }

    def _kubernetes(self) -> KubernetesPlacement:
        if self.kubernetes is None:
            raise ConfigError("the kubernetes executor needs a kubernetes section in the deployment config")
        return self.kubernetes


def _engine_problems(name: str, stage: StageResources) -> list[str]:
    """What is wrong with a stage's `engines`: only a stage with an engine has them, naming its engines."""
    if not stage.engines:
        return []
    if name not in ENGINE_STAGES:
        return [f"stages.{name}.engines: only {', '.join(ENGINE_STAGES)} follow an engine"]
    section, field, engines = ENGINE_STAGES[name]
    unknown = sorted(set(stage.engines) - set(engines))
    if unknown:
        return [
            f"stages.{name}.engines names unknown engines {unknown}; {section}.{field} is one of "
            f"{', '.join(engines)}"
        ]
    return []


def _volume(k8s, name: str, mount: PodMount):
    if mount.kind == "pvc":
        return k8s.V1Volume(
            name=name,
            persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                claim_name=mount.name, read_only=mount.read_only
            ),
        )
    if mount.kind == "configmap":
        return k8s.V1Volume(name=name, config_map=k8s.V1ConfigMapVolumeSource(name=mount.name))
    return k8s.V1Volume(
        name=name, secret=k8s.V1SecretVolumeSource(secret_name=mount.name, default_mode=0o400)
    )


def load_deployment(path: str | Path | None = None) -> DeploymentConfig:
    location = resolve_project_path(str(path or os.environ.get("DRAFTER_DEPLOYMENT", DEFAULT_DEPLOYMENT)))
    data = read_yaml_file(location, "deployment config")
    if data is None:  # an empty file: every default would be taken silently, the local cluster's included
        raise ConfigError(
            f"deployment config {location} is empty: give a deployment config (configs/deployment/ holds the "
            "local and the Kubernetes one)"
        )
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid deployment config {location}:\n{validation_problems(err)}") from err
