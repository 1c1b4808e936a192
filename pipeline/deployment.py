"""Where pipeline tasks run: in the scheduler's worker process (local) or in Kubernetes pods.

This is read when DAGs are parsed (from the file named by DRAFTER_DEPLOYMENT, default
configs/deployment/local.yaml), so it holds only placement: images, namespace, service account,
resources per stage, the Airflow pool of GPU-bound tasks, retries and timeouts. What a run does
stays in the run config the user picks when triggering.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator

from pipeline.config import ConfigError, Strict, resolve_project_path
from pipeline.stages import STAGES

DEFAULT_DEPLOYMENT = "configs/deployment/local.yaml"


class PodMount(Strict):
    """A volume a stage's pod mounts: a PVC, a ConfigMap or a Secret (never AWS keys: IRSA does S3)."""

    kind: Literal["pvc", "configmap", "secret"]
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    path: str = Field(pattern=r"^/")
    read_only: bool = True


class StageResources(Strict):
    image: Literal["pipeline", "trainer", "sglang"] = "pipeline"
    cpu: str = "1"
    memory: str = "4Gi"
    gpus: int = Field(0, ge=0)
    timeout_minutes: int = Field(60, ge=1)
    retries: int = Field(1, ge=0)
    use_pool: bool | None = Field(None, description="run in the GPU pool (default: when it asks for GPUs)")
    mounts: list[PodMount] = Field(default_factory=list, description="extra volumes of this stage's pod")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of this stage's pod")


class KubernetesPlacement(Strict):
    namespace: str = "drafter"
    service_account: str = Field("drafter-pipeline", description="IRSA / workload identity role with S3 access")
    images: dict[Literal["pipeline", "trainer", "sglang"], str]
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    node_selector_gpu: dict[str, str] = Field(default_factory=dict)
    config_volume_claim: str | None = Field(None, description="PVC with run configs, mounted at /etc/drafter")
    cache_volume_claim: str | None = Field(None, description="PVC for storage.local_cache (shared by the training "
                                                             "launcher and workers), mounted at cache_path")
    cache_path: str = "/data/drafter-cache"


class DeploymentConfig(Strict):
    executor: Literal["local", "kubernetes"] = "local"
    gpu_pool: str = Field("drafter_gpu", description="Airflow pool that GPU-bound tasks share")
    retry_delay_seconds: int = Field(60, ge=0)
    aws_conn_id: str | None = Field("aws_default", description="connection holding S3 credentials (local executor)")
    retrain_cron: str | None = Field("0 4 * * 0", description="drafter_train also runs on this cron (UTC); "
                                                             "null: only when a dataset is published")
    stages: dict[str, StageResources] = Field(default_factory=dict)
    kubernetes: KubernetesPlacement | None = None

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, stages: dict[str, StageResources]) -> dict[str, StageResources]:
        unknown = sorted(set(stages) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown stages {unknown}; stages are {', '.join(STAGES)}")
        return stages

    def stage(self, name: str) -> StageResources:
        if name not in STAGES:
            raise ConfigError(f"unknown stage {name!r}")
        return self.stages.get(name, StageResources())

    def task_options(self, name: str) -> dict[str, Any]:
        """Airflow task arguments for a stage: retries, timeout, and the GPU pool when it needs GPUs."""
        import datetime as dt

        stage = self.stage(name)
        options: dict[str, Any] = {"retries": stage.retries, "retry_delay": dt.timedelta(seconds=self.retry_delay_seconds),
                                   "execution_timeout": dt.timedelta(minutes=stage.timeout_minutes)}
        if stage.use_pool if stage.use_pool is not None else stage.gpus > 0:
            options["pool"] = self.gpu_pool
        return options

    def pod_options(self, name: str) -> dict[str, Any]:
        """Arguments of a Kubernetes pod for a stage (image, namespace, resources, GPU placement)."""
        if self.kubernetes is None:
            raise ConfigError("the kubernetes executor needs a kubernetes section in the deployment config")
        from kubernetes.client import models as k8s

        stage, placement = self.stage(name), self.kubernetes
        limits = {"cpu": stage.cpu, "memory": stage.memory}
        if stage.gpus:
            limits["nvidia.com/gpu"] = str(stage.gpus)
        options: dict[str, Any] = {
            "image": placement.images[stage.image], "namespace": placement.namespace,
            "service_account_name": placement.service_account, "image_pull_policy": placement.image_pull_policy,
            "container_resources": k8s.V1ResourceRequirements(requests=dict(limits), limits=limits),
            "name": f"drafter-{name}", "env_vars": {"DS_ACCELERATOR": "cuda" if stage.gpus else "cpu", **stage.env},
            "get_logs": True, "do_xcom_push": True,
        }
        if stage.gpus and placement.node_selector_gpu:
            options["node_selector"] = placement.node_selector_gpu
        mounts = list(stage.mounts)
        if placement.config_volume_claim:
            mounts.append(PodMount(kind="pvc", name=placement.config_volume_claim, path="/etc/drafter"))
        if placement.cache_volume_claim:
            mounts.append(PodMount(kind="pvc", name=placement.cache_volume_claim, path=placement.cache_path,
                                   read_only=False))
        if mounts:
            options["volumes"] = [_volume(k8s, f"mount-{i}", mount) for i, mount in enumerate(mounts)]
            options["volume_mounts"] = [k8s.V1VolumeMount(name=f"mount-{i}", mount_path=mount.path,
                                                          read_only=mount.read_only) for i, mount in enumerate(mounts)]
        return options


def _volume(k8s, name: str, mount: PodMount):
    if mount.kind == "pvc":
        return k8s.V1Volume(name=name, persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=mount.name, read_only=mount.read_only))
    if mount.kind == "configmap":
        return k8s.V1Volume(name=name, config_map=k8s.V1ConfigMapVolumeSource(name=mount.name))
    return k8s.V1Volume(name=name, secret=k8s.V1SecretVolumeSource(secret_name=mount.name, default_mode=0o400))


def load_deployment(path: str | Path | None = None) -> DeploymentConfig:
    location = resolve_project_path(str(path or os.environ.get("DRAFTER_DEPLOYMENT", DEFAULT_DEPLOYMENT)))
    try:
        data = yaml.safe_load(location.read_text()) or {}
        return DeploymentConfig.model_validate(data)
    except FileNotFoundError as err:
        raise ConfigError(f"deployment config not found: {location}") from err
    except (yaml.YAMLError, ValidationError) as err:
        raise ConfigError(f"invalid deployment config {location}:\n{err}") from err
