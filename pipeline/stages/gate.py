"""gate: evaluation + thresholds -> a decision record with every reason; a failed gate stops the run."""

from __future__ import annotations

import json
import logging
from typing import Any

from pipeline import layout
from pipeline.config import GateConfig, RunConfig
from pipeline.manifest import publish, read_listed, read_manifest
from pipeline.stages import StageResult
from pipeline.storage import ObjectStore, open_store

log = logging.getLogger(__name__)


class GateFailed(RuntimeError):
    """The candidate did not pass; the decision record is stored before this is raised."""


def decide(evaluation: dict[str, Any], gate: GateConfig) -> dict[str, Any]:
    checks = []
    for step, threshold in enumerate(gate.min_cond_acc):
        value = evaluation["cond_acc"][step] if step < len(evaluation["cond_acc"]) else 0.0
        checks.append(
            {
                "check": f"cond_acc_{step}",
                "value": value,
                "threshold": threshold,
                "passed": value >= threshold,
            }
        )
    tau = evaluation["tau_simulated"]
    checks.append(
        {
            "check": "tau_simulated",
            "value": tau,
            "threshold": gate.min_tau_simulated,
            "passed": tau >= gate.min_tau_simulated,
        }
    )
    incumbent = evaluation.get("incumbent")
    if incumbent and "tau_simulated" in incumbent:
        floor = incumbent["tau_simulated"] - gate.max_regression_vs_incumbent
        checks.append(
            {
                "check": "tau_simulated_vs_incumbent",
                "value": tau,
                "threshold": round(floor, 6),
                "passed": tau >= floor,
                "incumbent_version": incumbent.get("version"),
            }
        )
    reasons = [
        f"{c['check']} = {c['value']:.4f} {'>=' if c['passed'] else '<'} {c['threshold']:.4f}" for c in checks
    ]
    if incumbent and "skipped" in incumbent:
        reasons.append(f"incumbent not compared: {incumbent['skipped']}")
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "reasons": reasons}


def run(config: RunConfig, eval_uri: str, run_id: str, store: ObjectStore | None = None) -> StageResult:
    store = store or open_store(config.storage)
    eval_prefix = store.key_for(eval_uri)
    evaluation = json.loads(
        read_listed(store, eval_prefix, read_manifest(store, eval_prefix, kind="eval"), "eval.json")
    )
    decision = {"run_id": run_id, "thresholds": config.gate.model_dump(), **decide(evaluation, config.gate)}
    prefix = f"{layout.run_prefix(run_id)}/gate"
    info = store.put_bytes(f"{prefix}/gate.json", json.dumps(decision, indent=2).encode())
    manifest = publish(
        store,
        prefix,
        "gate",
        [info],
        {"run_id": run_id, "passed": decision["passed"], "reasons": decision["reasons"]},
    )
    for reason in decision["reasons"]:
        log.info("gate: %s", reason)
    if not decision["passed"]:
        reasons = "\n  ".join(decision["reasons"])
        raise GateFailed(f"gate failed for run {run_id}:\n  {reasons}")
    return StageResult(store.uri(prefix), manifest)
