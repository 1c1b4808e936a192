"""Which draft setting to serve: the fastest one MEASURED, with a stated noise bound, not the one a model
predicts fastest.

The candidate settings are timed side by side (pipeline.spread.measure: interleaved rounds, each one
decoding the same prompt or batch with every setting). The fastest is the highest geometric-mean speed.
Every other setting's speed relative to it has a confidence interval from the paired rounds:

- its interval lies wholly below 1: the fastest is faster beyond the noise, and that setting is out;
- otherwise the lead is narrower than the measured spread: a tie.

Among the fastest and the settings tied with it, the simplest wins: a chain before a tree, then fewer draft
tokens, a narrower tree, fewer steps. So the setting chosen is either the fastest measured or one whose
measured speed is within its stated noise of the fastest. The same rule picks the reference decoder's setting
(pipeline.benchmark.calibration) and SGLang's flags (pipeline.benchmark.sglang).

Measuring stops early once every pair is settled: each other setting is out, or its interval relative to
the fastest is narrower than `resolution` (a lead that small is a tie however long one measures).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.spread import Decided, Measurement, RatioEstimate, ratio_from_samples

Shape = tuple[int, int, int]  # (steps, topk, draft tokens)


def simplicity(shape: Shape) -> tuple[bool, int, int, int]:
    """Sort key, simplest first: a chain before a tree, fewer draft tokens, a narrower tree, fewer steps."""
    steps, topk, draft_tokens = shape
    return (topk > 1, draft_tokens, topk, steps)


def shape_label(shape: Shape) -> str:
    steps, topk, draft_tokens = shape
    return f"chain{steps}" if topk == 1 else f"tree{steps}x{topk}-{draft_tokens}"


@dataclass(frozen=True)
class Choice:
    """The setting chosen, the fastest measured, each setting's speed over the fastest's, and why."""

    chosen: str
    fastest: str
    vs_fastest: dict[str, RatioEstimate]  # every other setting's speed / the fastest's
    tied: list[str]  # settings whose lead against them the noise can explain, the fastest included
    reason: str


def fastest(samples: Mapping[str, Sequence[float]], names: Sequence[str]) -> str:
    """The name with the highest geometric mean of its speeds (the first of equals)."""
    return max(names, key=lambda name: statistics.geometric_mean(samples[name]))


def _vs_fastest(
    samples: Mapping[str, Sequence[float]], names: Sequence[str], confidence: float
) -> tuple[str, dict[str, RatioEstimate]]:
    best = fastest(samples, names)
    return best, {
        name: ratio_from_samples(samples[name], samples[best], confidence) for name in names if name != best
    }


def settled(names: Sequence[str], confidence: float, resolution: float) -> Decided:
    """A stop rule for pipeline.spread.measure over speeds (higher is faster): every setting is either
    slower than the fastest beyond the noise or known within `resolution` of it."""

    def decided(samples: Mapping[str, Sequence[float]]) -> bool:
        _, ratios = _vs_fastest(samples, names, confidence)
        return all(r.ci_high < 1.0 or r.rel_width <= resolution for r in ratios.values())

    return decided


def choose(measurement: Measurement, shapes: Mapping[str, Shape]) -> Choice:
    """The setting to serve from a measurement of speeds (higher is faster) of the settings in `shapes`
    (name -> (steps, topk, draft tokens)): the fastest, or the simplest of those tied with it."""
    names = list(shapes)
    if not names:
        raise ValueError("no draft setting was timed")
    if len(names) == 1:
        return Choice(names[0], names[0], {}, names, "the only setting timed")
    best, ratios = _vs_fastest(measurement.samples, names, measurement.confidence)
    tied = [best] + [name for name, ratio in ratios.items() if ratio.ci_high >= 1.0]
    chosen = min(tied, key=lambda name: simplicity(shapes[name]))
    level = f"{measurement.confidence:.0%}"
    if chosen == best and len(tied) == 1:
        reason = (
            f"{best} is the fastest measured, faster than every other setting beyond the {level} interval"
        )
    elif chosen == best:
        reason = f"{best} is the fastest measured and the simplest of the settings within its noise: {tied}"
    else:
        gap = ratios[chosen]
        reason = (
            f"{best} measured fastest, but {chosen} is within its noise ({chosen}/{best} speed "
            f"{gap.ratio:.3f}, {level} interval {gap.ci_low:.3f}-{gap.ci_high:.3f}) and simpler; tied: {tied}"
        )
    return Choice(chosen, best, ratios, tied, reason)
