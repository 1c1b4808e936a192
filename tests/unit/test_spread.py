"""Interleaved timings state their spread: intervals cover known ratios, even on a drifting machine."""

import math
import random
from collections.abc import Callable

import pytest

from pipeline.spread import RatioEstimate, measure, ratio_from_samples, t_quantile, timed


def noisy(rng: random.Random, scale: float, sigma: float) -> Callable[[], float]:
    return lambda: scale * rng.lognormvariate(0.0, sigma)


@pytest.mark.parametrize(
    ("df", "p", "expected"),
    [(1, 0.975, 12.7062), (2, 0.975, 4.3027), (4, 0.975, 2.7764), (9, 0.975, 2.2622), (29, 0.975, 2.0452)]
    + [(3, 0.995, 5.8409), (1000, 0.975, 1.9623), (5, 0.05, -2.0150)],
)
def test_t_quantiles_match_tables(df: int, p: float, expected: float) -> None:
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-4)


def test_ratio_from_paired_samples_uses_logs_and_t() -> None:
    est = ratio_from_samples([2.0, 4.0], [1.0, 1.0])
    assert est.ratio == pytest.approx(2**1.5)
    half = t_quantile(0.975, 1) * (math.log(2) / math.sqrt(2)) / math.sqrt(2)
    assert est.ci_low == pytest.approx(2**1.5 * math.exp(-half))
    assert est.ci_high == pytest.approx(2**1.5 * math.exp(half))
    assert (est.rounds, est.confidence) == (2, 0.95)


def test_estimate_prints_benchmark_lines_and_json_form() -> None:
    est = RatioEstimate(ratio=2.0, ci_low=1.8765, ci_high=2.12345, confidence=0.95, rounds=7)
    assert est.lines("speedup") == ["speedup=2.0000", "speedup_ci_low=1.8765", "speedup_ci_high=2.1235"]
    assert est.as_dict() == {
        "ratio": 2.0,
        "ci_low": 1.8765,
        "ci_high": 2.12345,
        "confidence": 0.95,
        "rounds": 7,
    }


def test_known_ratios_among_four_sides_are_covered_and_narrow_enough() -> None:
    rng = random.Random(1)
    sides = {
        "baseline": noisy(rng, 1.0, 0.05),
        "ngram": noisy(rng, 1.5, 0.05),
        "incumbent": noisy(rng, 2.0, 0.05),
        "candidate": noisy(rng, 2.5, 0.05),
    }
    watched = [("candidate", "baseline"), ("candidate", "incumbent"), ("ngram", "baseline")]
    m = measure(sides, watched, rel_width=0.1, budget_s=30.0)
    assert m.stopped_by == "width" and m.rounds >= 5
    for (x, y), true in zip(watched, [2.5, 1.25, 1.5], strict=True):
        est = m.ratio(x, y)
        assert est.ci_low <= true <= est.ci_high
        assert est.rel_width <= 0.1 and est.rounds == m.rounds
    assert m.mean("incumbent") == pytest.approx(2.0, rel=0.05)
    assert m.geomean("incumbent") == pytest.approx(2.0, rel=0.05)


def test_alternating_order_cancels_a_linear_drift() -> None:
    """The machine slows by 1% a call; A first in every round would put 2.0 outside the interval."""
    rng = random.Random(2)
    calls = [0]

    def drifting(scale: float) -> Callable[[], float]:
        def side() -> float:
            calls[0] += 1
            return scale * (1 + 0.01 * calls[0]) * rng.lognormvariate(0.0, 0.001)

        return side

    sides = {"a": drifting(2.0), "b": drifting(1.0)}
    m = measure(sides, [("a", "b")], rel_width=0.05, min_rounds=6, warmup=0)
    est = m.ratio("a", "b")
    assert est.ci_low <= 2.0 <= est.ci_high
    # the drift is real: rounds with a first (even ones, warmup=0) alone miss 2.0 low, b first high
    assert ratio_from_samples(m.samples["a"][::2], m.samples["b"][::2]).ci_high < 2.0
    assert ratio_from_samples(m.samples["a"][1::2], m.samples["b"][1::2]).ci_low > 2.0


