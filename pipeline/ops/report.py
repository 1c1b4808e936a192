"""Run reports: PNG plots and one self-contained report.html in runs/<run_id>/report/, built from what
the run's stages published (train, eval, gate, bench, promote manifests), plus the `drafter status`
table of aliases and recent runs. A run that stopped early (a rejected gate, a refused promotion) still
gets a report; the sections it never reached say so.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline import layout
from pipeline.manifest import manifest_exists, publish, read_listed, read_manifest
from pipeline.ops import registry
from pipeline.stages import StageResult
from pipeline.storage import ObjectStore

log = logging.getLogger(__name__)
PLOTS = {
    "training": "Training: loss and conditional acceptance per epoch",
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
    eval: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None
    bench: dict[str, Any] | None = None
    promote: dict[str, Any] | None = None
    created_at: str | None = None
    stages: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        if self.promote is not None:
            return f"promoted {self.promote['version']}" if self.promote.get("promoted") else "not promoted"
        if self.gate is not None and not self.gate["passed"]:
            return "gate rejected"
        if self.bench is not None and not self.bench.get("decision", {}).get("promotable", True):
            return "benchmark refused"
        return "incomplete" if self.stages else "no artifacts"


def _stage_json(
    store: ObjectStore, run_id: str, stage: str, name: str | None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    prefix = f"{layout.run_prefix(run_id)}/{stage}"
    if not manifest_exists(store, prefix):
        return None, None
    manifest = read_manifest(store, prefix)
    if name is None:
        return manifest, manifest
    return manifest, json.loads(read_listed(store, prefix, manifest, name))


def load_run(store: ObjectStore, run_id: str) -> RunRecord:
    record = RunRecord(run_id)
    train_manifest, _ = _stage_json(store, run_id, "train", None)
    if train_manifest is not None:
        record.train, record.created_at = train_manifest, train_manifest["created_at"]
    config_key = f"{layout.run_prefix(run_id)}/config.json"
    if store.exists(config_key):
        record.config = json.loads(store.get_bytes(config_key))
    elif train_manifest is not None:
        record.config = {"train": train_manifest.get("config")}
    for stage, name in (
        ("eval", "eval.json"),
        ("gate", "gate.json"),
        ("bench", "bench.json"),
        ("promote", "promote.json"),
    ):
        manifest, data = _stage_json(store, run_id, stage, name)
        setattr(record, stage, data)
        if manifest is not None:
            record.stages.append(stage)
            record.created_at = max(record.created_at or "", manifest["created_at"])
    if train_manifest is not None:
        record.stages.insert(0, "train")
    return record


def list_runs(store: ObjectStore, limit: int = 10) -> list[RunRecord]:
    """The newest runs that trained something, newest first."""
    run_ids = {key.split("/")[1] for key in store.list("runs") if key.endswith("/train/manifest.json")}
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
    thresholds = ((record.gate or {}).get("thresholds") or (record.config or {}).get("gate") or {}).get(
        "min_cond_acc", []
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


def _bench_methods(record: RunRecord) -> dict[str, dict[str, Any]]:
    return (record.bench or {}).get("methods") or {}


def plot_acceptance(record: RunRecord, path: Path) -> bool:
    methods = {
        name: m["accepted_histogram"]
        for name, m in _bench_methods(record).items()
        if m.get("accepted_histogram")
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
    methods = _bench_methods(record)
    order = [name for name in ("baseline", "ngram", "incumbent", "candidate") if name in methods]
    if not order:
        return False
    fig, axes = _figure()
    ax = axes[0][0]
    speeds = [methods[name]["tok_s"] for name in order]
    bars = ax.bar(order, speeds, color=[COLORS[i] for i in range(len(order))])
    base = methods.get("baseline", {}).get("tok_s")
    for bar, speed in zip(bars, speeds, strict=True):
        label = f"{speed:,.1f}" + (f"\n{speed / base:.2f}x" if base else "")
        ax.annotate(
            label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8
        )
    ax.set(ylabel="output tokens / s", ylim=(0, max(speeds) * 1.25))
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path)
    return True


def _predicted_curve(evaluation: dict[str, Any], topk: int) -> list[float] | None:
    if topk > 1 and str(topk) in (evaluation.get("full_acc_at") or {}):
        return evaluation["full_acc_at"][str(topk)]
    return evaluation.get("full_acc")


def _measured_curve(histogram: list[int]) -> list[float]:
    total = sum(histogram) or 1
    return [sum(histogram[k:]) / total for k in range(1, len(histogram))]


def plot_predicted_vs_measured(record: RunRecord, path: Path) -> bool:
    methods, bench = _bench_methods(record), record.bench
    if record.eval is None or bench is None or not methods:
        return False
    topk = bench.get("topk", 1)
    pairs = [("candidate", record.eval), ("incumbent", record.eval.get("incumbent"))]
    fig, axes = _figure()
    ax = axes[0][0]
    drawn = False
    for i, (name, evaluation) in enumerate(pairs):
        histogram = (methods.get(name) or {}).get("accepted_histogram")
        predicted = _predicted_curve(evaluation or {}, topk)
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
    ax.set_title(
        f"acceptance length: predicted {bench.get('tau_simulated', float('nan')):.2f}, "
        f"measured {bench.get('tau_measured', float('nan')):.2f}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
    return True


PLOTTERS = {
    "training": plot_training,
    "acceptance": plot_acceptance,
    "throughput": plot_throughput,
    "predicted_vs_measured": plot_predicted_vs_measured,
}


# ---------------------------------------------------------------- html


def serving_flags(store: ObjectStore, record: RunRecord, target: str) -> tuple[list[str], str]:
    """The SGLang flags to serve this run's drafter with, and where they come from."""
    if record.promote and record.promote.get("promoted"):
        manifest = read_manifest(
            store, layout.drafter_version_prefix(target, record.promote["version"]), kind="drafter"
        )
        return registry.serving_flags(
            "<drafter-dir>", manifest["serving"]
        ), f"registry version {record.promote['version']}"
    if record.bench:
        flags = registry.sglang_flags(
            "<drafter-dir>",
            record.bench["draft_steps"],
            record.bench.get("topk", 1),
            record.bench.get("draft_tokens"),
        )
        return flags, "the benchmark's settings (not promoted)"
    return [], ""


