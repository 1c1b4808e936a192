"""What schedulers and the CLI call: a stage of the stage table (pipeline.stages) by name with config
path + overrides + URIs in, a small dict out (XCom-sized); shards of the mapped stages; planning a run
from its trigger form. No Airflow import here: DAG files call these."""

from __future__ import annotations

import dataclasses
import json
import logging
import posixpath
from pathlib import PurePosixPath
from typing import Any

from pipeline.config import ConfigError, RunConfig, load_config, overridden_code_settings
from pipeline.credentials import install_log_masking
from pipeline.failures import report_permanent_failures_by_exit_code
from pipeline.storage import open_store

SHARD_STAGES = ("generate", "capture")

# A task pod runs a script that imports this module and calls one function of it: what it logs, and the
# traceback of what it does not catch, show no URL's credentials; a permanent failure there must end the
# pod with its own exit code so the scheduler does not retry it (that hook prints through the masking one).
install_log_masking()
report_permanent_failures_by_exit_code()
log = logging.getLogger(__name__)


def run_stage_task(
    stage: str,
    config: RunConfig | str | dict[str, Any],
    run_id: str,
    overrides: list[str] | None = None,
    snapshot: str | None = None,
    rates: dict[str, Any] | None = None,
    **inputs: Any,
) -> dict[str, Any]:
    """A scheduler's task of one stage (pipeline.stages.run_stage): the config as a path, a dict (what the
    configure step resolved) or loaded, and the rates the configure step passed on; the stage's output as a
    dict. Inputs not given (or None) default to the artifacts of `snapshot` (data, default: the run id) and
    `run_id`."""
    from pipeline import stages
    from pipeline.ops.usage import rates_of

    config = _as_config(config, overrides)
    store = open_store(config.storage)
    given = {name: value for name, value in inputs.items() if value is not None}
    return stages.run_stage(stage, config, run_id, store, snapshot, rates_of(rates), **given).model_dump()


def run_configured_stage(stage: str, run: dict[str, Any], **inputs: Any) -> dict[str, Any]:
    """`run_stage_task` for a run its configure step resolved (`run`: its config, run id and rates), as
    the DAGs' stage tasks call it."""
    return run_stage_task(stage, run["config"], run["run_id"], rates=run["rates"], **inputs)


def gate_decision(
    config: RunConfig | str | dict[str, Any],
    run_id: str,
    overrides: list[str] | None = None,
    **inputs: Any,
) -> dict[str, Any]:
    """The gate as a decision instead of an error: a scheduler skips promotion when `passed` is false.
    The decision record is stored either way."""
    from pipeline.promotion import GateFailed

    try:
        return run_stage_task("gate", config, run_id, overrides, **inputs)
    except GateFailed as failed:
        return {"passed": False, "reasons": failed.reasons}


def promotion_outcome(
    config: RunConfig | str | dict[str, Any],
    run_id: str,
    overrides: list[str] | None = None,
    **inputs: Any,
) -> dict[str, Any]:
    """The promote stage with an inconclusive benchmark as an outcome instead of an error, as `gate_decision`
    takes a rejection: nothing is promoted, and the result says why and what to do (`inconclusive_notice`
    alerts it). A slower candidate still fails the task (PromotionRefused)."""
    from pipeline.promotion import BenchmarkInconclusive

    try:
        return run_stage_task("promote", config, run_id, overrides, **inputs)
    except BenchmarkInconclusive as unsure:
        log.warning("%s", unsure)
        return {"promoted": False, **unsure.outcome()}


def inconclusive_notice(run: dict[str, Any], promoted: dict[str, Any]) -> dict[str, Any] | None:
    """The alert for a benchmark that could not tell whether the candidate is faster (None for any other
    outcome of the promote task). `promoted`: what `promotion_outcome` returned."""
    from pipeline.ops.alerts import inconclusive_alert
    from pipeline.promotion import BENCH_OUTCOMES

    if promoted.get("outcome") != BENCH_OUTCOMES["inconclusive"]:
        return None
    config = _as_config(run["config"], None)
    alert = inconclusive_alert(
        run["run_id"],
        config.target.name,
        promoted["next_step"],
        promoted.get("undecided") or [],
        _report_address(config, run),
    )
    return dataclasses.asdict(alert)