def test_interval_covers_the_true_ratio_about_95_percent_of_the_time() -> None:
    rng = random.Random(3)
    covered = 0
    for _ in range(200):
        sides = {"a": noisy(rng, 3.0, 0.2), "b": noisy(rng, 1.0, 0.2)}
        m = measure(sides, [("a", "b")], rel_width=1e-9, min_rounds=10, max_rounds=10)
        est = m.ratio("a", "b")
        covered += est.ci_low <= 3.0 <= est.ci_high
    assert 180 <= covered <= 199


class FakeClock:
    """A clock that moves only when a side's work says how long it took: timings without a machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def work(self, seconds: float) -> Callable[[], None]:
        def run() -> None:
            self.now += seconds

        return run


def test_timed_sides_differing_threefold_give_their_ratio() -> None:
    """timed() on a clock where the long side takes three times the short one's seconds, give or take a
    seeded 5%: the ratio's interval holds 3 and is narrow."""
    clock, rng = FakeClock(), random.Random(7)

    def jittered(seconds: float) -> Callable[[], None]:
        return lambda: clock.work(seconds * rng.uniform(0.95, 1.05))()

    m = measure(
        {"short": timed(jittered(0.01), clock), "long": timed(jittered(0.03), clock)},
        [("long", "short")],
        rel_width=0.05,
        budget_s=3.0,
        clock=clock,
    )
    est = m.ratio("long", "short")
    assert m.stopped_by == "width"
    assert est.ci_low <= 3.0 <= est.ci_high and est.rel_width <= 0.05


def test_budget_stops_after_min_rounds() -> None:
    """Every round costs about 0.02 s of the clock (two sides of 0.01 s, give or take a seeded 5%, so the
    interval never narrows to rel_width): the budget of 0.05 s is spent before the fifth measured round, so
    it stops there, at min_rounds, whatever the machine does."""
    clock, rng = FakeClock(), random.Random(11)
    sides = {name: timed(lambda: clock.work(0.01 * rng.uniform(0.95, 1.05))(), clock) for name in "ab"}
    m = measure(sides, [("a", "b")], rel_width=1e-9, budget_s=0.05, min_rounds=5, clock=clock)
    assert (m.stopped_by, m.rounds) == ("budget", 5)
    assert m.elapsed_s == pytest.approx(0.12, rel=0.06)  # the warm-up round and five measured ones


def test_rounds_interleave_alternate_and_drop_warmup() -> None:
    order: list[str] = []
    counts = {"a": 0, "b": 0, "c": 0}

    def side(name: str) -> Callable[[], float]:
        def call() -> float:
            order.append(name)
            counts[name] += 1
            return float(counts[name])

        return call

    m = measure({n: side(n) for n in "abc"}, [], warmup=2, min_rounds=3, max_rounds=3)
    assert "".join(order) == "abc" + "cba" + "abc" + "cba" + "abc"
    assert (m.rounds, m.stopped_by) == (3, "max_rounds")
    assert m.samples == {"a": (3.0, 4.0, 5.0), "b": (3.0, 4.0, 5.0), "c": (3.0, 4.0, 5.0)}


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_side_returning_a_non_positive_or_non_finite_value_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="side 'b' returned"):
        measure({"a": lambda: 1.0, "b": lambda: bad}, [("a", "b")])


def test_invalid_arguments_are_refused() -> None:
    two = {"a": lambda: 1.0, "b": lambda: 2.0}
    with pytest.raises(ValueError, match="unknown side 'z'"):
        measure(two, [("a", "z")])
    with pytest.raises(ValueError, match="at least 2 sides"):
        measure({"a": lambda: 1.0}, [])
    with pytest.raises(ValueError, match="min_rounds must be at least 2"):
        measure(two, [("a", "b")], min_rounds=1)
    with pytest.raises(ValueError, match="unknown side 'q'"):
        measure(two, [], min_rounds=2, max_rounds=2).ratio("q", "a")
    with pytest.raises(ValueError, match="differ in length"):
        ratio_from_samples([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least 2 paired samples"):
        ratio_from_samples([1.0], [1.0])
