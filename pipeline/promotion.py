"""The promotion rule, in one place: what a candidate must show to be promoted, and the words every report of
it uses.

- Quality (`gate_record`, the gate stage): the evaluation's acceptance against the gate's thresholds, and
  against the incumbent's when one was evaluated.
- Speed (`speed_decision`, the benchmark stage): the speedup intervals of the engine the drafter will be
  served with (benchmark.engine), each interval's lower bound against its benchmark.min_speedup_*, at every
  batch size benchmark.promote_at_batch_sizes names; and, with the reference decoder beside that engine
  (benchmark.reference_beside), the engine's acceptance against the reference decoder's.

Each half is computed once, by its stage, and stored in its record (gate.json, bench.json). The promote stage
(`require_promotable`), `drafter run`'s summary, the report and `drafter status` read the stored decisions and
say them in the words of OUTCOMES (`outcome`). Which exit code each stop gives: pipeline.failures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pipeline.benchmark_settings import BenchmarkConfig, VllmBenchConfig
from pipeline.config import GateConfig
from pipeline.records import (
    AcceptanceCheck,
    BenchDecision,
    BenchRecord,
    BenchVerdict,
    EngineBench,
    EvalRecord,
    GateCheck,
    GateRecord,
    IncumbentEval,
    IncumbentSkipped,
    PromoteRecord,
    RatioInterval,
    UndecidedSpeedup,
)

# How a run ends, in the words `drafter run`'s summary, the report and `drafter status` print. The benchmark's
# verdicts (BenchDecision.verdict) other than "faster" stop a run with their own words. "refused": an interval
# as narrow as the benchmark aims for (benchmark.ci_rel_width) still holds the required speedup, so more
# rounds would not tell either.
BENCH_OUTCOMES: dict[str, str] = {
    "slower": "refused: slower",
    "refused": "refused: not measurably faster",
    "mismatch": "refused: acceptance differs from the reference decoder's",
    "inconclusive": "inconclusive, not promoted",
}
OUTCOMES: dict[str, str] = {
    "promoted": "promoted",
    "not_promoting": "not promoted (registry.promote is false)",
    "gate": "gate rejected",
    **BENCH_OUTCOMES,
}


class PromotionRefused(RuntimeError):
    """The rule refuses the candidate: the gate did not pass, or the benchmark did not show it faster (its
    `verdict`: slower, not measurably faster, or an acceptance that differs from the reference decoder's)."""

    def __init__(self, message: str, verdict: str | None = None):
        super().__init__(message)
        self.verdict = verdict


class BenchmarkInconclusive(RuntimeError):
    """The benchmark could not tell whether the candidate is faster (its intervals stayed too wide): nothing
    is promoted. Not a PromotionRefused: the candidate was not shown slower, and a rerun on a quieter
    machine or with a larger budget can decide (`next_step`)."""

    def __init__(self, decision: BenchDecision):
        super().__init__(
            f"{BENCH_OUTCOMES['inconclusive']}: the benchmark could not tell whether the candidate is "
            f"faster; {decision.next_step} (decision: {'; '.join(decision.reasons)})"
        )
        self.decision = decision
        self.next_step = decision.next_step or ""

    def outcome(self) -> dict[str, Any]:
        """What a scheduler's promote task returns instead of failing (pipeline.tasks.promotion_outcome)."""
        return {
            "outcome": BENCH_OUTCOMES["inconclusive"],
            "reason": str(self),
            "next_step": self.next_step,
            "undecided": [entry.model_dump(mode="json") for entry in self.decision.undecided],
        }


# ---------------------------------------------------------------- quality


class GateFailed(RuntimeError):
    """The candidate did not pass; the decision record is stored before this is raised."""

    def __init__(self, message: str, reasons: list[str]):
        super().__init__(message)
        self.reasons = reasons


def gate_record(evaluation: EvalRecord, gate: GateConfig, run_id: str) -> GateRecord:
    """The quality half of the rule: the evaluation's acceptance against the gate's thresholds and, when an
    incumbent was evaluated, against its acceptance (pooled, with no tolerance, and per domain)."""
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


# ---------------------------------------------------------------- speed


SLOWER_THAN_INCUMBENT = "; upper bound < 1: measurably slower than the incumbent, never promoted"


Compared = Literal["faster", "slower", "undecided"]


def compared(ci_low: float, ci_high: float, required: float, incumbent: bool) -> Compared:
    """What one speedup interval decides by the promotion rule: faster when its lower bound clears
    `required` (against the incumbent, also not wholly under 1); slower when its upper bound is under
    `required`, or under 1 against the incumbent; undecided while it holds the threshold."""
    if incumbent and ci_high < 1.0:
        return "slower"
    if ci_low >= required:
        return "faster"
    return "slower" if ci_high < required else "undecided"


def width_to_decide(ratio: float, required: float, incumbent: bool) -> float:
    """The widest relative interval around `ratio` on which the promotion rule (`compared`) decides.
    pipeline.spread's intervals lie at ratio * e^(+-h), of relative width 2 sinh(h): the rule decides once
    the interval no longer reaches a threshold it held, so the candidates for h are the distances from the
    ratio to each threshold (`required`, and 1 against the incumbent), the widest that decides wins.
    0 when the ratio sits on a threshold (no interval decides)."""
    thresholds = {required, 1.0} if incumbent else {required}
    for distance in sorted((abs(math.log(ratio / t)) for t in thresholds if t > 0), reverse=True):
        half = distance * (1 - 1e-9)  # just inside: the bound no longer touches the threshold
        if compared(ratio * math.exp(-half), ratio * math.exp(half), required, incumbent) != "undecided":
            return 2 * math.sinh(half)
    return 0.0


def undecided_speedup(
    comparison: str, method: str, batch: int, speedup: RatioInterval, required: float
) -> UndecidedSpeedup:
    """The record of an interval too wide to decide: where it was measured, the interval, the threshold it
    holds, and its relative width reached and needed."""
    return UndecidedSpeedup(
        **speedup.model_dump(include={"ratio", "ci_low", "ci_high", "rounds"}),
        comparison=comparison,
        method=method,
        batch_size=batch,
        required=required,
        width_reached=(speedup.ci_high - speedup.ci_low) / speedup.ratio,
        width_needed=width_to_decide(speedup.ratio, required, method == "incumbent"),
    )


def more_measurement(settings: BenchmarkConfig) -> str:
    """How this engine's benchmark measures more rounds (and so narrower intervals) on a rerun."""
    if settings.engine == "sglang" and settings.sglang is not None:
        return (
            f"rerun while its servers serve nothing else, or raise benchmark.sglang.rounds (now "
            f"{settings.sglang.rounds}) and benchmark.num_prompts to fill them"
        )
    if settings.engine == "vllm" and not (settings.vllm or VllmBenchConfig()).engines_at_once:
        return (
            f"rerun on a quiet machine, or raise benchmark.repeats (now {settings.repeats}; each engine "
            "runs max(3, repeats) passes)"
        )
    return f"rerun on a quiet machine, or raise benchmark.budget_s (now {settings.budget_s:g} s)"


def next_step(settings: BenchmarkConfig, undecided: list[UndecidedSpeedup]) -> str:
    """What to do about an inconclusive benchmark: the widths it reached and needed, and how to measure
    more. An interval narrows about as 1/sqrt(rounds) at the same noise."""
    widths = "; ".join(
        f"{entry.comparison}: relative width {entry.width_reached:.3f} reached, "
        f"{entry.width_needed:.3f} needed"
        for entry in undecided
    )
    return f"the speedup intervals stayed too wide to decide ({widths}): {more_measurement(settings)}"


def speedup_reason(name: str, speedup: RatioInterval, required: float, against_incumbent: bool) -> str:
    """One reason of the promotion decision: the interval, and whether its lower bound clears `required`."""
    ok = speedup.ci_low >= required
    behind = against_incumbent and speedup.ci_high < 1.0
    return (
        f"{name} {speedup.ratio:.3f} ({speedup.confidence:.0%} interval {speedup.ci_low:.3f}-"
        f"{speedup.ci_high:.3f}, {speedup.rounds} rounds): lower bound {'>=' if ok else '<'} "
        f"required {required}" + (SLOWER_THAN_INCUMBENT if behind else "")
    )


def speed_rule(
    speedups: dict[str, RatioInterval],
    settings: BenchmarkConfig,
    batches: Mapping[int, dict[str, RatioInterval]] | None = None,
) -> BenchDecision:
    """Promotable when the LOWER bound of every speedup's interval clears its threshold, at every batch size
    benchmark.promote_at_batch_sizes names: a candidate is faster only when the noise of the measurement
    cannot explain it. Whatever min_speedup_vs_incumbent allows, a candidate measurably slower than the
    incumbent (the interval's UPPER bound below 1) never promotes. `speedups` are the headline batch
    size's, `batches` the other measured sizes'.

    The verdict tells a slower candidate from one the benchmark could not judge: slower when an interval
    lies under its threshold; inconclusive when none does but some still holds its threshold while wider
    than benchmark.ci_rel_width (the budget ran out first: the record keeps the widths reached and needed,
    and `next_step` says how to rerun); an interval that reached benchmark.ci_rel_width and still holds its
    threshold is not measurably faster, a refusal."""
    required = {
        "baseline": settings.min_speedup_vs_baseline,
        "ngram": settings.min_speedup_vs_ngram,
        "incumbent": settings.min_speedup_vs_incumbent,
    }
    measured = {settings.headline_batch_size(): speedups, **(batches or {})}
    gated = settings.gated_batch_sizes()
    named = gated != [settings.headline_batch_size()]
    reasons: list[str] = []
    seen: set[str] = set()
    undecided: list[UndecidedSpeedup] = []
    for batch in gated:
        at = f" at batch {batch}" if named else ""
        if batch not in measured:
            seen.add("refused")
            reasons.append(
                f"candidate speed{at}: not measured, and benchmark.promote_at_batch_sizes needs it"
            )
            continue
        for other, speedup in measured[batch].items():
            against_incumbent = other == "incumbent"
            reasons.append(
                speedup_reason(f"candidate/{other} speed{at}", speedup, required[other], against_incumbent)
            )
            outcome = compared(speedup.ci_low, speedup.ci_high, required[other], against_incumbent)
            if outcome != "undecided":
                seen.add(outcome)
                continue
            entry = undecided_speedup(f"candidate/{other}{at}", other, batch, speedup, required[other])
            # wider than the benchmark aims for: its budget ran out first; as narrow: not measurably faster
            too_wide = entry.width_reached > settings.ci_rel_width
            seen.add("inconclusive" if too_wide else "refused")
            undecided += [entry] if too_wide else []
    verdict: BenchVerdict = next((v for v in ("slower", "refused", "inconclusive") if v in seen), "faster")
    inconclusive = verdict == "inconclusive"
    return BenchDecision(
        promotable=verdict == "faster",
        reasons=reasons,
        verdict=verdict,
        undecided=undecided if inconclusive else [],
        next_step=next_step(settings, undecided) if inconclusive else None,
    )


def speed_decision(figures: EngineBench, settings: BenchmarkConfig) -> BenchDecision:
    """The speed half of the rule, on the figures of the engine that decides (`figures.engine`, the serving
    engine: benchmark.engine): `speed_rule` over its headline speedups and every batch size it measured, then
    its acceptance against the reference decoder's when that was checked (`figures.acceptance`): a
    difference past benchmark.acceptance_tolerance refuses the candidate whatever its speed (verdict
    "mismatch"). The first reason names the engine that decided."""
    decision = speed_rule(
        figures.speedups, settings, {batch.batch_size: batch.speedups for batch in figures.batches}
    )
    reasons = [f"speed decided by {deciding_engine(figures)}", *decision.reasons]
    check = figures.acceptance
    if check is None:
        return decision.model_copy(update={"reasons": reasons})
    reasons.append(acceptance_reason(check))
    if check.passed:
        return decision.model_copy(update={"reasons": reasons})
    return BenchDecision(promotable=False, reasons=reasons, verdict="mismatch")


def deciding_engine(figures: EngineBench) -> str:
    """The engine whose figures decided, as a person reads it: "vllm 0.32.0", "the reference decoder"."""
    if figures.engine == "reference":
        return "the reference decoder"
    return " ".join(filter(None, (figures.engine, figures.engine_version)))


def acceptance_reason(check: AcceptanceCheck) -> str:
    """The acceptance check as one reason of the decision."""
    within = "<=" if check.passed else ">"
    consequence = "" if check.passed else ": the engine serves other drafts than the ones judged"
    return (
        f"acceptance in {check.engine}: tau {check.tau:.3f} against the reference decoder's "
        f"{check.reference_tau:.3f} (chain of {check.draft_steps}, counted as {check.engine} counts): "
        f"relative difference {check.rel_diff:.4f} {within} benchmark.acceptance_tolerance "
        f"{check.tolerance}{consequence}"
    )


# ---------------------------------------------------------------- the stages' use of it


def require_passed(gate: GateRecord) -> None:
    """PromotionRefused unless the stored gate passed (a run the gate stopped has no benchmark to read)."""
    if not gate.passed:
        raise PromotionRefused("the gate did not pass: " + "; ".join(gate.reasons))


def require_promotable(gate: GateRecord, bench: BenchRecord) -> None:
    """PromotionRefused unless the stored gate passed and the stored benchmark decision is promotable;
    BenchmarkInconclusive when the benchmark could not tell."""
    require_passed(gate)
    decision = bench.decision
    if decision.verdict == "inconclusive":
        raise BenchmarkInconclusive(decision)
    if not decision.promotable:
        raise PromotionRefused(
            f"{BENCH_OUTCOMES.get(decision.verdict, 'refused')}: the benchmark does not show the candidate "
            "faster: " + "; ".join(decision.reasons),
            decision.verdict,
        )


def outcome(gate: GateRecord | None, bench: BenchRecord | None, promote: PromoteRecord | None) -> str | None:
    """How the rule ended a run, from its stored records (None: it has not decided yet)."""
    if promote is not None:
        return OUTCOMES["promoted"] if promote.promoted else OUTCOMES["not_promoting"]
    if gate is not None and not gate.passed:
        return OUTCOMES["gate"]
    if bench is not None and not bench.decision.promotable:
        return BENCH_OUTCOMES.get(bench.decision.verdict, BENCH_OUTCOMES["refused"])
    return None


def stop_outcome(stop: GateFailed | PromotionRefused | BenchmarkInconclusive) -> str:
    """The outcome of a run its gate or promote stage stopped, in OUTCOMES' words."""
    if isinstance(stop, GateFailed):
        return OUTCOMES["gate"]
    if isinstance(stop, BenchmarkInconclusive):
        return BENCH_OUTCOMES["inconclusive"]
    return BENCH_OUTCOMES.get(stop.verdict or "", OUTCOMES["gate"])
