"""Whether a planned run (pipeline.ops.capacity.plan) finishes within a deployment's limits, and what would
make it fit: `drafter plan --deployment` prints it, and each DAG's configure task refuses, before anything
starts, a run its limits cannot hold (`refuse_unfit`), naming the binding stage and the changes that fit.

The limits come as plain data (DeploymentConfig.plan_limits: the train and shard tasks' timeouts, the shards
in flight, each DAG's deadline)
because the configure task runs in a pod that has no deployment config."""

from __future__ import annotations

import math
from typing import Any

from pipeline.config import RunConfig
from pipeline.config_base import ConfigError

# A task's timeout kills its pod and loses what it did since its last checkpoint; each retry starts the
# clock again. One attempt must therefore fit the planned stage, with room for the plan's estimates.
TIMEOUT_MARGIN = 1.2

# the limits each DAG's configure enforces: those on the stages it runs
DAG_LIMITS = {
    "drafter_data": (
        "stages.generate.timeout_minutes",
        "stages.capture.timeout_minutes",
        "gpu_pool_slots",
        "deadline_minutes.drafter_data",
    ),
    "drafter_train": ("stages.train.timeout_minutes", "deadline_minutes.drafter_train"),
}
DATA_STAGES = ("generate", "capture")


def deployment_fit(report: dict[str, Any], limits: dict[str, Any], shard_size: int) -> list[dict[str, Any]]:
    """Whether the deployment's limits let the planned run finish: the train task's timeout against the
    planned training (one attempt trains the whole run: TIMEOUT_MARGIN), each shard task's timeout against
    one shard's time (`shard_checks`), and each DAG's deadline against the stages it runs (a deadline under
    the plan alerts on every run). Each check: what it limits, its hours, the planned hours, whether it fits
    and, where it does not, what would make it fit."""
    stages = report["stages"]
    train_limit = limits["train_timeout_minutes"] / 60
    checks = [
        {
            "limit": "stages.train.timeout_minutes",
            "hours": round(train_limit, 1),
            "planned_hours": stages["train"]["wall_hours"],
            "fits": train_limit >= TIMEOUT_MARGIN * stages["train"]["wall_hours"],
            "needs": f"{TIMEOUT_MARGIN:g} x the planned training: a timeout kills the attempt",
        }
    ]
    planned_by_dag = {
        "drafter_data": sum(stages[name]["wall_hours"] for name in DATA_STAGES),
        "drafter_train": stages["train"]["wall_hours"],
    }
    for dag_id, planned in planned_by_dag.items():
        minutes = limits["deadline_minutes"].get(dag_id)
        if minutes is not None:
            checks.append(
                {
                    "limit": f"deadline_minutes.{dag_id}",
                    "hours": round(minutes / 60, 1),
                    "planned_hours": round(planned, 1),
                    "fits": minutes / 60 >= planned,
                    "needs": "the planned stages: an earlier deadline alerts on every run",
                }
            )
    for check in checks:
        check["to_fit"] = [] if check["fits"] else ways_to_fit(check, report)
    return checks[:1] + shard_checks(report, limits, shard_size) + checks[1:]


def shard_checks(report: dict[str, Any], limits: dict[str, Any], shard_size: int) -> list[dict[str, Any]]:
    """Each data stage's shard task timeout against one shard's time: the shards in flight at once (the GPU
    pool's slots) share the stage's fleet, so each takes the stage's hours x in flight / shards. A timeout
    kills the shard task, and its retry starts the clock again (TIMEOUT_MARGIN)."""
    shards = max(math.ceil(report["samples"] / shard_size), 1)
    in_flight = min(limits["shards_in_flight"], shards)
    checks = []
    for name in DATA_STAGES:
        hours = limits["shard_timeout_minutes"][name] / 60
        shard_hours = report["stages"][name]["wall_hours"] * in_flight / shards
        fits = hours >= TIMEOUT_MARGIN * shard_hours
        check = {
            "limit": f"stages.{name}.timeout_minutes",
            "hours": round(hours, 1),
            "planned_hours": round(shard_hours, 1),
            "fits": fits,
            "needs": f"{TIMEOUT_MARGIN:g} x one shard's time, {in_flight} of {shards} shards sharing the "
            "fleet: a timeout kills the shard task",
            "to_fit": [],
        }
        if not fits:
            smaller = math.floor(shard_size * hours / (TIMEOUT_MARGIN * shard_hours))
            servers = _servers_needed(report["servers"][name], TIMEOUT_MARGIN * shard_hours, hours)
            check["to_fit"] = [
                f"{name} shards take {shard_hours:,.1f} h: prompts.shard_size of at most {smaller:,} "
                f"(it is {shard_size:,}); or {servers} {name} servers ({name}.sglang.urls; the plan has "
                f"{report['servers'][name]}); or stages.{name}.timeout_minutes of at least "
                f"{math.ceil(TIMEOUT_MARGIN * shard_hours * 60):,}"
            ]
        checks.append(check)
    return checks + [_clients_check(report, limits, shards)]


