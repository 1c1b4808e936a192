"""Run reports: PNG plots and one self-contained report.html in runs/<run_id>/report/, built from what
the run's stages published (train, eval, gate, bench, promote manifests), plus the `drafter status`
table of aliases and recent runs. A run that stopped early (a rejected gate, a refused promotion, an
inconclusive benchmark) still gets a report; the sections it never reached say so, and an inconclusive
benchmark's says what to do.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import json
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import yaml

from pipeline import layout
from pipeline.drafter.servable import sglang_flags
from pipeline.manifest import manifest_exists, publish, read_manifest
from pipeline.ops import registry
from pipeline.ops.usage import USAGE_DIR, cost_rows, read_usage, run_cost
from pipeline.promotion import BENCH_OUTCOMES, deciding_engine, signed, standing_vs_incumbent
from pipeline.promotion import outcome as promotion_outcome
from pipeline.records import (
    AcceptanceMetrics,
    AliasRecord,
    BenchMethods,
    BenchRecord,
    BenchSummary,
    EngineBench,
    EvalRecord,
    GateRecord,
    IncumbentEval,
    IncumbentSkipped,
    MeasuredAcceptance,
    MethodResult,
    PromoteRecord,
    RatioInterval,
    RunCost,
    StageRecord,
    read_record,
)
from pipeline.spread import ratio_from_samples
from pipeline.storage import ObjectStore

log = logging.getLogger(__name__)
PLOTS = {
    "training": "Training: loss and conditional acceptance per epoch",
    "attempts": "Training attempts: a stalled warm start, then scratch (train.init auto)",
    "acceptance": "Accepted draft tokens per verify step (benchmark)",
    "throughput": "Decoding throughput",
    "predicted_vs_measured": "Acceptance: predicted by evaluation vs measured by the benchmark",
}
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


@dataclass
class RunRecord:
    """Everything a run published, each part None when its stage did not publish."""

    run_id: str
    config: dict[str, Any] | None = None
    train: dict[str, Any] | None = None
    eval: EvalRecord | None = None
    gate: GateRecord | None = None
    bench: BenchRecord | None = None
    promote: PromoteRecord | None = None
    created_at: str | None = None
    stages: list[str] = field(default_factory=list)
    cost: RunCost | None = None  # what its tasks held (pipeline.ops.usage), when they recorded it
    # what started it and whether it trained (runs/<id>/trigger.json: pipeline.tasks.record_trigger)
    trigger: dict[str, Any] | None = None

    @property
    def outcome(self) -> str:
        """How the run ended: the promotion rule's words (pipeline.promotion.outcome), the version when one
        was promoted; else how far it got."""
        if self.trigger is not None and self.trigger.get("skipped"):
            return "skipped: nothing new"
        decided = promotion_outcome(self.gate, self.bench, self.promote)
        if decided is not None:
            promoted = self.promote is not None and self.promote.promoted
            return f"{decided} {self.promote.version}" if promoted and self.promote else decided
        if not self.stages and self.cost is not None:  # a data run: its stages recorded their usage
            return f"no training ({', '.join(row.stage for row in self.cost.stages)})"
        return "incomplete" if self.stages else "no artifacts"


S = TypeVar("S", bound=StageRecord)


def _stage_record(
    store: ObjectStore, run: RunRecord, stage: layout.RunStage, record_type: type[S]
) -> S | None:
    """The stage's record when the stage published one (noting the stage and its time on `run`)."""
    stage_prefix = layout.run_stage_prefix(run.run_id, stage)
    if not manifest_exists(store, stage_prefix):
        return None
    manifest = read_manifest(store, stage_prefix, kind=record_type.KIND)
    run.stages.append(record_type.KIND)
    run.created_at = max(run.created_at or "", manifest["created_at"])
    return read_record(store, stage_prefix, record_type)


