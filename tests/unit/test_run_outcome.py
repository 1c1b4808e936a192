"""How `drafter run` ends when the benchmark stops it: "refused: slower" keeps the refusal's exit code,
"inconclusive, not promoted" has its own, and the summary says what to do."""

from __future__ import annotations

from pipeline.benchmark.settings import BenchmarkConfig
from pipeline.failures import EXIT_FAILED, EXIT_GATE, EXIT_INCONCLUSIVE
from pipeline.records import RatioInterval, RunSummary
from pipeline.run import exit_code, format_table, promote_stop
from pipeline.stages.benchmark import promotion_decision
from pipeline.stages.promote import BenchmarkInconclusive, PromotionRefused

SETTINGS = BenchmarkConfig(min_speedup_vs_baseline=1.0, budget_s=90)


def interval(ratio: float, low: float, high: float, rounds: int = 12) -> RatioInterval:
    return RatioInterval(ratio=ratio, ci_low=low, ci_high=high, confidence=0.95, rounds=rounds)


def summary(**fields) -> RunSummary:
    data = {"run_id": "r1", "target": "t", "samples": 96, "tokens": 9000, "cond_acc": [0.8]}
    return RunSummary.model_validate({**data, "stop_reason": "epochs", "report": "file:///r.html", **fields})


def test_a_slower_candidate_is_refused_as_slower_and_keeps_the_refusals_exit_code():
    slower = promotion_decision({"baseline": interval(0.8, 0.76, 0.84)}, SETTINGS)
    fields = promote_stop(PromotionRefused("the benchmark does not show the candidate faster: x"), slower)
    assert fields == {
        "outcome": "refused: slower",
        "failure": "the benchmark does not show the candidate faster: x",
    }
    assert exit_code(summary(**fields)) == EXIT_FAILED == 1
    assert "what to do" not in format_table(summary(**fields))


def test_an_inconclusive_benchmark_ends_the_run_apart_and_says_what_to_do():
    unsure = promotion_decision({"baseline": interval(1.503, 0.50, 4.52, rounds=3)}, SETTINGS)
    fields = promote_stop(BenchmarkInconclusive(unsure), unsure)
    assert fields["outcome"] == "inconclusive, not promoted"
    assert fields["next_step"] == unsure.next_step
    assert "relative width 2.675 reached, 0.838 needed" in fields["next_step"]
    assert "rerun on a quiet machine, or raise benchmark.budget_s (now 90 s)" in fields["next_step"]
    assert exit_code(summary(**fields)) == EXIT_INCONCLUSIVE == 4
    rows = format_table(summary(**fields)).splitlines()
    assert any(row.split() == ["outcome", "inconclusive,", "not", "promoted"] for row in rows)
    assert [row.split(None, 3)[-1] for row in rows if row.startswith("what to do")] == [unsure.next_step]


def test_the_other_outcomes_keep_their_exit_codes():
    assert exit_code(summary(outcome="promoted")) == 0
    assert exit_code(summary(outcome="not promoted (registry.promote is false)")) == 0
    assert exit_code(summary(outcome="gate failed")) == EXIT_GATE
    assert exit_code(summary(outcome="promotion refused")) == EXIT_FAILED


def test_a_candidate_not_measurably_faster_at_the_benchmarks_precision_is_refused_and_says_so():
    """An interval as narrow as benchmark.ci_rel_width that still holds the threshold: more rounds would not
    tell, so it is a refusal, and the summary names why (not a bare "promotion refused")."""
    level = promotion_decision({"baseline": interval(1.0, 0.99, 1.01, rounds=40)}, SETTINGS)
    assert level.verdict == "refused" and not level.undecided
    fields = promote_stop(PromotionRefused("the benchmark does not show the candidate faster: x"), level)
    assert fields == {
        "outcome": "refused: not measurably faster",
        "failure": "the benchmark does not show the candidate faster: x",
    }
    assert exit_code(summary(**fields)) == EXIT_FAILED == 1
    rows = format_table(summary(**fields)).splitlines()
    assert any(row.split() == ["outcome", "refused:", "not", "measurably", "faster"] for row in rows)
