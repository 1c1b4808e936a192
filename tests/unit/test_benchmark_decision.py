"""The promotion rule reads the benchmark's intervals: a candidate is faster only when the lower bound of
its speedup clears the threshold."""

from __future__ import annotations

import math

import pytest

from pipeline.benchmark.figures import interval
from pipeline.benchmark_settings import BenchmarkConfig
from pipeline.promotion import speed_rule
from pipeline.records import BenchDecision, RatioInterval
from pipeline.spread import ratio_from_samples


def speedup(ratio: float, low: float, high: float) -> RatioInterval:
    return RatioInterval(ratio=ratio, ci_low=low, ci_high=high, confidence=0.95, rounds=12)


def test_a_point_above_the_threshold_is_not_enough_when_the_interval_reaches_below_it():
    settings = BenchmarkConfig(min_speedup_vs_baseline=1.0, min_speedup_vs_ngram=0.0)
    noisy = speed_rule({"baseline": speedup(1.2, 0.98, 1.42), "ngram": speedup(1.1, 0.9, 1.3)}, settings)
    assert not noisy.promotable
    assert (
        "candidate/baseline speed 1.200 (95% interval 0.980-1.420, 12 rounds): lower bound < required 1.0"
        in (noisy.reasons)
    )
    clear = speed_rule({"baseline": speedup(1.2, 1.05, 1.35), "ngram": speedup(1.1, 0.9, 1.3)}, settings)
    assert clear.promotable and len(clear.reasons) == 2


def test_the_incumbent_threshold_applies_when_an_incumbent_was_benchmarked():
    settings = BenchmarkConfig(min_speedup_vs_baseline=1.0, min_speedup_vs_incumbent=1.0)
    speedups = {
        "baseline": speedup(1.6, 1.5, 1.7),
        "ngram": speedup(1.2, 1.1, 1.3),
        "incumbent": speedup(1.01, 0.97, 1.05),
    }
    decision = speed_rule(speedups, settings)
    assert not decision.promotable
    assert [reason.split(" ")[0] for reason in decision.reasons] == [
        "candidate/baseline",
        "candidate/ngram",
        "candidate/incumbent",
    ]


def test_paired_rounds_give_the_recorded_interval():
    candidate, baseline = [30.0, 33.0, 29.0, 31.0], [20.0, 21.0, 19.5, 20.5]
    recorded = interval(ratio_from_samples(candidate, baseline, 0.95))
    assert recorded.ci_low < recorded.ratio < recorded.ci_high and recorded.rounds == 4
    assert 1.4 < recorded.ratio < 1.6


def test_the_candidate_is_compared_with_ngram_at_its_fastest_setting():
    from pipeline.benchmark.figures import paired_speedups
    from pipeline.benchmark.sglang import ngram_method_name, sglang_methods
    from pipeline.benchmark_settings import NgramServerSetting

    def measured(rounds: list[float], tau: float | None = None) -> dict:
        figures = {"tokens": 120, "seconds": 1.0, "tok_s": sum(rounds) / len(rounds), "round_tok_s": rounds}
        return figures | ({"tau_measured": tau} if tau else {})

    chain = NgramServerSetting(draft_tokens=4, max_bfs_breadth=1)
    wide = NgramServerSetting(draft_tokens=12, max_bfs_breadth=10)
    methods, sweep = sglang_methods(
        {
            "baseline": measured([80.0, 84.0, 82.0]),
            ngram_method_name(chain): measured([90.0, 95.0, 92.0], tau=1.6),  # the fastest n-gram
            ngram_method_name(wide): measured([41.0, 40.0, 42.0], tau=2.4),  # tree verification dominates
            "candidate": measured([93.0, 94.0, 95.0], tau=3.1),
        },
        [chain, wide],
    )
    assert sweep.best == chain.label and [entry.setting for entry in sweep.settings] == [
        chain.label,
        wide.label,
    ]
    assert methods.ngram.round_tok_s == [90.0, 95.0, 92.0]
    speedups = paired_speedups(methods, 0.95)
    assert speedups["ngram"] == interval(ratio_from_samples([93.0, 94.0, 95.0], [90.0, 95.0, 92.0], 0.95))
    # more than twice the wide tree's speed, but not clearly faster than n-gram at its best: not promotable
    decision = speed_rule(speedups, BenchmarkConfig(min_speedup_vs_baseline=1.0, min_speedup_vs_ngram=1.0))
    assert not decision.promotable
    assert any(
        reason.startswith("candidate/ngram") and "< required 1.0" in reason for reason in decision.reasons
    )


