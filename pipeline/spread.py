"""Timings that state their spread: interleaved rounds, paired log-ratios with a Student-t interval.

A ratio without its noise is not a result. `measure` runs every side once per round, interleaved
(A B, B A, A B, ... never A A A B B B), drops warm-up rounds and repeats until each watched ratio's
confidence interval is narrow enough, a time budget runs out or a round cap is reached.
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

Side = Callable[[], float]
StoppedBy = Literal["width", "decided", "budget", "max_rounds"]
Decided = Callable[[Mapping[str, Sequence[float]]], bool]


Clock = Callable[[], float]


def timed(fn: Callable[[], object], clock: Clock = time.perf_counter) -> Side:
    """A side that runs `fn` and returns the seconds it took on `clock`."""

    def side() -> float:
        start = clock()
        fn()
        return clock() - start

    return side


@dataclass(frozen=True)
class RatioEstimate:
    """A ratio of two sides with its confidence interval, from `rounds` paired measurements."""

    ratio: float
    ci_low: float
    ci_high: float
    confidence: float
    rounds: int

    @property
    def rel_width(self) -> float:
        """Width of the interval relative to the estimate: (ci_high - ci_low) / ratio."""
        return (self.ci_high - self.ci_low) / self.ratio

    def as_dict(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "confidence": self.confidence,
            "rounds": self.rounds,
        }

    def lines(self, name: str) -> list[str]:
        """The benchmark output lines: `name=`, `name_ci_low=`, `name_ci_high=`."""
        return [
            f"{name}={self.ratio:.4f}",
            f"{name}_ci_low={self.ci_low:.4f}",
            f"{name}_ci_high={self.ci_high:.4f}",
        ]


def _t_cdf(t: float, df: int) -> float:
    """Student-t CDF for integer df, exact finite series (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:
        term, total = math.cos(theta), 0.0
        for k in range(1, (df - 1) // 2 + 1):  # cos + (2/3)cos^3 + (2*4)/(3*5)cos^5 + ...
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        a = (2 / math.pi) * (theta + s * total) if df > 1 else 2 * theta / math.pi
    else:
        term, total = 1.0, 0.0
        for k in range(1, df // 2 + 1):  # 1 + (1/2)cos^2 + (1*3)/(2*4)cos^4 + ...
            total += term
            term *= c2 * (2 * k - 1) / (2 * k)
        a = s * total
    return 0.5 + a / 2


@lru_cache(maxsize=1024)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (bisection on the exact CDF)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def _check_value(name: str, value: float) -> float:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
        raise ValueError(f"side {name!r} returned {value!r}; measurements must be positive and finite")
    return float(value)


def ratio_from_samples(
    x_samples: Sequence[float], y_samples: Sequence[float], confidence: float = 0.95
) -> RatioEstimate:
    """Ratio x/y from paired samples: exp(mean ln(x_i/y_i)) with a Student-t interval on the logs."""
    if len(x_samples) != len(y_samples):
        raise ValueError(f"paired samples differ in length: {len(x_samples)} vs {len(y_samples)}")
    if len(x_samples) < 2:
        raise ValueError(f"an interval needs at least 2 paired samples, got {len(x_samples)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    pairs = zip(x_samples, y_samples, strict=True)
    logs = [math.log(_check_value("x", x) / _check_value("y", y)) for x, y in pairs]
    n = len(logs)
    mean = statistics.fmean(logs)
    half = t_quantile((1 + confidence) / 2, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return RatioEstimate(math.exp(mean), math.exp(mean - half), math.exp(mean + half), confidence, n)


@dataclass(frozen=True)
class Measurement:
    """What `measure` saw: per-side samples after warm-up, in round order, and why it stopped."""

    samples: Mapping[str, tuple[float, ...]]
    rounds: int
    stopped_by: StoppedBy
    confidence: float
    elapsed_s: float

    def ratio(self, x: str, y: str) -> RatioEstimate:
        """Ratio of side x over side y, paired per round."""
        _check_names(self.samples, [(x, y)])
        return ratio_from_samples(self.samples[x], self.samples[y], self.confidence)

    def mean(self, side: str) -> float:
        return statistics.fmean(self.samples[side])

    def geomean(self, side: str) -> float:
        return statistics.geometric_mean(self.samples[side])


def _check_names(sides: Mapping[str, object], ratios: Sequence[tuple[str, str]]) -> None:
    for pair in ratios:
        for name in pair:
            if name not in sides:
                raise ValueError(f"ratio {pair} names unknown side {name!r}; sides are {sorted(sides)}")


def _check_args(
    sides: Mapping[str, Side], ratios: Sequence[tuple[str, str]], min_rounds: int, max_rounds: int
) -> None:
    if len(sides) < 2:
        raise ValueError(f"measure compares at least 2 sides, got {len(sides)}")
    if min_rounds < 2:
        raise ValueError(f"min_rounds must be at least 2 for an interval, got {min_rounds}")
    if max_rounds < min_rounds:
        raise ValueError(f"max_rounds ({max_rounds}) is below min_rounds ({min_rounds})")
    _check_names(sides, ratios)


def _run_round(sides: Mapping[str, Side], index: int) -> dict[str, float]:
    """One call of every side; the order reverses on odd rounds so a linear drift cancels."""
    names = list(sides)
    order = names if index % 2 == 0 else names[::-1]
    return {name: _check_value(name, sides[name]()) for name in order}


def measure(
    sides: Mapping[str, Side],
    ratios: Sequence[tuple[str, str]],
    *,
    confidence: float = 0.95,
    rel_width: float = 0.1,
    budget_s: float = 60.0,
    min_rounds: int = 5,
    max_rounds: int = 1000,
    warmup: int = 1,
    decided: Decided | None = None,
    clock: Clock = time.perf_counter,
) -> Measurement:
    """Measure every side in interleaved rounds until the watched ratios are known well enough.

    Each round calls every side once; the order alternates between rounds (A B C, C B A, A B C, ...)
    so a linear drift of the shared machine falls on every side alike over each pair of rounds. The
    first `warmup` rounds are discarded. After at least `min_rounds` measured rounds it stops when
    every ratio in `ratios` (numerator, denominator) has a `confidence` interval with
    (ci_high - ci_low) / ratio <= `rel_width` ("width"), at `max_rounds` ("max_rounds"), or once
    `budget_s` seconds have passed since the start on `clock`, warm-up included ("budget"). With `decided`,
    that rule replaces the ratios' widths: it stops once `decided(samples so far)` holds ("decided").
    """
    _check_args(sides, ratios, min_rounds, max_rounds)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if rel_width <= 0 or warmup < 0:
        raise ValueError(f"need rel_width > 0 and warmup >= 0, got rel_width={rel_width}, warmup={warmup}")
    start = clock()
    for index in range(warmup):
        _run_round(sides, index)
    samples: dict[str, list[float]] = {name: [] for name in sides}
    stopped_by: StoppedBy | None = None
    index = warmup
    while stopped_by is None:
        for name, value in _run_round(sides, index).items():
            samples[name].append(value)
        index += 1
        stopped_by = _stop_reason(samples, ratios, confidence, rel_width, min_rounds, max_rounds, decided)
        if stopped_by is None and index - warmup >= min_rounds and clock() - start >= budget_s:
            stopped_by = "budget"
    frozen = {name: tuple(values) for name, values in samples.items()}
    return Measurement(frozen, index - warmup, stopped_by, confidence, clock() - start)


def _rounds(samples: Mapping[str, Sequence[float]]) -> int:
    return len(next(iter(samples.values())))


def _stop_reason(
    samples: Mapping[str, Sequence[float]],
    ratios: Sequence[tuple[str, str]],
    confidence: float,
    rel_width: float,
    min_rounds: int,
    max_rounds: int,
    decided: Decided | None = None,
) -> StoppedBy | None:
    rounds = _rounds(samples)
    if rounds < min_rounds:
        return None
    if decided is not None:
        return "decided" if decided(samples) else ("max_rounds" if rounds >= max_rounds else None)
    widths = [ratio_from_samples(samples[x], samples[y], confidence).rel_width for x, y in ratios]
    if widths and max(widths) <= rel_width:
        return "width"
    return "max_rounds" if rounds >= max_rounds else None