def load_run(store: ObjectStore, run_id: str) -> RunRecord:
    record = RunRecord(run_id)
    train_prefix = layout.run_stage_prefix(run_id, "train")
    train_manifest = read_manifest(store, train_prefix) if manifest_exists(store, train_prefix) else None
    if train_manifest is not None:
        record.train, record.created_at = train_manifest, train_manifest["created_at"]
    config_key = layout.run_file_key(run_id, "config.json")
    if store.exists(config_key):
        record.config = json.loads(store.get_bytes(config_key))
    elif train_manifest is not None:
        record.config = {"train": train_manifest.get("config")}
    trigger_key = layout.run_file_key(run_id, "trigger.json")
    if store.exists(trigger_key):
        record.trigger = json.loads(store.get_bytes(trigger_key))
        record.created_at = record.created_at or record.trigger.get("recorded_at")
    record.eval = _stage_record(store, record, "eval", EvalRecord)
    record.gate = _stage_record(store, record, "gate", GateRecord)
    record.bench = _stage_record(store, record, "bench", BenchRecord)
    record.promote = _stage_record(store, record, "promote", PromoteRecord)
    if train_manifest is not None:
        record.stages.insert(0, "train")
    usage = read_usage(store, run_id)
    if usage:
        bench = record.bench
        throughputs = (bench.baseline_tok_s, bench.drafter_tok_s) if bench else (None, None)
        record.cost = run_cost(usage, *throughputs)
        last = max(dt.datetime.fromisoformat(u.started_at) for u in usage)  # a data run has no manifest time
        record.created_at = record.created_at or last.strftime("%Y-%m-%dT%H:%M:%SZ")
    return record


def list_runs(store: ObjectStore, limit: int = 10) -> list[RunRecord]:
    """The newest runs that trained something, recorded their tasks' usage (data runs) or what started them
    (a cron run with nothing new among them), newest first."""
    keys = store.list(layout.RUNS)
    run_ids = layout.published_run_ids(keys, "train") | {
        key.split("/")[1] for key in keys if key.split("/")[2:3] in ([USAGE_DIR], ["trigger.json"])
    }
    records = [load_run(store, run_id) for run_id in run_ids]
    return sorted(records, key=lambda r: r.created_at or "", reverse=True)[:limit]


# ---------------------------------------------------------------- plots


