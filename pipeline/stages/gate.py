"""gate: evaluation + thresholds -> a decision record with every reason (the quality half of the promotion
rule, pipeline.promotion.gate_record); a failed gate stops the run."""

from __future__ import annotations

import logging

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.promotion import GateFailed, gate_record
from pipeline.records import EvalRecord, publish_record, read_record
from pipeline.stages import StageInputs, StageOutput
from pipeline.storage import ObjectStore

log = logging.getLogger(__name__)


class Inputs(StageInputs):
    eval_uri: str


class Output(StageOutput):
    passed: bool
    reasons: list[str]


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    decision = gate_record(read_record(store, inputs.eval_uri, EvalRecord), config.gate, run_id)
    prefix = layout.run_stage_prefix(run_id, "gate")
    manifest = publish_record(
        store, prefix, decision, {"run_id": run_id, "passed": decision.passed, "reasons": decision.reasons}
    )
    for reason in decision.reasons:
        log.info("gate: %s", reason)
    if not decision.passed:
        reasons = "\n  ".join(decision.reasons)
        raise GateFailed(f"gate failed for run {run_id}:\n  {reasons}", decision.reasons)
    return Output(uri=store.uri(prefix), kind=manifest["kind"], passed=True, reasons=decision.reasons)
