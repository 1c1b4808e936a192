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

    def __init__(self, message: str, reasons: list[str]):
        super().__init__(message)
        self.reasons = reasons


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
        # no tolerance: the same held-out anchors score both, and a candidate behind never promotes
        checks.append(
            GateCheck(
                check="tau_simulated_vs_incumbent",
                value=tau,
                threshold=round(incumbent.tau_simulated, 6),
                passed=tau >= incumbent.tau_simulated,
                incumbent_version=incumbent.version,
            )
        )
    if isinstance(incumbent, IncumbentEval) and gate.max_domain_regression_vs_incumbent is not None:
        checks += domain_checks(evaluation, incumbent, gate.max_domain_regression_vs_incumbent)
    reasons = [f"{c.check} = {c.value:.4f} {'>=' if c.passed else '<'} {c.threshold:.4f}" for c in checks]
    if isinstance(incumbent, IncumbentEval):
        reasons.append(standing_vs_incumbent(evaluation, incumbent))
    if isinstance(incumbent, IncumbentSkipped):
        reasons.append(f"incumbent not compared: {incumbent.skipped}")
    return GateRecord(
        run_id=run_id,
        thresholds=gate,
        passed=all(c.passed for c in checks),
        checks=checks,
        reasons=reasons,
        init=evaluation.init,
    )


def standing_vs_incumbent(evaluation: EvalRecord, incumbent: IncumbentEval) -> str:
    """By how much the candidate is ahead of or behind the incumbent, pooled and on each shared domain."""
    ours, theirs = evaluation.domains, incumbent.domains
    per_domain = ", ".join(
        f"{domain} {signed(ours[domain].tau_simulated - theirs[domain].tau_simulated)}"
        for domain in sorted(set(ours) & set(theirs))
    )
    where = f" (per domain: {per_domain})" if per_domain else ""
    return (
        f"against incumbent {incumbent.version}: tau_simulated {evaluation.tau_simulated:.3f} vs "
        f"{incumbent.tau_simulated:.3f}, {signed(evaluation.tau_simulated - incumbent.tau_simulated)}{where}"
    )


def signed(delta: float) -> str:
    """A difference in tau as a person reads it: ahead by, behind by, or level."""
    if delta == 0:
        return "level"
    return f"{'ahead' if delta > 0 else 'behind'} by {abs(delta):.4f}"


def domain_checks(evaluation: EvalRecord, incumbent: IncumbentEval, margin: float) -> list[GateCheck]:
    """tau_simulated per held-out domain against the incumbent's on that domain, at most `margin` below: a
    candidate better on average but worse on one domain fails, the check naming the domain. Domains the
    incumbent was not evaluated on have nothing to compare with."""
    checks = []
    for domain, metrics in sorted(evaluation.domains.items()):
        theirs = incumbent.domains.get(domain)
        if theirs is None:
            continue
        floor = theirs.tau_simulated - margin
        checks.append(
            GateCheck(
                check=f"tau_simulated_vs_incumbent[{domain}]",
                value=metrics.tau_simulated,
                threshold=round(floor, 6),
                passed=metrics.tau_simulated >= floor,
                incumbent_version=incumbent.version,
            )
        )
    return checks


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
        raise GateFailed(f"gate failed for run {run_id}:\n  {reasons}", decision.reasons)
    return Output(uri=store.uri(prefix), kind=manifest["kind"], passed=True, reasons=decision.reasons)