def rejection_notice(run: dict[str, Any], decision: dict[str, Any]) -> dict[str, Any]:
    """The alert for a candidate the gate rejected (pipeline.ops.alerts), as plain data. `run`: the
    configure step's result; `decision`: `gate_decision`'s."""
    from pipeline.ops.alerts import rejection_alert

    config = _as_config(run["config"], None)
    alert = rejection_alert(
        run["run_id"], config.target.name, decision["reasons"], _report_address(config, run)
    )
    return dataclasses.asdict(alert)


def promotion_notice(run: dict[str, Any], promoted: dict[str, Any]) -> dict[str, Any] | None:
    """The alert for a promoted drafter version: its speedups and the command that pulls exactly this
    version (None when the promote stage promoted nothing). `promoted`: the promote stage's output."""
    from pipeline.ops.alerts import promotion_alert

    if not promoted.get("promoted"):
        return None
    config = _as_config(run["config"], None)
    target, version = config.target.name, promoted["version"]
    pull = (
        f"drafter pull --config {run['source']['config']} --target {target} --alias {version} "
        f"--dest ./drafters/{target}/{version}"
    )
    if promoted.get("bench_engine") in ("sglang", "vllm"):
        pull += f" --engine {promoted['bench_engine']}"
    alert = promotion_alert(
        run["run_id"], target, {**promoted, "pull_command": pull}, _report_address(config, run)
    )
    return dataclasses.asdict(alert)


def _report_address(config: RunConfig, run: dict[str, Any]) -> str:
    """Where the run's report opens (the report task writes it at the end of the run)."""
    from pipeline import layout
    from pipeline.ops.report import report_link

    key = f"{layout.run_stage_prefix(run['run_id'], 'report')}/report.html"
    return report_link(open_store(config.storage), key)


def run_shard(
    stage: str,
    config: RunConfig | str | dict[str, Any],
    snapshot: str,
    shard: str,
    overrides: list[str] | None = None,
    rates: dict[str, Any] | None = None,
    **inputs: str | None,
) -> dict[str, Any]:
    """One shard of generate or capture (a mapped task); the plain stage publishes when all are done.
    With `rates`, what the task held is recorded under the data run (`snapshot`)."""
    from pipeline import stages
    from pipeline.ops.usage import metered, rates_of
    from pipeline.stages import capture, generate

    if stage not in SHARD_STAGES:
        raise ValueError(f"stage {stage!r} is not run per shard; shard stages: {', '.join(SHARD_STAGES)}")
    config = _as_config(config, overrides)
    store = open_store(config.storage)
    defaults = stages.default_inputs(config, store, snapshot, snapshot)
    with metered(store, snapshot, f"{stage}-shard-{shard}", stage, rates_of(rates)):
        if stage == "generate":
            prompts_uri = inputs.get("prompts_uri") or defaults["prompts_uri"]
            return generate.run_shard(config, prompts_uri, snapshot, shard, store)
        responses_uri = inputs.get("responses_uri") or defaults["responses_uri"]
        return capture.run_shard(config, responses_uri, snapshot, shard, store)


PARAM_OVERRIDES = {
    "num_samples": "prompts.num_samples",
    "shard_size": "prompts.shard_size",
    "sources": "prompts.sources",
    "epochs": "train.epochs",
    "init": "train.init",
    "init_from": "train.init_from",
    "min_cond_acc_0": "gate.min_cond_acc",
    "min_tau_simulated": "gate.min_tau_simulated",
}


