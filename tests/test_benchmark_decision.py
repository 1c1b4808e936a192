"""The promotion rule reads the benchmark's intervals: a candidate is faster only when the lower bound of
its speedup clears the threshold."""

from __future__ import annotations

from pipeline.config import BenchmarkConfig
from pipeline.records import RatioInterval
from pipeline.spread import ratio_from_samples
from pipeline.stages.benchmark import interval, promotion_decision


def speedup(ratio: float, low: float, high: float) -> RatioInterval:
    return RatioInterval(ratio=ratio, ci_low=low, ci_high=high, confidence=0.95, rounds=12)


def test_a_point_above_the_threshold_is_not_enough_when_the_interval_reaches_below_it():
    settings = BenchmarkConfig(min_speedup_vs_baseline=1.0, min_speedup_vs_ngram=0.0)
    noisy = promotion_decision(
        {"baseline": speedup(1.2, 0.98, 1.42), "ngram": speedup(1.1, 0.9, 1.3)}, settings
    )
    assert not noisy.promotable
    assert (
        "candidate/baseline speed 1.200 (95% interval 0.980-1.420, 12 rounds): lower bound < required 1.0"
        in (noisy.reasons)
    )
    clear = promotion_decision(
        {"baseline": speedup(1.2, 1.05, 1.35), "ngram": speedup(1.1, 0.9, 1.3)}, settings
    )
    assert clear.promotable and len(clear.reasons) == 2


def test_the_incumbent_threshold_applies_when_an_incumbent_was_benchmarked():
    settings = BenchmarkConfig(min_speedup_vs_baseline=1.0, min_speedup_vs_incumbent=1.0)
    speedups = {
        "baseline": speedup(1.6, 1.5, 1.7),
        "ngram": speedup(1.2, 1.1, 1.3),
        "incumbent": speedup(1.01, 0.97, 1.05),
    }
    decision = promotion_decision(speedups, settings)
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