def _figure(width: float = 7.5, height: float = 4.0, columns: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(width, height), dpi=110, squeeze=False)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plot_training(record: RunRecord, path: Path) -> bool:
    history = (record.train or {}).get("history") or []
    if not history:
        return False
    fig, axes = _figure(11, 4.2, 2)
    loss_ax, acc_ax = axes[0]
    epochs = [entry["epoch"] + 1 for entry in history]
    steps = len(history[0]["loss"])
    thresholds = (
        record.gate.thresholds.min_cond_acc
        if record.gate is not None
        else ((record.config or {}).get("gate") or {}).get("min_cond_acc", [])
    )
    for k in range(steps):
        color = COLORS[k % len(COLORS)]
        loss_ax.plot(
            epochs, [entry["loss"][k] for entry in history], marker="o", color=color, label=f"loss_{k}"
        )
        acc_ax.plot(
            epochs,
            [entry["cond_acc"][k] for entry in history],
            marker="o",
            color=color,
            label=f"cond_acc_{k}",
        )
        if k < len(thresholds):
            acc_ax.axhline(
                thresholds[k],
                color=color,
                linestyle="--",
                linewidth=1.2,
                label=f"gate: cond_acc_{k} >= {thresholds[k]:g}",
            )
    from matplotlib.ticker import MaxNLocator

    loss_ax.set(xlabel="epoch", ylabel="loss (KL to the teacher)", title="loss_k")
    acc_ax.set(xlabel="epoch", ylabel="conditional acceptance", title="cond_acc_k", ylim=(0, 1.02))
    for ax in (loss_ax, acc_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    _save(fig, path)
    return True


def plot_attempts(record: RunRecord, path: Path) -> bool:
    """Training cond_acc_0 by step of each attempt, when train.init auto restarted a stalled warm start."""
    attempts = (record.train or {}).get("attempts") or []
    if len(attempts) < 2:
        return False
    fig, axes = _figure(11, 4.2, 1)
    ax = axes[0][0]
    for number, attempt in enumerate(attempts, 1):
        curve = attempt.get("cond_acc0_by_step") or []
        init = attempt["init"]
        ax.plot(
            [step for step, _ in curve],
            [value for _, value in curve],
            color=COLORS[(number - 1) % len(COLORS)],
            label=f"attempt {number}: {init['chosen']} ({attempt['stop_reason']})",
        )
    thresholds = ((record.config or {}).get("gate") or {}).get("min_cond_acc") or []
    if thresholds:
        ax.axhline(
            thresholds[0], color="gray", linestyle="--", label=f"gate: cond_acc_0 >= {thresholds[0]:g}"
        )
    restart_bar = attempts[0]["init"].get("restart_under")
    if restart_bar and restart_bar["cond_acc0"] not in thresholds[:1]:
        ax.axhline(
            restart_bar["cond_acc0"],
            color="gray",
            linestyle=":",
            label=f"warm start restarted under {restart_bar['cond_acc0']:.3f}",
        )
    ax.set(
        xlabel="step of the attempt",
        ylabel="cond_acc_0 (training)",
        title="training attempts",
        ylim=(0, 1.02),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
    return True


def _bench_methods(record: RunRecord) -> dict[str, MethodResult]:
    return record.bench.methods.present() if record.bench is not None else {}


def plot_acceptance(record: RunRecord, path: Path) -> bool:
    methods = {
        name: m.accepted_histogram for name, m in _bench_methods(record).items() if m.accepted_histogram
    }
    if not methods:
        return False
    fig, axes = _figure()
    ax = axes[0][0]
    width = 0.8 / len(methods)
    for i, (name, histogram) in enumerate(methods.items()):
        total = sum(histogram) or 1
        positions = [x + (i - (len(methods) - 1) / 2) * width for x in range(len(histogram))]
        ax.bar(
            positions,
            [c / total for c in histogram],
            width=width,
            color=COLORS[i % len(COLORS)],
            label=f"{name} (mean accepted {sum(k * c for k, c in enumerate(histogram)) / total:.2f})",
        )
    ax.set(xlabel="draft tokens accepted in one verify step", ylabel="share of verify steps")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def plot_throughput(record: RunRecord, path: Path) -> bool:
    """Each method's tokens/s with its interval (from its rounds), the candidate's speedup interval over
    each other method, per engine: the one that decided first, and what was measured beside it."""
    bench = record.bench
    if bench is None:
        return False
    panels: list[tuple[str, EngineBench]] = [(f"decided by {deciding_engine(bench)}", bench)]
    for name, figures in bench.beside.items():
        panels.append((f"{ENGINE_LABELS.get(name, name)} beside it (not decisive)", figures))
    fig, axes = _figure(width=7.5 * len(panels), columns=len(panels))
    for ax, (title, figures) in zip(axes[0], panels, strict=True):
        throughput_panel(ax, title, figures)
    _save(fig, path)
    return True


# how the report names an engine measured beside the one that decided
ENGINE_LABELS = {"reference": "reference decoder"}


def throughput_panel(ax, title: str, figures: EngineBench) -> None:
    """One engine's bars: tokens/s, an error bar of the interval its rounds give (at the speedups'
    confidence), and under each other method the candidate's speedup over it with its interval."""
    methods = figures.methods.present()
    order = [name for name in ("baseline", "ngram", "incumbent", "candidate") if name in methods]
    confidence = next(iter(figures.speedups.values())).confidence if figures.speedups else 0.95
    speeds = [methods[name].tok_s for name in order]
    low, high = [], []
    for name, speed in zip(order, speeds, strict=True):
        spread = rounds_interval(methods[name].round_tok_s, confidence)
        low.append(speed - speed * spread[0] if spread else 0.0)
        high.append(speed * spread[1] - speed if spread else 0.0)
    bars = ax.bar(order, speeds, yerr=[low, high], capsize=4, color=[COLORS[i] for i in range(len(order))])
    for name, bar, speed, above in zip(order, bars, speeds, high, strict=True):
        middle = bar.get_x() + bar.get_width() / 2
        ax.annotate(f"{speed:,.1f}", (middle, speed + above), ha="center", va="bottom", fontsize=8)
        speedup = figures.speedups.get(name)
        if speedup is not None:  # the candidate over this method, paired round by round
            label = f"candidate\n{speedup.ratio:.2f}x\n[{speedup.ci_low:.2f}, {speedup.ci_high:.2f}]"
            ax.annotate(label, (middle, speed * 0.04), ha="center", va="bottom", fontsize=7, color="white")
    ax.set(ylabel="output tokens / s", ylim=(0, max(s + h for s, h in zip(speeds, high, strict=True)) * 1.15))
    ax.set_title(f"{title} ({confidence:.0%} intervals)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def rounds_interval(round_tok_s: list[float], confidence: float) -> tuple[float, float] | None:
    """The interval of a method's speed from its per-round tokens/s, relative to their geometric mean
    (pipeline.spread's t-interval on the logs): (low, high) factors; None with fewer than 2 rounds."""
    if len(round_tok_s) < 2 or min(round_tok_s) <= 0:
        return None
    estimate = ratio_from_samples(round_tok_s, [1.0] * len(round_tok_s), confidence)
    return estimate.ci_low / estimate.ratio, estimate.ci_high / estimate.ratio


def _predicted_curve(evaluation: AcceptanceMetrics, bench: BenchSummary) -> list[float]:
    """What the speed model predicted for the benchmarked shape: a tree's simulated acceptance per depth
    (an evaluation from before shapes were simulated: the per-parent top-k count), a chain's TTT counts."""
    if bench.topk == 1:
        return evaluation.full_acc
    shape = (
        evaluation.shape(bench.draft_steps, bench.topk, bench.draft_tokens)
        if isinstance(evaluation, EvalRecord)
        else None
    )
    if shape is not None:
        return shape.full_acc
    return evaluation.full_acc_at.get(str(bench.topk), evaluation.full_acc)


def _measured_curve(histogram: list[int]) -> list[float]:
    total = sum(histogram) or 1
    return [sum(histogram[k:]) / total for k in range(1, len(histogram))]


def plot_predicted_vs_measured(record: RunRecord, path: Path) -> bool:
    methods, bench = _bench_methods(record), record.bench
    if record.eval is None or bench is None or not methods:
        return False
    topk = bench.topk
    incumbent = record.eval.incumbent if isinstance(record.eval.incumbent, IncumbentEval) else None
    pairs: list[tuple[str, AcceptanceMetrics | None]] = [("candidate", record.eval), ("incumbent", incumbent)]
    fig, axes = _figure()
    ax = axes[0][0]
    drawn = False
    for i, (name, evaluation) in enumerate(pairs):
        histogram = methods[name].accepted_histogram if name in methods else None
        predicted = _predicted_curve(evaluation, bench) if evaluation is not None else None
        if not histogram or not predicted:
            continue
        measured = _measured_curve(histogram)
        depth = min(len(measured), len(predicted))
        ks = list(range(1, depth + 1))
        ax.plot(
            ks,
            predicted[:depth],
            linestyle="--",
            marker="o",
            color=COLORS[i],
            label=f"{name}: predicted (eval, width {topk})",
        )
        ax.plot(ks, measured[:depth], marker="s", color=COLORS[i], label=f"{name}: measured (benchmark)")
        drawn = True
    if not drawn:
        import matplotlib.pyplot as plt

        plt.close(fig)
        return False
    ax.set(xlabel="draft position k", ylabel="P(first k drafts all accepted)", ylim=(0, 1.02))
    ax.set_xticks(range(1, depth + 1))
    measured_tau = bench.tau_measured if bench.tau_measured is not None else float("nan")
    ax.set_title(
        f"acceptance length: predicted {bench.tau_simulated:.2f}, measured {measured_tau:.2f}", fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
    return True


PLOTTERS = {
    "training": plot_training,
    "attempts": plot_attempts,
    "acceptance": plot_acceptance,
    "throughput": plot_throughput,
    "predicted_vs_measured": plot_predicted_vs_measured,
}


# ---------------------------------------------------------------- html


def serving_flags(store: ObjectStore, record: RunRecord, target: str) -> tuple[list[str], str]:
    """The SGLang flags to serve this run's drafter with, and where they come from."""
    if record.promote is not None and record.promote.promoted and record.promote.version is not None:
        version = record.promote.version
        manifest = read_manifest(store, layout.drafter_version_prefix(target, version), kind="drafter")
        return registry.serving_flags("<drafter-dir>", manifest["serving"]), f"registry version {version}"
    if record.bench is not None:
        bench = record.bench
        flags = sglang_flags("<drafter-dir>", bench.draft_steps, bench.topk, bench.draft_tokens)
        return flags, "the benchmark's settings (not promoted)"
    return [], ""


def _cell(value: Any) -> str:
    """A summary value as text (the template escapes it)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return "\u2013" if value is None else str(value)


def _interval(speedup: RatioInterval) -> str:
    return f"{speedup.ratio:.3f} ({speedup.ci_low:.3f}\u2013{speedup.ci_high:.3f}, {speedup.rounds} rounds)"


def trigger_rows(trigger: dict[str, Any] | None) -> list[tuple[str, str]]:
    """What started the run, and why it trained nothing when it did not (a cron run with nothing new)."""
    if not trigger:
        return []
    started = trigger.get("trigger") or {}
    rows = [("triggered by", f"{started.get('kind', '?')}: {started.get('reason', '')}")]
    if trigger.get("skipped"):
        rows.append(("skipped", trigger["skipped"]))
    return rows


def init_rows(train: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per training attempt: where it started from, why, and how it ended (train.init)."""
    return [
        (
            f"training attempt {number}",
            f"{attempt['init']['chosen']} (train.init {attempt['init']['requested']}): "
            f"{attempt['init']['reason']}{_restart_bar_note(attempt['init'])}; {attempt['stop_reason']} "
            f"after {attempt['global_steps']} steps",
        )
        for number, attempt in enumerate(train.get("attempts") or [], 1)
    ]


def _restart_bar_note(init: dict[str, Any]) -> str:
    bar = init.get("restart_under")
    if not bar:
        return ""
    return f"; a stall under training cond_acc_0 {bar['cond_acc0']:.3f} restarts it ({bar['reason']})"


def _summary_rows(record: RunRecord) -> list[tuple[str, Any]]:
    evaluation, bench, promote = record.eval, record.bench, record.promote
    train = record.train or {}
    result = train.get("result") or {}
    return [
        ("outcome", record.outcome),
        *next_step_rows(record),
        ("target", ((record.config or {}).get("target") or {}).get("name")),
        *architecture_rows(record),
        ("dataset", train.get("dataset")),
        *trigger_rows(record.trigger),
        ("training stop", result.get("stop_reason")),
        *init_rows(train),
        ("epochs run", result.get("epochs_run")),
        ("train samples", result.get("train_samples")),
        ("cond_acc_k (eval)", evaluation.cond_acc if evaluation else None),
        ("tau simulated (eval)", evaluation.tau_simulated if evaluation else None),
        *(_domain_rows(evaluation) if evaluation else []),
        *(incumbent_rows(evaluation) if evaluation else []),
        ("speed decided by", deciding_engine(bench) if bench else None),
        *(acceptance_rows(bench) if bench else []),
        ("tau predicted (bench)", bench.tau_simulated if bench else None),
        ("tau measured (bench)", bench.tau_measured if bench else None),
        ("baseline tok/s", bench.baseline_tok_s if bench else None),
        ("candidate tok/s", bench.drafter_tok_s if bench else None),
        *[
            (f"speedup vs {other} ({speedup.confidence:.0%} interval)", _interval(speedup))
            for other, speedup in (bench.speedups.items() if bench else [])
        ],
        *(beside_rows(bench) if bench else []),
        *(bench_domain_rows(bench) if bench else []),
        *(batch_rows(bench) if bench else []),
        *(sampled_rows(bench) if bench else []),
        ("promoted version", promote.version if promote and promote.promoted else None),
    ]


def architecture_rows(record: RunRecord) -> list[tuple[str, str]]:
    """A drafter architecture other than the default, and for one no engine here loads (eagle3-mla), that and
    why."""
    architecture = ((record.config or {}).get("drafter") or {}).get("architecture", "eagle3")
    if architecture == "eagle3":
        return []
    unloadable = ((record.train or {}).get("result") or {}).get("no_engine_here")  # the train stage's finding
    return [("drafter architecture", architecture)] + ([("engines here", unloadable)] if unloadable else [])


def next_step_rows(record: RunRecord) -> list[tuple[str, str]]:
    """What to do about a run whose benchmark could not tell whether the candidate is faster."""
    promoted = record.promote is not None and record.promote.promoted
    step = record.bench.decision.next_step if record.bench is not None else None
    return [("what to do", step)] if step and not promoted else []


def _measured(methods: BenchMethods | Mapping[str, MeasuredAcceptance]) -> str:
    """Each speculative method's measured tau, candidate first."""
    order = ("candidate", "incumbent", "ngram")
    present = methods.present() if isinstance(methods, BenchMethods) else methods
    return ", ".join(
        f"{name} {present[name].tau_measured:.3f}"
        for name in order
        if name in present and present[name].tau_measured is not None
    )


def acceptance_rows(bench: BenchRecord) -> list[tuple[str, Any]]:
    """The serving engine's acceptance against the reference decoder's, when it was checked."""
    check = bench.acceptance
    if check is None:
        return []
    verdict = "within" if check.passed else "OUTSIDE"
    return [
        (
            f"acceptance in {check.engine} vs the reference decoder",
            f"tau {check.tau:.3f} vs {check.reference_tau:.3f} (chain of {check.draft_steps}): relative "
            f"difference {check.rel_diff:.4f}, {verdict} the tolerance {check.tolerance}; per position "
            f"{_cell(check.acceptance_per_position)} vs {_cell(check.reference_acceptance_per_position)}",
        )
    ]


def beside_rows(bench: BenchRecord) -> list[tuple[str, Any]]:
    """What each engine measured beside the one that decided: its own speedups, not decisive."""
    return [
        (
            f"{ENGINE_LABELS.get(name, name)} beside it (not decisive)",
            f"candidate {figures.drafter_tok_s:.1f} tok/s, baseline {figures.baseline_tok_s:.1f}; "
            + "; ".join(f"vs {other} {_interval(speedup)}" for other, speedup in figures.speedups.items()),
        )
        for name, figures in bench.beside.items()
    ]


def bench_domain_rows(bench: BenchRecord) -> list[tuple[str, Any]]:
    """Per benchmarked domain: measured tau of the candidate beside the incumbent's and n-gram's, and the
    candidate's per-position acceptance."""
    rows = []
    for domain, methods in sorted(bench.domains.items()):
        candidate = methods.candidate
        rows.append(
            (
                f"domain {domain} (bench)",
                f"tau measured {_measured(methods)}; candidate per position "
                f"{_cell(candidate.acceptance_per_position)}",
            )
        )
    for domain, measured in sorted(bench.domain_acceptance.items()):
        theirs = measured.get("candidate")
        rows.append(
            (
                f"domain {domain} (bench)",
                f"tau measured {_measured(measured)}; candidate per position "
                f"{_cell(theirs.acceptance_per_position if theirs else None)}",
            )
        )
    return rows


def batch_rows(bench: BenchRecord) -> list[tuple[str, Any]]:
    """Per batch size measured beside the headline's: the drafts it ran, measured tau of the candidate,
    incumbent and n-gram, tokens/s, the candidate's speedups and the speed model's prediction."""
    if not bench.batches:
        return []
    headline = f"batch {bench.batch_size}: " + "; ".join(
        f"vs {other} {_interval(speedup)}" for other, speedup in bench.speedups.items()
    )
    rows: list[tuple[str, Any]] = [("batch sizes (bench)", f"headline at {headline}")]
    for batch in bench.batches:
        drafts = (
            f"chain of {batch.draft_steps}"
            if batch.topk == 1
            else f"steps {batch.draft_steps}, topk {batch.topk}, {batch.draft_tokens} draft tokens"
        )
        predicted = (
            f"; predicted speedup {batch.predicted_speedup:.3f}"
            if batch.predicted_speedup is not None
            else ""
        )
        speedups = "; ".join(f"vs {other} {_interval(speedup)}" for other, speedup in batch.speedups.items())
        rows.append(
            (
                f"batch {batch.batch_size} (bench)",
                f"{drafts}; candidate {batch.methods.candidate.tok_s:.1f} tok/s, baseline "
                f"{batch.methods.baseline.tok_s:.1f}; tau measured {_measured(batch.methods)}; "
                f"speedup {speedups}{predicted}",
            )
        )
    return rows


def sampled_rows(bench: BenchRecord) -> list[tuple[str, Any]]:
    """The benchmark at the serving temperature: measured tau and speedups."""
    sampled = bench.sampled
    if sampled is None:
        return []
    how = f"temperature {sampled.temperature:g}, top_p {sampled.top_p:g}" + (
        f", top_k {sampled.top_k}" if sampled.top_k else ""
    )
    taus = ", ".join(
        f"{name} {result.tau_measured:.3f}"
        for name, result in sampled.methods.items()
        if result.tau_measured is not None
    )
    return [(f"tau measured ({how})", taus)] + [
        (f"speedup vs {other} ({how})", _interval(speedup)) for other, speedup in sampled.speedups.items()
    ]


def _domain_rows(evaluation: EvalRecord) -> list[tuple[str, Any]]:
    """Per held-out domain: the candidate's cond_acc_k and tau, beside the incumbent's on that domain."""
    incumbent = evaluation.incumbent if isinstance(evaluation.incumbent, IncumbentEval) else None
    rows = []
    for domain, metrics in sorted(evaluation.domains.items()):
        theirs = incumbent.domains.get(domain) if incumbent else None
        beside = f" (incumbent {theirs.tau_simulated:.3f})" if theirs else ""
        rows.append(
            (
                f"domain {domain} (eval, {metrics.samples} held out)",
                f"cond_acc_k {_cell(metrics.cond_acc)}; tau simulated {metrics.tau_simulated:.3f}{beside}",
            )
        )
    return rows


def incumbent_rows(evaluation: EvalRecord) -> list[tuple[str, str]]:
    """The candidate against the incumbent on the same held-out anchors, pooled and on each domain both
    were scored on: ahead or behind, by how much (a candidate behind never promotes: pipeline.stages.gate)."""
    incumbent = evaluation.incumbent
    if isinstance(incumbent, IncumbentSkipped):
        return [(f"vs incumbent {incumbent.version}", f"not compared: {incumbent.skipped}")]
    if not isinstance(incumbent, IncumbentEval):
        return []
    rows = [
        (
            f"vs incumbent {incumbent.version} (tau simulated, eval)",
            f"{evaluation.tau_simulated:.3f} vs {incumbent.tau_simulated:.3f}: "
            f"{signed(evaluation.tau_simulated - incumbent.tau_simulated)}",
        )
    ]
    for domain in sorted(set(evaluation.domains) & set(incumbent.domains)):
        ours, theirs = evaluation.domains[domain].tau_simulated, incumbent.domains[domain].tau_simulated
        rows.append((f"vs incumbent on {domain}", f"{ours:.3f} vs {theirs:.3f}: {signed(ours - theirs)}"))
    if incumbent.target_differs:
        rows.append(("incumbent trained for another target", "; ".join(incumbent.target_differs)))
    return rows


@dataclass(frozen=True)
class Plot:
    name: str
    title: str
    png: str | None  # base64, None when the plot has no data
    missing: str  # why not, when png is None


@functools.cache
def _templates() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("pipeline.ops", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    environment.filters["cell"] = _cell
    return environment


def render_html(record: RunRecord, images: dict[str, bytes], flags: tuple[list[str], str]) -> str:
    """report.html from pipeline/ops/templates/report.html.j2; every value is escaped by the template."""
    plots = [
        Plot(
            name,
            title,
            base64.b64encode(images[name]).decode() if name in images else None,
            "no training history" if name == "training" else "the run stopped before the benchmark",
        )
        for name, title in PLOTS.items()
        if name != "attempts" or name in images  # shown only for a run that restarted
    ]
    contract = (record.train or {}).get("contract")
    return (
        _templates()
        .get_template("report.html.j2")
        .render(
            run=record,
            rendered=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            summary=_summary_rows(record),
            plots=plots,
            curves=training_curves(record),
            cost=cost_rows(record.cost) if record.cost else [],
            flags=flags[0],
            flags_source=flags[1],
            verdicts=BENCH_OUTCOMES,
            decided_by=f"speed decided by {deciding_engine(record.bench)}" if record.bench else "",
            contract_text=json.dumps(contract, indent=2) if contract else "not recorded",
            config_text=yaml.safe_dump(record.config, sort_keys=False) if record.config else "not recorded",
        )
    )


def training_curves(record: RunRecord) -> dict[str, str | None]:
    """Where the run's training curves are (the train manifest's `tracking`), and how to open them."""
    tracking = (record.train or {}).get("tracking") or {}
    tensorboard, mlflow = tracking.get("tensorboard"), (tracking.get("mlflow") or {}).get("url")
    command = None
    if tensorboard:
        local = f"./tensorboard/{record.run_id}"
        command = (
            f"aws s3 sync {tensorboard} {local} && tensorboard --logdir ./tensorboard"
            if tensorboard.startswith("s3://")
            else f"tensorboard --logdir {tensorboard.removeprefix('file://')}"
        )
    return {"tensorboard": tensorboard, "tensorboard_command": command, "mlflow": mlflow}


def report_link(store: ObjectStore, key: str) -> str:
    """Where a person opens the report: the file, the S3 console, or a custom endpoint's object URL.
    Never a presigned URL: those carry credentials."""
    uri = store.uri(key)
    if uri.startswith("file://"):
        return uri
    bucket, object_key = uri[len("s3://") :].split("/", 1)
    endpoint = getattr(store, "endpoint_url", None)
    if endpoint:
        return f"{endpoint.rstrip('/')}/{bucket}/{object_key}"
    region = getattr(store, "region", None) or "us-east-1"
    return f"https://s3.console.aws.amazon.com/s3/object/{bucket}?region={region}&prefix={object_key}"


def render(store: ObjectStore, run_id: str, target: str) -> dict[str, Any]:
    """Build and publish runs/<run_id>/report/: one PNG per plot that has data, and report.html.
    Returns the report's manifest."""
    record = load_run(store, run_id)
    if not record.stages and not (record.trigger or {}).get("skipped"):  # a skipped run says why
        raise ValueError(f"run {run_id!r} has published nothing to report on")
    prefix = layout.run_stage_prefix(run_id, "report")
    objects, images = [], {}
    with tempfile.TemporaryDirectory(prefix="report-") as tmp:
        for name, plotter in PLOTTERS.items():
            path = Path(tmp) / f"{name}.png"
            if plotter(record, path):
                images[name] = path.read_bytes()
                objects.append(store.put_file(f"{prefix}/{name}.png", path))
    page = render_html(record, images, serving_flags(store, record, target))
    objects.append(store.put_bytes(f"{prefix}/report.html", page.encode()))
    link = report_link(store, f"{prefix}/report.html")
    manifest = publish(
        store,
        prefix,
        "report",
        objects,
        {"run_id": run_id, "outcome": record.outcome, "plots": sorted(images), "link": link},
    )
    log.info("run report: %s", link)
    return manifest


# ---------------------------------------------------------------- status


def status_table(store: ObjectStore, target: str, limit: int = 10) -> str:
    lines = [f"registry: {target}"]
    for alias in registry.SHOWN_ALIASES:
        found = registry.read_alias(store, target, alias)
        record = AliasRecord.model_validate(found) if found is not None else None
        lines.append(
            f"  {alias:<11} {record.version if record else '-':<28} {record.updated_at if record else ''}"
        )
    versions = registry.list_versions(store, target)
    lines.append(f"  {len(versions)} version(s)")
    unreadable = [row for row in versions if "unreadable" in row]
    lines += [f"    {row['version']} unreadable: {row['unreadable']}" for row in unreadable]
    runs = list_runs(store, limit)
    lines += [
        "",
        f"recent runs (newest first, {len(runs)} shown):",
        f"  {'run':<44}{'finished':<22}{'gate':<10}{'tau':>7}{'speedup':>9}{'GPU-h':>10}{'cost':>12}"
        "  outcome",
    ]
    for run in runs:
        gate = "-" if run.gate is None else ("passed" if run.gate.passed else "rejected")
        tau = run.eval.tau_simulated if run.eval is not None else None
        speedup = run.bench.speedup_vs_baseline if run.bench is not None else None
        cost = run.cost
        gpu_hours = f"{cost.gpu_hours:,.2f}" if cost else "-"
        dollars = f"${cost.cost_usd:,.2f}" if cost and cost.cost_usd is not None else "-"
        lines.append(
            f"  {run.run_id[:43]:<44}{(run.created_at or '-'):<22}{gate:<10}"
            f"{f'{tau:.2f}' if tau else '-':>7}{f'{speedup:.2f}x' if speedup else '-':>9}"
            f"{gpu_hours:>10}{dollars:>12}  {run.outcome}"
        )
        lines += [f"      {name}: {text}" for name, text in trigger_rows(run.trigger)]
        lines += [f"      {name}: {text}" for name, text in init_rows(run.train or {})]
        lines += [f"      {name}: {text}" for name, text in next_step_rows(run)]
        if run.eval is not None and isinstance(run.eval.incumbent, IncumbentEval):
            lines.append(f"      {standing_vs_incumbent(run.eval, run.eval.incumbent)}")
    evaluated = next((run for run in runs if run.eval is not None), None)
    if evaluated is not None and evaluated.eval is not None:
        lines += ["", f"latest evaluated run {evaluated.run_id}, per domain:"]
        lines += [f"  {name}: {_cell(value)}" for name, value in _domain_rows(evaluated.eval)] or [
            "  (no domains)"
        ]
    benchmarked = next((run for run in runs if run.bench is not None), None)
    if benchmarked is not None and benchmarked.bench is not None:
        bench = benchmarked.bench
        lines += ["", f"latest benchmarked run {benchmarked.run_id}, per domain, batch size and sampled:"]
        detail = bench_domain_rows(bench) + batch_rows(bench) + sampled_rows(bench)
        lines += [f"  {name}: {_cell(value)}" for name, value in detail] or [
            "  (no domains, batch sizes or sampled figures)"
        ]
    return "\n".join(lines)