def refuse_code_overrides(overrides: list[str], source: str) -> None:
    """A trigger form (or what a scheduler was handed) may not set settings that name executables, commands
    or code, nor the store and the servers the run's data goes to (pipeline.config.CODE_SETTINGS): they run,
    and are reached, from the task pods with the pipeline's own identity and credentials."""
    refused = sorted({setting for override in overrides for setting in overridden_code_settings(override)})
    if refused:
        keys = [override.split("=", 1)[0] for override in overrides if overridden_code_settings(override)]
        raise ConfigError(
            f"{source} may not set settings that name executables, commands or code to run, or the store "
            "and servers the run's data goes to: "
            f"{', '.join(refused)} (set by the overrides of {', '.join(keys)}); set them in the run config "
            "file, or with `drafter ... key=value` where the operator runs it"
        )


def param_overrides(params: dict[str, Any]) -> list[str]:
    """Dotted overrides from a scheduler's trigger form: the named fields that were filled in, then
    the free-form `overrides` list (which wins; none may name code: `refuse_code_overrides`)."""
    free = list(params.get("overrides") or [])
    refuse_code_overrides(free, "the trigger form's config overrides")
    overrides = []
    for name, path in PARAM_OVERRIDES.items():
        value = params.get(name)
        if value in (None, "", []):
            continue
        if name == "min_cond_acc_0":
            value = [value]
        overrides.append(f"{path}={json.dumps(value)}")
    return overrides + free


RUN_CONFIG_SUFFIXES = (".yaml", ".yml")


def deployed_run_config(path: str, default_config: str, source: str) -> str:
    """`path` when it is one of the deployment's run configs: the default itself, or a .yaml/.yml file in
    the default's directory or the project's configs/, once symlinks and `..` are resolved. A trigger form
    or a dataset event could otherwise name any YAML the pods can read (a cached prompt file, say) and set
    through it the code settings that their overrides may not (`refuse_code_overrides`)."""
    from pipeline.config_base import PROJECT_ROOT, resolve_project_path

    resolved = resolve_project_path(path).resolve()
    default = resolve_project_path(default_config)
    directories = [default.parent.resolve(), (PROJECT_ROOT / "configs").resolve()]
    if resolved == default.resolve():
        return path
    if resolved.suffix in RUN_CONFIG_SUFFIXES and any(resolved.is_relative_to(d) for d in directories):
        return path
    raise ConfigError(
        f"{source} names run config {path} (resolved: {resolved}), which is not one of the deployment's run "
        f"configs: a .yaml or .yml file in {' or '.join(str(d) for d in directories)}"
    )


def plan_run(params: dict[str, Any], scheduler_run_id: str, default_config: str) -> dict[str, Any]:
    """What a run asks for, from its trigger form (a scheduled run's form holds the defaults): the run
    config to load, its overrides and a safe run id. Reads no file: `configure_run` loads the config
    where the run's volumes are mounted."""
    from pipeline.ids import safe_id

    if params.get("num_shards") and params.get("shard_size"):
        raise ConfigError("give either a shard size or a number of shards, not both")
    return {
        "config_path": deployed_run_config(params["config"], default_config, "the trigger form")
        if params.get("config")
        else default_config,
        "overrides": param_overrides(params),
        "num_shards": params.get("num_shards"),
        "run_id": safe_id(scheduler_run_id),
    }


