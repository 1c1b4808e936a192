"""What each task of a run held, for how long, and what that cost.

Every stage task (and each SGLang fleet between its scale-up and scale-down) writes one record per
attempt, `runs/<run_id>/usage/<task>-<start>-<random>.json`: its wall time, the GPUs it held (the deployment's
placement of the stage for the run's engine; a multi-node training's nodes times their GPUs; a fleet's
replicas times `gpus_per_replica`) and the deployment's `gpu_hour_usd`. Failed attempts count: a run
costs what it held. The summary, the report and `drafter status` add them up per stage.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import Field

from pipeline import layout
from pipeline.config_base import Strict
from pipeline.ids import validate_id
from pipeline.records import RunCost, StageCost
from pipeline.storage import ObjectStore

log = logging.getLogger("drafter.usage")

USAGE_DIR = "usage"


class Rates(Strict):
    """What a run's tasks hold, as the deployment places them for the run's engines
    (pipeline.ops.deployment.usage_rates)."""

    gpus: dict[str, int] = Field(default_factory=dict, description="GPUs each stage's task holds")
    fleet_gpus_per_replica: dict[str, int] = Field(default_factory=dict)
    gpu_hour_usd: float | None = Field(None, ge=0)


def rates_of(data: dict[str, Any] | None) -> Rates | None:
    """The rates a configure step passed on (None: nothing is recorded)."""
    return Rates.model_validate(data) if data else None


class TaskUsage(Strict):
    task: str
    stage: str
    started_at: str
    seconds: float = Field(ge=0)
    gpus: int = Field(ge=0)
    gpu_hour_usd: float | None = Field(None, ge=0)
    outcome: Literal["succeeded", "failed"]

    @property
    def gpu_hours(self) -> float:
        return self.seconds / 3600 * self.gpus

    @property
    def cost_usd(self) -> float | None:
        return None if self.gpu_hour_usd is None else self.gpu_hours * self.gpu_hour_usd


def usage_prefix(run_id: str) -> str:
    return f"{layout.run_prefix(run_id)}/{USAGE_DIR}"


def record_usage(store: ObjectStore, run_id: str, usage: TaskUsage) -> None:
    validate_id(usage.task, "task")
    stamp = usage.started_at.replace(":", "").replace("-", "").replace("+", "")
    key = f"{usage_prefix(run_id)}/{usage.task}-{stamp}-{uuid.uuid4().hex[:8]}.json"  # one per attempt
    store.put_bytes(key, usage.model_dump_json().encode())


@contextmanager
def metered(store: ObjectStore, run_id: str, task: str, stage: str, rates: Rates | None) -> Iterator[None]:
    """Time the block and record what it held, however it ends (nothing without `rates`)."""
    started, clock = dt.datetime.now(dt.UTC), time.monotonic()
    outcome: Literal["succeeded", "failed"] = "failed"
    try:
        yield
        outcome = "succeeded"
    finally:
        if rates is not None:
            usage = TaskUsage(
                task=task,
                stage=stage,
                started_at=started.isoformat(),
                seconds=round(time.monotonic() - clock, 3),
                gpus=rates.gpus.get(stage, 0),
                gpu_hour_usd=rates.gpu_hour_usd,
                outcome=outcome,
            )
            _record_quietly(store, run_id, usage)


def record_fleet(
    store: ObjectStore, run_id: str, stage: str, scaled: dict[str, Any], rates: Rates | None
) -> None:
    """A fleet's servers, held from its scale-up (`scaled`, what scale_up returned) until now."""
    if rates is None or not scaled.get("scaled"):
        return
    started = dt.datetime.fromisoformat(scaled["scaled_at"])
    usage = TaskUsage(
        task=f"{stage}-fleet",
        stage=f"{stage} fleet",
        started_at=started.isoformat(),
        seconds=round((dt.datetime.now(dt.UTC) - started).total_seconds(), 3),
        gpus=scaled["replicas"] * rates.fleet_gpus_per_replica.get(stage, 0),
        gpu_hour_usd=rates.gpu_hour_usd,
        outcome="succeeded",
    )
    _record_quietly(store, run_id, usage)


