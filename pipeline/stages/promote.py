"""promote: a gated, benchmarked candidate -> an immutable registry version and a moved alias."""

from __future__ import annotations

import json
import logging
from typing import Any

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.manifest import code_version, publish, read_listed, read_manifest
from pipeline.ops import registry
from pipeline.stages import StageResult
from pipeline.stages.evaluate import local_drafter_dir
from pipeline.storage import ObjectStore, open_store

log = logging.getLogger(__name__)


class PromotionRefused(RuntimeError):
    pass


def _record(store: ObjectStore, uri: str, kind: str, name: str) -> dict[str, Any]:
    prefix = store.key_for(uri)
    return json.loads(read_listed(store, prefix, read_manifest(store, prefix, kind=kind), name))


def run(
    config: RunConfig,
    run_id: str,
    train_uri: str,
    eval_uri: str,
    gate_uri: str,
    bench_uri: str,
    store: ObjectStore | None = None,
) -> StageResult:
    store = store or open_store(config.storage)
    gate = _record(store, gate_uri, "gate", "gate.json")
    if not gate["passed"]:
        raise PromotionRefused("the gate did not pass: " + "; ".join(gate["reasons"]))
    bench = _record(store, bench_uri, "bench", "bench.json")
    if not bench["decision"]["promotable"]:
        raise PromotionRefused(
            "the benchmark does not show the candidate faster: " + "; ".join(bench["decision"]["reasons"])
        )
    train = read_manifest(store, store.key_for(train_uri), kind="train")
    evaluation = _record(store, eval_uri, "eval", "eval.json")
    prefix = f"{layout.run_prefix(run_id)}/promote"
    lineage = {
        "run_id": run_id,
        "dataset": train["dataset"],
        "contract": train["contract"],
        "train": train_uri,
        "training_config": train["config"],
        "drafter_config": train["drafter_config"],
        "code_version": code_version(),
        "eval": {k: evaluation[k] for k in ("samples", "acc", "full_acc", "cond_acc", "tau_simulated")},
        "gate": {"passed": gate["passed"], "reasons": gate["reasons"]},
        "bench": {
            k: bench[k]
            for k in (
                "engine",
                "baseline_tok_s",
                "drafter_tok_s",
                "tau_measured",
                "tau_simulated",
                "speedup_vs_baseline",
                "speedup_vs_ngram",
                "draft_steps",
                "topk",
                "draft_tokens",
            )
        },
    }
    if not config.registry.promote:
        outcome = {"promoted": False, "reason": "registry.promote is false"}
    else:
        drafter_dir = local_drafter_dir(store, store.key_for(train_uri), config.storage.run_workdir(run_id))
        promoted = registry.promote(
            store,
            config.target.name,
            drafter_dir,
            lineage,
            config.registry.alias,
            serving={
                "steps": bench["draft_steps"],
                "topk": bench["topk"],
                "draft_tokens": bench["draft_tokens"],
            },
        )
        outcome = {
            "promoted": True,
            "version": promoted["version"],
            "alias": config.registry.alias,
            "registry_uri": promoted["uri"],
            "alias_record": promoted["alias"],
        }
        log.info(
            "promoted %s version %s as %s (%s)",
            config.target.name,
            promoted["version"],
            config.registry.alias,
            promoted["uri"],
        )
    info = store.put_bytes(f"{prefix}/promote.json", json.dumps(outcome, indent=2).encode())
    manifest = publish(store, prefix, "promote", [info], {"run_id": run_id, **outcome})
    return StageResult(store.uri(prefix), manifest)