def _clients_check(report: dict[str, Any], limits: dict[str, Any], shards: int) -> dict[str, Any]:
    """The capture clients the plan counts on run as shard tasks at once: the pool must let that many run,
    or capture runs slower than planned (each client's parsing caps its share of the fleet)."""
    wanted = min(report["capture_paths"]["http"]["clients"], shards)
    slots = limits["shards_in_flight"]
    return {
        "limit": "gpu_pool_slots",
        "hours": None,
        "planned_hours": None,
        "count": slots,
        "planned_count": wanted,
        "fits": slots >= wanted,
        "needs": f"{wanted} capture shard tasks at once: the plan counts on {wanted} capture clients",
        "to_fit": [] if slots >= wanted else [f"gpu_pool_slots of at least {wanted}, and the pool as large"],
    }


def _servers_needed(servers: int, stage_hours: float, hours_left: float) -> int | None:
    """Servers (or nodes) that bring a stage bound per server down to `hours_left`, None when none can."""
    return math.ceil(servers * stage_hours / hours_left) if hours_left > 0 else None


def ways_to_fit(check: dict[str, Any], report: dict[str, Any]) -> list[str]:
    """What would make a failing check fit, each a setting and its value: the binding stage's fleet (its
    throughput scales with servers or nodes), a faster path where the plan has one, or the limit itself."""
    stages, limit = report["stages"], check["limit"]
    hours = check["hours"]
    if limit == "deadline_minutes.drafter_data":
        binding = max(DATA_STAGES, key=lambda name: stages[name]["wall_hours"])
        other = next(name for name in DATA_STAGES if name != binding)
        ways = []
        needed = _servers_needed(
            report["servers"][binding], stages[binding]["wall_hours"], hours - stages[other]["wall_hours"]
        )
        if needed is not None:
            ways.append(
                f"{needed} {binding} servers ({binding}.sglang.urls; the plan has "
                f"{report['servers'][binding]})"
            )
        in_process = report["capture_paths"]["in_process"]["wall_hours"]
        if binding == "capture" and stages["capture"]["bottleneck"] != "GPU":
            if in_process + stages["generate"]["wall_hours"] <= hours:
                ways.append(
                    f"capture.engine inprocess (its plan: {in_process:,.1f} h of capture; run on SGLang "
                    "itself only on a CPU, docs/CAPACITY.md)"
                )
        ways.append(f"deadline_minutes.drafter_data of at least {math.ceil(check['planned_hours'] * 60):,}")
        return [
            f"{binding} binds ({stages[binding]['wall_hours']:,.1f} h, bound by "
            f"{stages[binding]['bottleneck']}): " + "; or ".join(ways)
        ]
    factor = TIMEOUT_MARGIN if limit == "stages.train.timeout_minutes" else 1.0
    needed_hours = factor * stages["train"]["wall_hours"]
    nodes = _servers_needed(report["train_nodes"], needed_hours, hours)
    return [
        f"train binds ({stages['train']['wall_hours']:,.1f} h, bound by {stages['train']['bottleneck']}): "
        f"train.nodes {nodes} (the plan has {report['train_nodes']}); or {limit} of at least "
        f"{math.ceil(needed_hours * 60):,}"
    ]


def format_fit(checks: list[dict[str, Any]], deployment_path: str) -> str:
    lines = [f"deployment limits ({deployment_path}):"]
    for check in checks:
        if check["hours"] is None:  # a count
            verdict = "fits" if check["fits"] else f"TOO FEW: needs {check['needs']}"
            figures = f"{check['count']:>9,}    planned {check['planned_count']:,}"
        else:
            verdict = "fits" if check["fits"] else f"TOO SHORT: needs {check['needs']}"
            figures = f"{check['hours']:>9,.1f} h  planned {check['planned_hours']:,.1f} h"
        lines.append(f"  {check['limit']:<36}{figures}: " + verdict)
        lines += [f"    to fit: {way}" for way in check.get("to_fit", [])]
    return "\n".join(lines)


def refuse_unfit(config: RunConfig, limits: dict[str, Any], dag_id: str, config_path: str) -> None:
    """A ConfigError, before any stage starts, when the run `config` asks for cannot finish within the limits
    on `dag_id`'s stages: its capacity plan at prompts.num_samples, as `drafter plan` makes it."""
    from pipeline.ops.capacity import PlanError, plan

    samples = config.prompts.num_samples
    try:
        report = plan(config, samples, compare=False)
    except PlanError as err:
        raise ConfigError(
            f"run config {config_path}: configure checks a run against the deployment's limits with its "
            f"capacity plan, which cannot be made: {err}"
        ) from err
    failing = [
        check
        for check in deployment_fit(report, limits, config.prompts.shard_size)
        if check["limit"] in DAG_LIMITS[dag_id] and not check["fits"]
    ]
    if failing:
        lines = [
            f"run config {config_path} cannot finish within the deployment's limits at {samples:,} samples "
            f"(`drafter plan --config {config_path} --samples {samples} --deployment ...` shows the plan):"
        ]
        for check in failing:
            if check["hours"] is None:
                lines.append(
                    f"  {check['limit']} is {check['count']:,}; the plan needs {check['planned_count']:,} "
                    f"({check['needs']})"
                )
            else:
                lines.append(
                    f"  {check['limit']} is {check['hours']:,.1f} h; the plan needs "
                    f"{check['planned_hours']:,.1f} h ({check['needs']})"
                )
            lines += [f"  to fit: {way}" for way in check["to_fit"]]
        raise ConfigError("\n".join(lines))