def test_the_rule_names_the_batch_sizes_it_must_win_at():
    settings = BenchmarkConfig(batch_sizes=[1, 4, 8], promote_at_batch_sizes=[1, 4])
    fast = {"baseline": speedup(1.5, 1.4, 1.6), "ngram": speedup(1.2, 1.1, 1.3)}
    slower_at_4 = {"baseline": speedup(1.05, 0.97, 1.12), "ngram": speedup(0.9, 0.85, 0.95)}
    decision = speed_rule(fast, settings, {4: slower_at_4, 8: slower_at_4})
    # faster at batch 1 but not clearly at batch 4: refused, and the reason names batch 4
    assert not decision.promotable
    assert (
        "candidate/baseline speed at batch 4 1.050 (95% interval 0.970-1.120, 12 rounds): lower bound < "
        "required 1.0" in decision.reasons
    )
    # batch 8 is measured and reported but not gated
    assert not any("batch 8" in reason for reason in decision.reasons)
    assert speed_rule(fast, settings, {4: fast, 8: slower_at_4}).promotable


def test_a_batch_size_the_rule_needs_but_nothing_measured_refuses():
    settings = BenchmarkConfig(batch_sizes=[4], promote_at_batch_sizes=[1, 4])
    fast = {"baseline": speedup(1.5, 1.4, 1.6)}
    decision = speed_rule(fast, settings, {})
    assert not decision.promotable
    assert "candidate speed at batch 4: not measured, and benchmark.promote_at_batch_sizes needs it" in (
        decision.reasons
    )


def test_the_sglang_headline_is_at_its_concurrency_and_the_levels_beside_it():
    settings = BenchmarkConfig.model_validate(
        {
            "engine": "sglang",
            "batch_sizes": [1, 16],
            "promote_at_batch_sizes": [1, 8],
            "sglang": {"launch": ["x"], "model_path": "/m", "concurrency": 8, "max_running_requests": 16},
        }
    )
    assert settings.headline_batch_size() == 8 and settings.measured_batch_sizes() == [1, 8, 16]
    fast = {"baseline": speedup(1.5, 1.4, 1.6)}
    slow = {"baseline": speedup(0.9, 0.8, 1.0)}
    decision = speed_rule(fast, settings, {1: slow, 16: slow})
    assert not decision.promotable
    assert [r.split(" (")[0] for r in decision.reasons] == [
        "candidate/baseline speed at batch 1 0.900",
        "candidate/baseline speed at batch 8 1.500",
    ]


def test_a_candidate_measurably_slower_than_the_incumbent_never_promotes_whatever_the_threshold():
    # a lenient threshold (0.85, for a shared machine) lets an even candidate through, never a slower one
    settings = BenchmarkConfig(min_speedup_vs_baseline=1.0, min_speedup_vs_incumbent=0.85)
    base = {"baseline": speedup(1.6, 1.5, 1.7)}
    even = speed_rule({**base, "incumbent": speedup(0.97, 0.9, 1.04)}, settings)
    assert even.promotable
    slower = speed_rule({**base, "incumbent": speedup(0.93, 0.88, 0.98)}, settings)
    assert not slower.promotable
    assert slower.reasons[-1].endswith(
        "lower bound >= required 0.85; upper bound < 1: measurably slower than the incumbent, never promoted"
    )
    # an upper bound under 1 against baseline or n-gram is for their thresholds alone
    lenient = BenchmarkConfig(min_speedup_vs_baseline=0.5, min_speedup_vs_incumbent=0.0)
    assert speed_rule({"baseline": speedup(0.9, 0.85, 0.95)}, lenient).promotable


def test_an_interval_too_wide_to_decide_is_inconclusive_with_the_width_it_reached_and_needed():
    # issue 41: a busy machine, the budget spent after 3 rounds, candidate/baseline 0.50-4.52
    settings = BenchmarkConfig(min_speedup_vs_baseline=1.0, min_speedup_vs_ngram=0.0, budget_s=90)
    wide = RatioInterval(ratio=1.503, ci_low=0.50, ci_high=4.52, confidence=0.95, rounds=3)
    decision = speed_rule({"baseline": wide, "ngram": speedup(1.1, 0.9, 1.3)}, settings)
    assert not decision.promotable and decision.verdict == "inconclusive"
    [undecided] = decision.undecided
    assert (undecided.comparison, undecided.method, undecided.required) == (
        "candidate/baseline",
        "baseline",
        1.0,
    )
    assert undecided.width_reached == pytest.approx((4.52 - 0.50) / 1.503)
    # the rule promotes once the lower bound clears 1.0: an interval ratio*e^(+-h) decides for h < ln(1.503)
    assert undecided.width_needed == pytest.approx(1.503 - 1 / 1.503)
    assert "rerun on a quiet machine" in decision.next_step
    assert "raise benchmark.budget_s (now 90 s)" in decision.next_step
    assert "candidate/baseline: relative width 2.675 reached, 0.838 needed" in decision.next_step
    # the reasons stay the rule's own, one per comparison
    assert [reason.split(" ")[0] for reason in decision.reasons] == ["candidate/baseline", "candidate/ngram"]


