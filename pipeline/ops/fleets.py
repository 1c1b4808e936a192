"""SGLang server fleets that exist only while a run needs them.

The generation and capture servers are StatefulSets (infra/k8s/sglang-*.yaml) kept at 0 replicas. The
drafter_data DAG scales a fleet up to the servers its stage calls (the config's `sglang.urls`) right
before the stage, waits until every server is ready, and scales it back to 0 after the stage in a
teardown task that runs however the stage ended. Between runs the fleets hold no GPUs
(docs/CAPACITY.md counts what they would cost left up).

A URL must name a pod of the fleet's StatefulSet (`http://<statefulset>-<i>.<service>.<namespace>.svc:<port>`),
else the servers the stage calls are not the ones that were scaled: refused before anything scales.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field

from pipeline.config import ConfigError, RunConfig
from pipeline.config_base import Strict
from pipeline.ops.kube_api import KubernetesApi, KubernetesApiError
from pipeline.retrying import answers_health

log = logging.getLogger(__name__)

FLEET_STAGES = ("generate", "capture")
K8S_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class ServerFleet(Strict):
    """One StatefulSet of SGLang servers that a stage's `sglang.urls` point at."""

    namespace: str = Field("sglang", pattern=K8S_NAME)
    statefulset: str = Field(pattern=K8S_NAME)
    ready_timeout_seconds: int = Field(
        3600,
        ge=1,
        description="loading Kimi-K2.5 (~600 GB) onto 8 GPUs takes "
        "many minutes; past this the fleet goes back to 0",
    )
    poll_seconds: float = Field(5.0, gt=0, description="how often the StatefulSet and the servers are asked")
    gpus_per_replica: int = Field(
        8,
        ge=0,
        description="the GPUs each server pod requests (its StatefulSet's): what a run's usage counts",
    )


class FleetNotReady(RuntimeError):
    """The servers did not all become ready in time (the fleet was scaled back to 0): a retry may pass."""


def fleet_urls(config: RunConfig, stage: str) -> list[str]:
    """The servers the stage calls; empty when the stage does not use SGLang."""
    if stage not in FLEET_STAGES:
        raise ConfigError(f"no server fleet serves stage {stage!r}; fleets serve {', '.join(FLEET_STAGES)}")
    settings = getattr(config, stage)
    return list(settings.sglang.urls) if settings.engine == "sglang" else []


def replicas_for(urls: list[str], fleet: ServerFleet, stage: str) -> int:
    """How many replicas serve `urls`: the highest pod ordinal they name, plus one."""
    pod_name = re.compile(
        rf"^{re.escape(fleet.statefulset)}-(\d+)\.[a-z0-9-]+\.{re.escape(fleet.namespace)}\.svc"
        r"(\.cluster\.local)?$"
    )
    ordinals = []
    for i, url in enumerate(urls):
        match = pod_name.match(urlsplit(url).hostname or "")
        if not match:
            raise ConfigError(
                f"{stage}.sglang.urls[{i}] {url} is not a pod of StatefulSet "
                f"{fleet.namespace}/{fleet.statefulset} "
                f"(expected http://{fleet.statefulset}-<i>.<service>.{fleet.namespace}.svc:<port>): "
                "the DAG scales that StatefulSet, so the stage would call servers nobody started"
            )
        ordinals.append(int(match.group(1)))
    return max(ordinals) + 1 if ordinals else 0


def scale_up(
    config: RunConfig,
    stage: str,
    fleet: ServerFleet,
    api: KubernetesApi | None = None,
    healthy: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Scale the fleet to the stage's servers and wait until each is ready and answers /health."""
    urls = fleet_urls(config, stage)
    replicas = replicas_for(urls, fleet, stage)
    where = f"{fleet.namespace}/{fleet.statefulset}"
    if not replicas:
        log.info("%s does not use SGLang servers: fleet %s stays as it is", stage, where)
        return {"stage": stage, "statefulset": where, "replicas": 0, "scaled": False}
    api = api or KubernetesApi.in_cluster()
    started, scaled_at = time.monotonic(), dt.datetime.now(dt.UTC)
    api.scale_statefulset(fleet.namespace, fleet.statefulset, replicas)
    log.info(
        "fleet %s: scaled to %d replicas for %s; waiting up to %d s for them",
        where,
        replicas,
        stage,
        fleet.ready_timeout_seconds,
    )
    try:
        _await_ready(api, fleet, replicas, urls, healthy or answers_health, started)
    except FleetNotReady:
        scale_down(fleet, api)
        raise
    seconds = time.monotonic() - started
    log.info("fleet %s: %d/%d ready after %.0f s", where, replicas, replicas, seconds)
    return {
        "stage": stage,
        "statefulset": where,
        "replicas": replicas,
        "scaled": True,
        "scaled_at": scaled_at.isoformat(),
        "ready_seconds": round(seconds, 1),
    }


def scale_down(fleet: ServerFleet, api: KubernetesApi | None = None) -> dict[str, Any]:
    """Scale the fleet to 0 (it holds no GPUs until the next run scales it up)."""
    api = api or KubernetesApi.in_cluster()
    api.scale_statefulset(fleet.namespace, fleet.statefulset, 0)
    log.info("fleet %s/%s: scaled to 0", fleet.namespace, fleet.statefulset)
    return {"statefulset": f"{fleet.namespace}/{fleet.statefulset}", "replicas": 0}


def _await_ready(
    api: KubernetesApi,
    fleet: ServerFleet,
    replicas: int,
    urls: list[str],
    healthy: Callable[[str], bool],
    started: float,
) -> None:
    where = f"{fleet.namespace}/{fleet.statefulset}"
    deadline = started + fleet.ready_timeout_seconds
    last_note = started
    while True:
        ready = _ready_replicas(api, fleet)
        waiting_for = [url for url in urls if not healthy(url)] if ready >= replicas else urls
        if not waiting_for:
            return
        now = time.monotonic()
        if now >= deadline:
            raise FleetNotReady(
                f"fleet {where}: {ready}/{replicas} replicas ready after {now - started:.0f} s "
                f"(ready_timeout_seconds {fleet.ready_timeout_seconds}); not answering: "
                f"{', '.join(waiting_for)}; scaled back to 0. See `kubectl -n {fleet.namespace} "
                f"describe pod {fleet.statefulset}-0` and its logs"
            )
        if now - last_note >= 60:
            log.info("fleet %s: %d/%d ready after %.0f s", where, ready, replicas, now - started)
            last_note = now
        time.sleep(min(fleet.poll_seconds, max(deadline - now, 0.1)))


def _ready_replicas(api: KubernetesApi, fleet: ServerFleet) -> int:
    try:
        status = api.read_statefulset(fleet.namespace, fleet.statefulset).get("status") or {}
    except KubernetesApiError as err:
        if not err.transient:
            raise
        log.warning(
            "reading StatefulSet %s/%s failed (%s); trying again", fleet.namespace, fleet.statefulset, err
        )
        return 0
    return int(status.get("readyReplicas") or 0)