def configure_run(
    plan: dict[str, Any],
    mount_paths: list[str] | None = None,
    usage_table: dict[str, Any] | None = None,
    dag_id: str = "drafter_data",
) -> dict[str, Any]:
    """Load and check the run config once; every later task gets it resolved (`config`, a dict) and
    needs no config file. With `mount_paths` (tasks in pods), a local path the config names outside
    every mounted volume is refused here, before a stage fails on it mid-run. `engines` holds the engine
    of each stage whose pod is placed by it (a vLLM benchmark in the vLLM image, in-process capture on a
    GPU node: the deployment's `engines`), read when that pod is created. With `usage_table`
    (DeploymentConfig.usage_table), `rates` holds what each stage's task holds and the GPU price: the
    tasks record their usage with it (pipeline.ops.usage), and a run whose capacity plan cannot finish
    within the limits on `dag_id`'s stages is refused (pipeline.ops.plan_fit)."""
    from pipeline.ops.deployment import run_engines, usage_rates
    from pipeline.ops.plan_fit import refuse_unfit

    overrides = list(plan["overrides"])
    config = load_config(plan["config_path"], overrides)
    if plan.get("num_shards"):  # a shard count is a shard size for this many conversations
        overrides.append(f"prompts.shard_size={max(1, -(-config.prompts.num_samples // plan['num_shards']))}")
        config = load_config(plan["config_path"], overrides)
    if mount_paths is not None:
        _require_mounted(config, plan["config_path"], mount_paths)
    if usage_table and "limits" in usage_table:
        refuse_unfit(config, usage_table["limits"], dag_id, plan["config_path"])
    return {
        "run_id": plan["run_id"],
        "trigger": plan.get("trigger"),
        "config": config.dump(),
        "source": {"config": plan["config_path"], "overrides": overrides},
        "engines": run_engines(config),
        "rates": usage_rates(usage_table, config).model_dump() if usage_table else None,
    }


def local_paths_read(config: RunConfig) -> list[str]:
    """The local files and directories a run config makes its stages read or write."""
    paths = [config.storage.local_cache, config.train.deepspeed_config]
    if config.target.source == "hf" and config.target.model_path:
        paths.append(config.target.model_path)
    paths += [
        source.path
        for source in config.prompts.sources
        if source.path and not source.path.startswith("s3://")
    ]
    if config.benchmark.sglang is not None:
        paths.append(config.benchmark.sglang.model_path)
    if config.train.init_from and not config.train.init_from.startswith("registry:"):
        paths.append(config.train.init_from)
    return [path[len("file://") :] if path.startswith("file://") else path for path in paths]


def _within(path: str, root: str) -> bool:
    """Whether absolute `path` lies in `root`, both with their `..` and `.` parts worked out first (as the
    pod's kernel will), so /data/prompts/../../root/.aws is not within /data/prompts."""
    return PurePosixPath(posixpath.normpath(path)).is_relative_to(posixpath.normpath(root))


def _require_mounted(config: RunConfig, config_path: str, mount_paths: list[str]) -> None:
    outside = [
        path
        for path in local_paths_read(config)
        if path.startswith("/") and not any(_within(path, root) for root in mount_paths)
    ]
    if outside:
        raise ConfigError(
            f"run config {config_path} names local paths that no task pod mounts: {outside}; the pods "
            f"mount {sorted(mount_paths)} (kubernetes.volumes in the deployment config)"
        )


def describe_trigger(run_type: str, asset_extras: list[dict[str, Any]], cron: str | None) -> dict[str, Any]:
    """What started a run, in words: the cron, a person (trigger form or REST API), a published dataset,
    or a watcher of the serving fleet (pipeline.ops.watch; its event's payload says why)."""
    if run_type == "scheduled":
        return {"kind": "cron", "reason": f"the retraining cron ({cron or 'its timetable'})"}
    if run_type == "manual" or (run_type == "asset_triggered" and not asset_extras):
        return {"kind": "manual", "reason": "triggered by hand (trigger form or REST API)"}
    if run_type != "asset_triggered":  # a backfill, or a run another DAG's operator started
        return {"kind": str(run_type), "reason": f"an Airflow {run_type} run"}
    kinds, reasons = [], []
    for extra in asset_extras:
        payload = extra.get("payload") if extra.get("from_trigger") else None
        if isinstance(payload, dict):
            kinds.append(str(payload.get("trigger", "watcher")))
            reasons.append(str(payload.get("reason", payload)))
        elif extra.get("dataset_uri"):
            made = extra.get("trigger") or {}
            kinds.append("dataset")
            reasons.append(
                f"dataset {extra['dataset_uri']} published"
                + (f" (its data run: {made['reason']})" if made.get("kind") not in (None, "manual") else "")
            )
    if not kinds:
        return {"kind": "asset", "reason": f"asset events {asset_extras}"}
    return {"kind": kinds[-1], "reason": "; ".join(reasons)}