def _record_quietly(store: ObjectStore, run_id: str, usage: TaskUsage) -> None:
    """A usage record that cannot be written is logged: it must not fail the task it measured."""
    try:
        record_usage(store, run_id, usage)
    except Exception as err:
        log.warning("the usage of %s was not recorded: %s", usage.task, err)


def read_usage(store: ObjectStore, run_id: str) -> list[TaskUsage]:
    prefix = usage_prefix(run_id)
    return [
        TaskUsage.model_validate(json.loads(store.get_bytes(key)))
        for key in store.list(prefix)
        if key.endswith(".json")
    ]


def run_cost(
    records: list[TaskUsage], baseline_tok_s: float | None = None, drafter_tok_s: float | None = None
) -> RunCost:
    """Wall time, GPU-hours and cost per stage (in the order the stages first ran) and in total (cost None
    where no GPU price was configured); with the benchmark's throughputs, what the drafter saves per 1,000
    generated tokens on the benchmark's GPUs."""
    stages: dict[str, dict[str, Any]] = {}
    for usage in sorted(records, key=lambda u: u.started_at):
        row = stages.setdefault(
            usage.stage,
            {"stage": usage.stage, "attempts": 0, "seconds": 0.0, "gpu_hours": 0.0, "cost_usd": 0.0},
        )
        row["attempts"] += 1
        row["seconds"] += usage.seconds
        row["gpu_hours"] += usage.gpu_hours
        cost = usage.cost_usd
        row["cost_usd"] = None if cost is None or row["cost_usd"] is None else row["cost_usd"] + cost
    rows = [StageCost.model_validate(row) for row in stages.values()]
    costs = [row.cost_usd for row in rows]
    saved = None
    bench = [u for u in records if u.stage == "benchmark" and u.outcome == "succeeded"]
    if bench and baseline_tok_s and drafter_tok_s:
        saved = saved_per_1k_tokens(baseline_tok_s, drafter_tok_s, bench[-1].gpus, bench[-1].gpu_hour_usd)
    priced = [c for c in costs if c is not None]
    return RunCost(
        stages=rows,
        gpu_hours=sum(row.gpu_hours for row in rows),
        cost_usd=sum(priced) if rows and len(priced) == len(rows) else None,
        saved_usd_per_1k_tokens=saved,
    )


def dollars(cost_usd: float | None) -> str:
    return "no GPU price in the deployment config" if cost_usd is None else f"${cost_usd:,.2f}"


def cost_rows(cost: RunCost) -> list[tuple[str, str]]:
    """The cost per stage, the total and the serving saving, as rows of a table."""
    rows = [
        (
            f"cost: {row.stage}",
            f"{row.seconds:,.0f} s wall, {row.gpu_hours:,.2f} GPU-hours, {dollars(row.cost_usd)}"
            + (f" ({row.attempts} attempts)" if row.attempts > 1 else ""),
        )
        for row in cost.stages
    ]
    rows.append(("cost: total", f"{cost.gpu_hours:,.2f} GPU-hours, {dollars(cost.cost_usd)}"))
    if cost.saved_usd_per_1k_tokens is not None:
        rows.append(
            (
                "serving cost saved per 1K generated tokens",
                f"${cost.saved_usd_per_1k_tokens:,.6f} (benchmark's GPUs)",
            )
        )
    return rows


def saved_per_1k_tokens(
    baseline_tok_s: float, drafter_tok_s: float, gpus: int, gpu_hour_usd: float | None
) -> float | None:
    """What serving 1,000 generated tokens costs less with the drafter, on the benchmark's GPUs and price
    (negative: it costs more); None without GPUs or a price."""
    if not gpus or gpu_hour_usd is None or baseline_tok_s <= 0 or drafter_tok_s <= 0:
        return None
    seconds_saved = 1000 / baseline_tok_s - 1000 / drafter_tok_s
    return seconds_saved / 3600 * gpus * gpu_hour_usd
