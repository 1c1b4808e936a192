"""How `drafter run` ends when the gate or the benchmark stops it: the outcome in pipeline.promotion's words,
the exit code of the one table (pipeline.failures), and what to do when the benchmark could not tell."""

from __future__ import annotations

import pytest

from pipeline.benchmark_settings import BenchmarkConfig
from pipeline.failures import EXIT_GATE, EXIT_INCONCLUSIVE
from pipeline.promotion import (
    BenchmarkInconclusive,
    GateFailed,
    PromotionRefused,
    require_promotable,
    speed_rule,
)
from pipeline.records import BenchDecision, RatioInterval, RunSummary
from pipeline.run import RunResult, format_table, stop_summary
from tests.builders import bench_record, gate_record

SETTINGS = BenchmarkConfig(min_speedup_vs_baseline=1.0, budget_s=90)


def interval(ratio: float, low: float, high: float, rounds: int = 12) -> RatioInterval:
    return RatioInterval(ratio=ratio, ci_low=low, ci_high=high, confidence=0.95, rounds=rounds)


def summary(**fields) -> RunSummary:
    data = {"run_id": "r1", "target": "t", "samples": 96, "tokens": 9000, "cond_acc": [0.8]}
    return RunSummary.model_validate({**data, "stop_reason": "epochs", "report": "file:///r.html", **fields})


def stopped_by(decision: BenchDecision) -> PromotionRefused | BenchmarkInconclusive:
    """What the promote stage raises for a passed gate and a benchmark that decided `decision`."""
    with pytest.raises((PromotionRefused, BenchmarkInconclusive)) as stopped:
        require_promotable(gate_record(), bench_record(decision))
    return stopped.value


def ended(stop) -> tuple[RunSummary, int]:
    fields = stop_summary(stop)
    return summary(**fields), RunResult(summary(**fields), "file:///s.json", stop).exit_code()


def test_a_slower_candidate_is_refused_as_slower_with_the_rejections_exit_code():
    stop = stopped_by(speed_rule({"baseline": interval(0.8, 0.76, 0.84)}, SETTINGS))
    record, code = ended(stop)
    assert record.outcome == "refused: slower" and record.next_step is None
    assert record.failure is not None and record.failure.startswith("refused: slower: the benchmark does not")
    assert code == EXIT_GATE == 3
    assert "what to do" not in format_table(record)


def test_an_inconclusive_benchmark_ends_the_run_apart_and_says_what_to_do():
    unsure = speed_rule({"baseline": interval(1.503, 0.50, 4.52, rounds=3)}, SETTINGS)
    stop = stopped_by(unsure)
    assert isinstance(stop, BenchmarkInconclusive)
    record, code = ended(stop)
    assert record.outcome == "inconclusive, not promoted" and record.next_step == unsure.next_step
    assert unsure.next_step is not None
    assert "relative width 2.675 reached, 0.838 needed" in unsure.next_step
    assert "rerun on a quiet machine, or raise benchmark.budget_s (now 90 s)" in unsure.next_step
    assert code == EXIT_INCONCLUSIVE == 4
    rows = format_table(record).splitlines()
    assert any(row.split() == ["outcome", "inconclusive,", "not", "promoted"] for row in rows)
    assert [row.split(None, 3)[-1] for row in rows if row.startswith("what to do")] == [unsure.next_step]


def test_a_rejected_gate_ends_the_run_with_the_rejections_exit_code():
    record, code = ended(GateFailed("gate failed for run r1:\n  cond_acc_0 = 0.1 < 0.3", ["cond_acc_0"]))
    assert record.outcome == "gate rejected" and record.gate_passed is False and code == EXIT_GATE


def test_a_run_nothing_stopped_exits_0():
    assert RunResult(summary(outcome="promoted"), "file:///s.json").exit_code() == 0


def test_a_candidate_not_measurably_faster_at_the_benchmarks_precision_is_refused_and_says_so():
    """An interval as narrow as benchmark.ci_rel_width that still holds the threshold: more rounds would not
    tell, so it is a refusal, and the summary names why (not a bare "promotion refused")."""
    level = speed_rule({"baseline": interval(1.0, 0.99, 1.01, rounds=40)}, SETTINGS)
    assert level.verdict == "refused" and not level.undecided
    record, code = ended(stopped_by(level))
    assert record.outcome == "refused: not measurably faster" and code == EXIT_GATE
    rows = format_table(record).splitlines()
    assert any(row.split() == ["outcome", "refused:", "not", "measurably", "faster"] for row in rows)


def test_an_acceptance_that_differs_from_the_reference_decoders_is_refused_as_such():
    mismatch = BenchDecision(promotable=False, reasons=["acceptance in vllm: ..."], verdict="mismatch")
    record, code = ended(stopped_by(mismatch))
    assert record.outcome == "refused: acceptance differs from the reference decoder's" and code == EXIT_GATE