def plan_data(
    params: dict[str, Any],
    scheduler_run_id: str,
    run_type: str,
    asset_extras: list[dict[str, Any]],
    default_config: str,
) -> dict[str, Any]:
    """A data run's request, and what started it. Started because the fleet serves another target
    revision (pipeline.ops.watch.revision_change), it captures that revision: the new drafter is trained
    on what the fleet now serves."""
    plan = plan_run(params, scheduler_run_id, default_config)
    plan["trigger"] = describe_trigger(run_type, asset_extras, None)
    revisions = [
        extra["payload"]["served_revision"]
        for extra in asset_extras
        if extra.get("from_trigger") and (extra.get("payload") or {}).get("trigger") == "target_revision"
    ]
    if revisions:
        plan["overrides"].append(f"target.revision={json.dumps(revisions[-1])}")
    return plan


def plan_training(
    params: dict[str, Any],
    scheduler_run_id: str,
    asset_extras: list[dict[str, Any]],
    default_config: str,
    run_type: str = "manual",
    cron: str | None = None,
) -> dict[str, Any]:
    """A training run's request, and what started it. Triggered by a published dataset, it trains on that
    dataset with the config that made it; by hand, by the cron or by a watcher of the serving fleet, on the
    given or else the newest dataset."""
    plan = plan_run(params, scheduler_run_id, default_config)
    plan["dataset_uri"] = params.get("dataset_uri") or None
    plan["trigger"] = describe_trigger(run_type, asset_extras, cron)
    datasets = [extra for extra in asset_extras if extra.get("dataset_uri")]
    if datasets and not plan["dataset_uri"]:
        made_by = datasets[-1]
        made_with = list(made_by.get("overrides") or [])
        # an asset event's extra can be posted through Airflow's REST API too, not only by drafter_data
        refuse_code_overrides(made_with, f"the overrides of the dataset event for {made_by['dataset_uri']}")
        if made_by.get("config"):
            source = f"the dataset event for {made_by['dataset_uri']}"
            plan["config_path"] = deployed_run_config(made_by["config"], default_config, source)
        plan["overrides"] = made_with + plan["overrides"]
        plan["dataset_uri"] = made_by["dataset_uri"]
    return plan


def record_trigger(run: dict[str, Any]) -> str | None:
    """Store what started the run (runs/<run_id>/trigger.json: the report and `drafter status` show it),
    and return why a cron run trains nothing, if it does not: its dataset and target are those the
    production drafter was trained on. Any other trigger trains."""
    config = _as_config(run["config"], None)
    store = open_store(config.storage)
    trigger = dict(run.get("trigger") or {"kind": "manual", "reason": "triggered by hand"})
    skipped = nothing_new(config, store, run["dataset_uri"]) if trigger["kind"] == "cron" else None
    store_trigger(store, run["run_id"], trigger, run.get("dataset_uri"), skipped)
    return skipped


def store_trigger(
    store, run_id: str, trigger: dict[str, Any], dataset_uri: str | None, skipped: str | None = None
) -> None:
    """runs/<run_id>/trigger.json: what started the run, its dataset, and why it trained nothing if so."""
    from pipeline import layout
    from pipeline.manifest import now_iso

    record = {"trigger": trigger, "dataset": dataset_uri, "skipped": skipped, "recorded_at": now_iso()}
    store.put_bytes(layout.run_file_key(run_id, "trigger.json"), json.dumps(record, indent=2).encode())


