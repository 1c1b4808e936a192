"""`drafter run`: every stage in order for one config, then summary.json beside the run's artifacts."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.config_records import artifact_record, require_same, run_record
from pipeline.failures import exit_code_for
from pipeline.ids import MAX_ID_LENGTH
from pipeline.manifest import read_manifest
from pipeline.ops import registry
from pipeline.ops.deployment import usage_rates
from pipeline.ops.usage import Rates, cost_rows, read_usage, run_cost
from pipeline.promotion import (
    OUTCOMES,
    BenchmarkInconclusive,
    GateFailed,
    PromotionRefused,
    stop_outcome,
)
from pipeline.records import BenchRecord, EvalRecord, RunSummary, read_dataset, read_record
from pipeline.stages import TABLE, StageOutput, run_stage
from pipeline.stages.promote import Output as PromoteOutput
from pipeline.stages.report import Output as ReportOutput
from pipeline.storage import ObjectStore, open_store

log = logging.getLogger(__name__)
Stop = GateFailed | PromotionRefused | BenchmarkInconclusive


@dataclass(frozen=True)
class RunResult:
    """What `drafter run` ended with: its summary, where the summary is, and the failed gate, refused
    promotion or inconclusive benchmark that stopped it early, if one did."""

    summary: RunSummary
    location: str
    stop: Stop | None = None

    def exit_code(self) -> int:
        """`drafter run`'s exit code: the stop's row of the one table (pipeline.failures), else 0."""
        return 0 if self.stop is None else exit_code_for(self.stop)


def new_run_id(stem: str | None = None) -> str:
    """A fresh run id: `stem` (default "run") and the time, e.g. run-20261205-151500. A stem cut short so
    that the id stays within MAX_ID_LENGTH (a run id at the maximum gets a valid new one)."""
    suffix = f"-{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}"
    return f"{(stem or 'run')[: MAX_ID_LENGTH - len(suffix)]}{suffix}"


def require_unchanged(config: RunConfig, run_id: str, store: ObjectStore) -> None:
    """A rerun of `drafter run` continues its run id only under the config it was made with (each stage
    checks what it makes or reuses: pipeline.config_records); checked here before anything of the run is
    written (its trigger record, its usage)."""
    target = config.target.name
    made = {
        "prompts snapshot": layout.prompts_prefix(run_id),
        "responses": layout.responses_prefix(target, run_id),
        "captures": layout.captures_prefix(target, run_id),
    }
    for kind, prefix in made.items():
        require_same(store, artifact_record(store, prefix, kind), config)
    require_same(store, run_record(run_id), config)


def write_summary(store: ObjectStore, run_id: str, summary: RunSummary) -> str:
    key = layout.run_file_key(run_id, "summary.json")
    store.put_bytes(key, summary.to_json())
    return store.uri(key)


def summary_location(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def run_stages(
    config: RunConfig, run_id: str, store: ObjectStore
) -> tuple[dict[str, StageOutput], Stop | None]:
    """Every stage of the table that `drafter run` runs, in order, up to the report: their outputs,
    and the failed gate, refused promotion or inconclusive benchmark that stopped the run early, if one
    did. What each stage held is recorded (pipeline.ops.usage), as the deployment config places it."""
    outputs: dict[str, StageOutput] = {}
    rates = local_rates(config)
    for entry in TABLE:
        if not entry.in_run or entry.name == "report":
            continue
        try:
            outputs[entry.name] = run_stage(entry.name, config, run_id, store, rates=rates)
        except (GateFailed, PromotionRefused, BenchmarkInconclusive) as stopped:
            return outputs, stopped
    return outputs, None


def local_rates(config: RunConfig) -> Rates:
    """What `drafter run`'s stages hold: the deployment config's placement (DRAFTER_DEPLOYMENT, by default
    configs/deployment/local.yaml, whose stages hold no GPUs) for this run's engines."""
    from pipeline.ops.deployment import load_deployment

    return usage_rates(load_deployment().usage_table(), config)


def _data_summary(store: ObjectStore, run_id: str, config: RunConfig) -> dict[str, Any]:
    dataset = read_dataset(store, layout.dataset_prefix(config.target.name, run_id))
    train = read_manifest(store, layout.run_stage_prefix(run_id, "train"), kind="train")
    evaluation = read_record(store, layout.run_stage_prefix(run_id, "eval"), EvalRecord)
    totals = dataset.totals
    return {
        "run_id": run_id,
        "target": config.target.name,
        "samples": totals["train"].samples + totals["eval"].samples,
        "tokens": totals["train"].tokens + totals["eval"].tokens,
        "cond_acc": evaluation.cond_acc,
        "stop_reason": train["result"]["stop_reason"],
        "init": [attempt["init"] for attempt in train.get("attempts") or []],
        **epoch_selection(train["result"]),
    }


def epoch_selection(train_result: dict[str, Any]) -> dict[str, Any]:
    """The exported epoch and every epoch's held-out tau, from the train stage's result."""
    return {
        "chosen_epoch": train_result.get("chosen_epoch"),
        "heldout_tau_by_epoch": train_result.get("heldout_tau_by_epoch"),
    }


def _bench_summary(store: ObjectStore, bench_uri: str) -> dict[str, Any]:
    bench = read_record(store, bench_uri, BenchRecord)
    headline = bench.summary()
    reference = bench.beside.get("reference")
    return {
        "tau_simulated": headline.tau_simulated,
        "tau_measured": headline.tau_measured,
        "baseline_tok_s": headline.baseline_tok_s,
        "drafter_tok_s": headline.drafter_tok_s,
        "speedup_vs_baseline": headline.speedup_vs_baseline,
        "speedup_vs_ngram": headline.speedup_vs_ngram,
        "speedups": headline.speedups,
        "ngram_tok_s": bench.methods.ngram.tok_s,
        "ngram_best_setting": bench.ngram_sweep.best if bench.ngram_sweep else None,
        "bench_engine": headline.engine,
        "bench_engine_version": headline.engine_version,
        "acceptance": headline.acceptance,
        "reference_speedups": reference.speedups if reference is not None else None,
    }


