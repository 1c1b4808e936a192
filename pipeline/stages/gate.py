"""gate: evaluation + thresholds -> a decision record with every reason; a failed gate stops the run."""

from __future__ import annotations

import logging

from pipeline import layout
from pipeline.config import GateConfig, RunConfig
from pipeline.records import (
    EvalRecord,
    GateCheck,
    GateRecord,
    IncumbentEval,
    IncumbentSkipped,
    publish_record,
    read_record,
)
from pipeline.stages import StageInputs, StageOutput
from pipeline.storage import ObjectStore

log = logging.getLogger(__name__)


class Inputs(StageInputs):
    eval_uri: str


class Output(StageOutput):
    passed: bool
    reasons: list[str]


class GateFailed(RuntimeError):
    """The candidate did not pass; the decision record is stored before this is raised."""


def decide(evaluation: EvalRecord, gate: GateConfig, run_id: str) -> GateRecord:
    checks = []
    for step, threshold in enumerate(gate.min_cond_acc):
        value = evaluation.cond_acc[step] if step < len(evaluation.cond_acc) else 0.0
        checks.append(
            GateCheck(check=f"cond_acc_{step}", value=value, threshold=threshold, passed=value >= threshold)
        )
    tau = evaluation.tau_simulated
    checks.append(
        GateCheck(
            check="tau_simulated",
            value=tau,
            threshold=gate.min_tau_simulated,
            passed=tau >= gate.min_tau_simulated,
        )
    )
    incumbent = evaluation.incumbent
    if isinstance(incumbent, IncumbentEval):
        floor = incumbent.tau_simulated - gate.max_regression_vs_incumbent
        checks.append(
            GateCheck(
                check="tau_simulated_vs_incumbent",
                value=tau,
                threshold=round(floor, 6),
                passed=tau >= floor,
                incumbent_version=incumbent.version,
            )
        )
    reasons = [f"{c.check} = {c.value:.4f} {'>=' if c.passed else '<'} {c.threshold:.4f}" for c in checks]
    if isinstance(incumbent, IncumbentSkipped):
        reasons.append(f"incumbent not compared: {incumbent.skipped}")
    return GateRecord(
        run_id=run_id,
        thresholds=gate,
        passed=all(c.passed for c in checks),
        checks=checks,
        reasons=reasons,
    )


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    decision = decide(read_record(store, inputs.eval_uri, EvalRecord), config.gate, run_id)
    prefix = layout.run_stage_prefix(run_id, "gate")
    manifest = publish_record(
        store, prefix, decision, {"run_id": run_id, "passed": decision.passed, "reasons": decision.reasons}
    )
    for reason in decision.reasons:
        log.info("gate: %s", reason)
    if not decision.passed:
        reasons = "\n  ".join(decision.reasons)
        raise GateFailed(f"gate failed for run {run_id}:\n  {reasons}")
    return Output(uri=store.uri(prefix), kind=manifest["kind"], passed=True, reasons=decision.reasons)