def nothing_new(config: RunConfig, store, dataset_uri: str) -> str | None:
    """Why training on `dataset_uri` would add nothing to the production drafter: it was trained on this
    same dataset, captured from this same target. None when something is new (or nothing is in production)."""
    from pipeline.ops.watch import production_target
    from pipeline.records import read_dataset
    from pipeline.training.init_choice import target_differences

    production = production_target(store, config.target.name, config.registry.alias)
    if production is None or production["dataset"] != dataset_uri:
        return None
    dataset = read_dataset(store, dataset_uri).contract.model_dump(mode="json")
    if target_differences({"target": production["target"]}, dataset):
        return None
    return (
        f"nothing new since production drafter {production['version']}: it was trained on this same dataset "
        f"({dataset_uri}) of this same target; the cron run trains nothing (trigger drafter_train by hand to "
        "retrain anyway)"
    )


def configure_training(
    plan: dict[str, Any], mount_paths: list[str] | None = None, usage_table: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`configure_run`, plus the dataset to train on and the prompts its benchmark uses."""
    run = configure_run(plan, mount_paths, usage_table, "drafter_train")
    run["dataset_uri"] = resolve_dataset(run["config"], None, plan.get("dataset_uri"))
    run["prompts_uri"] = prompts_uri_of(run["config"], None, run["dataset_uri"])
    return run


def _as_config(config: RunConfig | str | dict[str, Any], overrides: list[str] | None) -> RunConfig:
    """A run config given as a loaded config, a file, or a resolved dict (what `configure_run` returns)."""
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, dict):
        return load_config(data=config, overrides=overrides)
    return load_config(config, overrides)


def resolve_dataset(
    config: RunConfig | str | dict[str, Any], overrides: list[str] | None, dataset_uri: str | None
) -> str:
    """The dataset to train on: the given one, else the newest published dataset of the target."""
    from pipeline.stages.dataset import latest_dataset

    config = _as_config(config, overrides)
    if dataset_uri:
        return dataset_uri
    return latest_dataset(config, open_store(config.storage))


def prompts_uri_of(
    config: RunConfig | str | dict[str, Any], overrides: list[str] | None, dataset_uri: str
) -> str:
    """The prompt snapshot a dataset was made from (its held-out prompts feed the benchmark)."""
    from pipeline.manifest import read_manifest
    from pipeline.records import read_dataset

    config = _as_config(config, overrides)
    store = open_store(config.storage)
    dataset = read_dataset(store, dataset_uri)
    capture = read_manifest(store, store.key_for(dataset.captures[0]), kind="capture")
    responses = read_manifest(store, store.key_for(capture["responses"]), kind="responses")
    return responses["prompts"]


def scale_fleet_up(
    config: RunConfig | str | dict[str, Any], stage: str, fleet: dict[str, Any] | None
) -> dict[str, Any]:
    """Before an SGLang stage: its server fleet up and ready (pipeline.ops.fleets). Without a fleet in the
    deployment config the servers are managed elsewhere and nothing is scaled."""
    from pipeline.ops.fleets import ServerFleet, scale_up

    if fleet is None:
        return {"stage": stage, "replicas": 0, "scaled": False}
    return scale_up(_as_config(config, None), stage, ServerFleet.model_validate(fleet))


def scale_fleet_down(
    stage: str,
    fleet: dict[str, Any] | None,
    run: dict[str, Any] | None = None,
    scaled: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """After an SGLang stage, however it ended: its server fleet back to 0 replicas. With the run (its
    configure step's result) and what the scale-up returned, the servers' GPU time is recorded."""
    from pipeline.ops.fleets import ServerFleet, scale_down
    from pipeline.ops.usage import rates_of, record_fleet

    if fleet is None:
        return {"stage": stage, "replicas": 0, "scaled": False}
    down = {"stage": stage, **scale_down(ServerFleet.model_validate(fleet))}
    if run is not None and run.get("rates") and scaled:
        config = _as_config(run["config"], None)
        record_fleet(open_store(config.storage), run["run_id"], stage, scaled, rates_of(run["rates"]))
    return down