@pytest.mark.parametrize("ratio, required", [(1.503, 1.0), (0.7, 1.0), (1.05, 1.2), (0.93, 0.85)])
def test_the_width_needed_is_where_the_promotion_rule_starts_to_decide(ratio, required):
    settings = BenchmarkConfig(min_speedup_vs_baseline=0.0, min_speedup_vs_incumbent=required)

    def around(width: float) -> RatioInterval:
        half = math.asinh(width / 2)  # pipeline.spread's intervals: ratio*e^(+-h), relative width 2 sinh(h)
        return RatioInterval(
            ratio=ratio,
            ci_low=ratio * math.exp(-half),
            ci_high=ratio * math.exp(half),
            confidence=0.95,
            rounds=5,
        )

    base = {"baseline": speedup(1.6, 1.5, 1.7)}
    [undecided] = speed_rule({**base, "incumbent": around(5.0)}, settings).undecided
    needed = undecided.width_needed
    assert needed > 0
    assert speed_rule({**base, "incumbent": around(needed * 0.999)}, settings).verdict != "inconclusive"
    assert speed_rule({**base, "incumbent": around(needed * 1.001)}, settings).verdict == "inconclusive"


def test_a_narrow_interval_below_the_threshold_is_refused_as_slower():
    settings = BenchmarkConfig(min_speedup_vs_baseline=1.0)
    decision = speed_rule({"baseline": speedup(0.8, 0.76, 0.84), "ngram": speedup(1.1, 1.0, 1.2)}, settings)
    assert not decision.promotable and decision.verdict == "slower"
    assert decision.undecided == [] and decision.next_step is None
    # slower somewhere decides, however wide another interval is
    also_wide = {"baseline": speedup(0.8, 0.76, 0.84), "incumbent": speedup(1.2, 0.5, 2.9)}
    assert speed_rule(also_wide, settings).verdict == "slower"


def test_a_narrow_interval_above_the_threshold_is_promotable():
    settings = BenchmarkConfig(min_speedup_vs_baseline=1.0)
    decision = speed_rule({"baseline": speedup(1.5, 1.45, 1.55), "ngram": speedup(1.2, 1.1, 1.3)}, settings)
    assert decision.promotable and decision.verdict == "faster"
    assert decision.undecided == [] and decision.next_step is None


def test_an_interval_as_narrow_as_the_benchmark_aims_that_holds_the_threshold_is_a_refusal():
    # measured to benchmark.ci_rel_width and still on the threshold: not faster; no more rounds are asked for
    settings = BenchmarkConfig(min_speedup_vs_baseline=1.0, ci_rel_width=0.1)
    decision = speed_rule({"baseline": speedup(1.0, 0.97, 1.03)}, settings)
    assert not decision.promotable and decision.verdict == "refused" and decision.next_step is None


@pytest.mark.parametrize(
    "engine, knob",
    [
        (
            {
                "engine": "sglang",
                "sglang": {"launch": ["x"], "model_path": "/m", "rounds": 6, "max_running_requests": 8},
            },
            "benchmark.sglang.rounds (now 6)",
        ),
        ({"engine": "vllm", "repeats": 4, "vllm": {"engines_at_once": False}}, "benchmark.repeats (now 4"),
        ({"engine": "vllm", "budget_s": 300}, "benchmark.budget_s (now 300 s)"),
    ],
)
def test_an_inconclusive_benchmark_names_what_would_measure_more_on_its_engine(engine, knob):
    settings = BenchmarkConfig.model_validate({"min_speedup_vs_baseline": 1.0, **engine})
    decision = speed_rule({"baseline": speedup(1.2, 0.7, 2.0)}, settings)
    assert decision.verdict == "inconclusive" and knob in decision.next_step


def test_a_decision_recorded_before_verdicts_reads_as_its_outcome():
    assert BenchDecision(promotable=True, reasons=[]).verdict == "faster"
    assert BenchDecision.model_validate({"promotable": False, "reasons": ["x"]}).verdict == "refused"
