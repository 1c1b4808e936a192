"""`drafter run`: every stage in order for one config, then summary.json beside the run's artifacts."""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.manifest import read_listed, read_manifest
from pipeline.ops import registry
from pipeline.stages import benchmark, capture, evaluate, gate, generate, promote, prompts, train
from pipeline.stages.gate import GateFailed
from pipeline.stages.promote import PromotionRefused
from pipeline.storage import ObjectStore, open_store

log = logging.getLogger(__name__)
SUMMARY_NAME = "summary.json"


def new_run_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("run-%Y%m%d-%H%M%S")


def _json(store: ObjectStore, uri: str, name: str) -> dict[str, Any]:
    prefix = store.key_for(uri)
    return json.loads(read_listed(store, prefix, read_manifest(store, prefix), name))


def write_summary(store: ObjectStore, run_id: str, summary: dict[str, Any]) -> str:
    key = f"{layout.run_prefix(run_id)}/{SUMMARY_NAME}"
    store.put_bytes(key, json.dumps(summary, indent=2).encode())
    return store.uri(key)


def summary_location(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def run_all(config: RunConfig, run_id: str, store: ObjectStore | None = None) -> tuple[dict[str, Any], str]:
    """Run prompts -> ... -> promote -> pull; returns (summary, summary location).

    A failed gate or a refused promotion ends the run early but still writes the summary; its
    "outcome" says which, and "failure" carries every reason.
    """
    store = store or open_store(config.storage)
    store.put_bytes(f"{layout.run_prefix(run_id)}/config.json", json.dumps(config.dump(), indent=2).encode())
    workdir = config.storage.run_workdir(run_id)
    prompt_set = prompts.run(config, run_id, store)
    responses = generate.run(config, prompt_set.uri, run_id, store)
    captured = capture.run(config, responses.uri, run_id, store)
    dataset = capture.publish_dataset(config, [captured.uri], run_id, store)
    incumbent = registry.pull_incumbent(store, config.target.name, config.registry.alias, workdir)
    trained = train.run(config, dataset.uri, run_id, store)
    evaluation = evaluate.run(config, trained.uri, dataset.uri, run_id, store, incumbent)
    eval_record = _json(store, evaluation.uri, "eval.json")
    totals = dataset.manifest["totals"]
    summary: dict[str, Any] = {
        "run_id": run_id,
        "target": config.target.name,
        "samples": totals["train"]["samples"] + totals["eval"]["samples"],
        "tokens": totals["train"]["tokens"] + totals["eval"]["tokens"],
        "cond_acc": eval_record["cond_acc"],
        "tau_simulated": None,
        "tau_measured": None,
        "baseline_tok_s": None,
        "drafter_tok_s": None,
        "promoted_version": None,
        "registry_uri": None,
        "gate_passed": None,
        "stop_reason": trained.manifest["result"]["stop_reason"],
    }
    try:
        gate.run(config, evaluation.uri, run_id, store)
        summary["gate_passed"] = True
        bench = benchmark.run(
            config,
            trained.uri,
            evaluation.uri,
            prompt_set.uri,
            run_id,
            store,
            incumbent[1] if incumbent else None,
        )
        bench_record = _json(store, bench.uri, "bench.json")
        summary.update(
            {
                k: bench_record[k]
                for k in (
                    "tau_simulated",
                    "tau_measured",
                    "baseline_tok_s",
                    "drafter_tok_s",
                    "speedup_vs_baseline",
                    "speedup_vs_ngram",
                )
            }
        )
        summary["ngram_tok_s"] = bench_record["methods"]["ngram"]["tok_s"]
        promoted = promote.run(
            config,
            run_id,
            trained.uri,
            evaluation.uri,
            f"{store.uri(layout.run_prefix(run_id))}/gate",
            bench.uri,
            store,
        )
        if promoted.manifest.get("promoted"):
            summary["promoted_version"] = promoted.manifest["version"]
            summary["registry_uri"] = promoted.manifest["registry_uri"]
            pulled = registry.pull(
                store, config.target.name, config.registry.alias, workdir / "pulled_drafter"
            )
            summary["pulled_to"] = str(pulled)
        summary["outcome"] = (
            "promoted" if summary["promoted_version"] else "not promoted (registry.promote is false)"
        )
    except GateFailed as failure:
        summary.update({"gate_passed": False, "outcome": "gate failed", "failure": str(failure)})
    except PromotionRefused as refusal:
        summary.update({"outcome": "promotion refused", "failure": str(refusal)})
    from pipeline.ops.report import render

    summary["report"] = render(store, run_id, config.target.name).manifest["link"]
    return summary, summary_location(write_summary(store, run_id, summary))


def format_table(summary: dict[str, Any]) -> str:
    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        if isinstance(value, list):
            return "[" + ", ".join(fmt(v) for v in value) + "]"
        return "-" if value is None else str(value)

    rows = [("samples", summary["samples"]), ("tokens", summary["tokens"])]
    rows += [(f"cond_acc_{k}", v) for k, v in enumerate(summary["cond_acc"])]
    rows.append(("outcome", summary.get("outcome")))
    rows += [
        ("tau simulated", summary["tau_simulated"]),
        ("tau measured", summary["tau_measured"]),
        ("baseline tok/s", summary["baseline_tok_s"]),
        ("n-gram tok/s", summary.get("ngram_tok_s")),
        ("drafter tok/s", summary["drafter_tok_s"]),
        ("speedup vs baseline", summary.get("speedup_vs_baseline")),
        ("promoted version", summary["promoted_version"]),
        ("registry", summary["registry_uri"]),
        ("pulled to", summary.get("pulled_to")),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {fmt(value)}" for name, value in rows)