def _rows(pairs: list[tuple[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        if isinstance(value, list):
            return ", ".join(cell(v) for v in value)
        return "&ndash;" if value is None else html.escape(str(value))

    return "".join(f"<tr><th>{html.escape(name)}</th><td>{cell(value)}</td></tr>" for name, value in pairs)


def _summary_rows(record: RunRecord) -> list[tuple[str, Any]]:
    evaluation, bench, result = (
        record.eval or {},
        record.bench or {},
        (record.train or {}).get("result") or {},
    )
    return [
        ("outcome", record.outcome),
        ("target", ((record.config or {}).get("target") or {}).get("name")),
        ("dataset", (record.train or {}).get("dataset")),
        ("training stop", result.get("stop_reason")),
        ("epochs run", result.get("epochs_run")),
        ("train samples", result.get("train_samples")),
        ("cond_acc_k (eval)", evaluation.get("cond_acc")),
        ("tau simulated (eval)", evaluation.get("tau_simulated")),
        ("tau predicted (bench)", bench.get("tau_simulated")),
        ("tau measured (bench)", bench.get("tau_measured")),
        ("baseline tok/s", bench.get("baseline_tok_s")),
        ("candidate tok/s", bench.get("drafter_tok_s")),
        ("speedup vs baseline", bench.get("speedup_vs_baseline")),
        ("speedup vs n-gram", bench.get("speedup_vs_ngram")),
        (
            "promoted version",
            (record.promote or {}).get("version") if (record.promote or {}).get("promoted") else None,
        ),
    ]


def _gate_section(record: RunRecord) -> str:
    if record.gate is None:
        return "<p class=missing>The gate did not run.</p>"
    rows = "".join(
        f"<tr class={'pass' if c['passed'] else 'fail'}><td>{html.escape(c['check'])}</td>"
        f"<td>{c['value']:.4f}</td><td>{c['threshold']:.4f}</td>"
        f"<td>{'pass' if c['passed'] else 'FAIL'}</td></tr>"
        for c in record.gate["checks"]
    )
    verdict = "passed" if record.gate["passed"] else "rejected the candidate"
    bench = ""
    if record.bench and record.bench.get("decision"):
        decision = record.bench["decision"]
        reasons = "".join(f"<li>{html.escape(r)}</li>" for r in decision["reasons"])
        outcome = "promotable" if decision["promotable"] else "refused"
        bench = f"<p>Benchmark decision: {outcome}</p><ul>{reasons}</ul>"
    return (
        f"<p>The gate {verdict}.</p><table><tr><th>check</th><th>value</th><th>threshold</th><th></th></tr>"
        f"{rows}</table>{bench}"
    )


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{margin-bottom:0}.sub{color:#666;margin-top:.2em}table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;font-size:.9em}th{background:#f5f5f5}
tr.fail td{background:#fde8e8}tr.pass td{background:#eaf7ea}img{max-width:100%;border:1px solid #eee}
pre{background:#f7f7f7;padding:.8em;overflow:auto;font-size:.8em}.missing{color:#a00}
.badge{display:inline-block;padding:.2em .6em;border-radius:.3em;background:#eee;font-weight:600}"""


def render_html(record: RunRecord, images: dict[str, bytes], flags: tuple[list[str], str]) -> str:
    figures = "".join(
        f"<h3>{html.escape(PLOTS[name])}</h3><img alt='{name}' src='data:image/png;base64,"
        f"{base64.b64encode(images[name]).decode()}'>"
        if name in images
        else f"<h3>{html.escape(PLOTS[name])}</h3><p class=missing>Not available: "
        f"{'the run stopped before the benchmark' if name != 'training' else 'no training history'}.</p>"
        for name in PLOTS
    )
    contract = (record.train or {}).get("contract")
    serving = (
        (
            f"<p>From {html.escape(flags[1])}:</p>"
            f"<pre>python -m sglang.launch_server --model-path &lt;target&gt; "
            f"{html.escape(' '.join(flags[0]))}</pre>"
        )
        if flags[0]
        else "<p class=missing>No drafter to serve.</p>"
    )
    stages = html.escape(", ".join(record.stages))
    rendered = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    contract_text = html.escape(json.dumps(contract, indent=2)) if contract else "not recorded"
    config_text = (
        html.escape(yaml.safe_dump(record.config, sort_keys=False)) if record.config else "not recorded"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>drafter run {html.escape(record.run_id)}</title>
<style>{STYLE}</style></head><body>
<h1>Run {html.escape(record.run_id)}</h1>
<p class=sub><span class=badge id=outcome>{html.escape(record.outcome)}</span> &middot; stages: {stages}
&middot; rendered {rendered}</p>
<h2>Summary</h2><table>{_rows(_summary_rows(record))}</table>
<h2>Gate</h2>{_gate_section(record)}
<h2>Plots</h2>{figures}
<h2>Serving flags</h2>{serving}
<h2>Capture contract</h2><pre>{contract_text}</pre>
<h2>Config</h2><pre>{config_text}</pre>
</body></html>
"""


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


def render(store: ObjectStore, run_id: str, target: str) -> StageResult:
    """Build and publish runs/<run_id>/report/: one PNG per plot that has data, and report.html."""
    record = load_run(store, run_id)
    if not record.stages:
        raise ValueError(f"run {run_id!r} has published nothing to report on")
    prefix = f"{layout.run_prefix(run_id)}/report"
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
    return StageResult(store.uri(prefix), manifest)


# ---------------------------------------------------------------- status


def status_table(store: ObjectStore, target: str, limit: int = 10) -> str:
    lines = [f"registry: {target}"]
    for alias in registry.SHOWN_ALIASES:
        record = registry.read_alias(store, target, alias)
        lines.append(
            f"  {alias:<11} {record['version'] if record else '-':<28} "
            f"{record.get('updated_at', '') if record else ''}"
        )
    versions = registry.list_versions(store, target)
    lines.append(f"  {len(versions)} version(s)")
    runs = list_runs(store, limit)
    lines += [
        "",
        f"recent runs (newest first, {len(runs)} shown):",
        f"  {'run':<44}{'finished':<22}{'gate':<10}{'tau':>7}{'speedup':>9}  outcome",
    ]
    for run in runs:
        gate = "-" if run.gate is None else ("passed" if run.gate["passed"] else "rejected")
        tau = (run.eval or {}).get("tau_simulated")
        speedup = (run.bench or {}).get("speedup_vs_baseline")
        lines.append(
            f"  {run.run_id[:43]:<44}{(run.created_at or '-'):<22}{gate:<10}"
            f"{f'{tau:.2f}' if tau else '-':>7}{f'{speedup:.2f}x' if speedup else '-':>9}  {run.outcome}"
        )
    return "\n".join(lines)