def _promotion_summary(config: RunConfig, run_id: str, store: ObjectStore, promoted: StageOutput) -> dict:
    """The promoted version, pulled back from the registry as a serving engine would pull it."""
    assert isinstance(promoted, PromoteOutput)
    if not promoted.promoted:
        return {"outcome": OUTCOMES["not_promoting"]}
    from pipeline.engines.target import describe_target  # torch: only once a run has promoted

    workdir = config.storage.run_workdir(run_id)
    pulled = registry.pull(
        store,
        config.target.name,
        config.registry.alias,
        workdir / "pulled_drafter",
        describe_target(config).model_dir,
    )
    return {
        "outcome": OUTCOMES["promoted"],
        "promoted_version": promoted.version,
        "registry_uri": promoted.registry_uri,
        "pulled_to": str(pulled),
    }


def stop_summary(stop: Stop) -> dict[str, Any]:
    """The summary's outcome of a run its gate or promote stage stopped: in pipeline.promotion's words,
    with every reason, and for an inconclusive benchmark what to do."""
    fields: dict[str, Any] = {"outcome": stop_outcome(stop), "failure": str(stop)}
    if isinstance(stop, GateFailed):
        fields["gate_passed"] = False
    if isinstance(stop, BenchmarkInconclusive):
        fields["next_step"] = stop.next_step
    return fields


def run_all(config: RunConfig, run_id: str, store: ObjectStore | None = None) -> RunResult:
    """Run prompts -> ... -> promote -> pull, then the report; returns the summary, where it is, and what
    stopped the run early.

    A failed gate, a refused promotion or an inconclusive benchmark ends the run early but still writes
    the summary; its "outcome" says which, "failure" carries every reason, and for an inconclusive
    benchmark "next_step" says how a rerun can decide.
    """
    from pipeline.tasks import store_trigger

    store = store or open_store(config.storage)
    require_unchanged(config, run_id, store)
    store_trigger(store, run_id, {"kind": "command line", "reason": "drafter run"}, None)
    outputs, stop = run_stages(config, run_id, store)
    summary = _data_summary(store, run_id, config)
    summary["gate_passed"] = not isinstance(stop, GateFailed)
    if "benchmark" in outputs:
        summary.update(_bench_summary(store, outputs["benchmark"].uri))
    if stop is not None:
        summary.update(stop_summary(stop))
    else:
        summary.update(_promotion_summary(config, run_id, store, outputs["promote"]))
    summary["cost"] = run_cost(
        read_usage(store, run_id), summary.get("baseline_tok_s"), summary.get("drafter_tok_s")
    ).model_dump()
    report = run_stage("report", config, run_id, store)
    assert isinstance(report, ReportOutput)
    record = RunSummary.model_validate({**summary, "report": report.link})
    return RunResult(record, summary_location(write_summary(store, run_id, record)), stop)


def bench_engine_rows(summary: RunSummary) -> list[tuple[str, Any]]:
    """Which engine's speed decided, its acceptance against the reference decoder's, and the reference
    decoder's own speedups measured beside it (not decisive)."""
    if summary.bench_engine is None:
        return []
    engine = " ".join(filter(None, (summary.bench_engine, summary.bench_engine_version)))
    rows: list[tuple[str, Any]] = [("speed decided by", engine)]
    check = summary.acceptance
    if check is not None:
        rows += [
            (f"tau in {check.engine} (reference decoder)", [check.tau, check.reference_tau]),
            (f"  relative difference (tolerance {check.tolerance})", check.rel_diff),
            (f"{check.engine}: acceptance per position", check.acceptance_per_position),
            ("  reference decoder's", check.reference_acceptance_per_position),
        ]
    for other, speedup in (summary.reference_speedups or {}).items():
        rows.append(
            (f"reference decoder beside: vs {other}", [speedup.ratio, speedup.ci_low, speedup.ci_high])
        )
    return rows


def format_table(summary: RunSummary) -> str:
    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        if isinstance(value, list):
            return "[" + ", ".join(fmt(v) for v in value) + "]"
        return "-" if value is None else str(value)

    rows: list[tuple[str, Any]] = [("samples", summary.samples), ("tokens", summary.tokens)]
    rows += [(f"cond_acc_{k}", v) for k, v in enumerate(summary.cond_acc)]
    rows += [
        ("chosen epoch (from 0)", summary.chosen_epoch),
        ("held-out tau by epoch", summary.heldout_tau_by_epoch),
        ("outcome", summary.outcome),
        *([("what to do", summary.next_step)] if summary.next_step else []),
        ("tau simulated", summary.tau_simulated),
        ("tau measured", summary.tau_measured),
        ("baseline tok/s", summary.baseline_tok_s),
        ("n-gram tok/s", summary.ngram_tok_s),
        ("n-gram best setting", summary.ngram_best_setting),
        ("drafter tok/s", summary.drafter_tok_s),
        *bench_engine_rows(summary),
        ("speedup vs baseline", summary.speedup_vs_baseline),
        *[
            (f"  {speedup.confidence:.0%} interval vs {other}", [speedup.ci_low, speedup.ci_high])
            for other, speedup in (summary.speedups or {}).items()
        ],
        ("promoted version", summary.promoted_version),
        ("registry", summary.registry_uri),
        ("pulled to", summary.pulled_to),
        *(cost_rows(summary.cost) if summary.cost else []),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {fmt(value)}" for name, value in rows)
