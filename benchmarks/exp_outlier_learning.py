"""Does the drafter learn through massive activations, and which architecture does? (issue 57, first part)

On the tiny target's real captured features, with massive activations injected as
exp_outlier_encoding.py injects them (--channels at --ratios times the layer's median channel magnitude,
every token, every aux layer), it trains --seeds drafters of each of --archs (drafter.architecture:
eagle3, or eagle3.1, whose fc_norm RMS-normalises each aux state before fc) on bf16 features, and, for the
level without outliers, --seeds drafters of each of --clean-archs (default eagle3) on the same features
without the injection. Each drafter's held-out cond_acc_0 is printed, then per case the mean over seeds
with its 95% t interval, and per case the difference of each architecture from eagle3 with its interval
(Welch's, seeds unpaired: a training seed is not the same draw across architectures). An empty list skips
a case.

    python benchmarks/exp_outlier_learning.py [--samples 240] [--epochs 3] [--seeds 3] [--archs A,B]
        [--clean-archs A,B]

Last lines: `<case>_<arch>_cond_acc0_mean`, and `<case>_<arch>_minus_eagle3_cond_acc0` with its interval.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from exp_outlier_encoding import (
    add_injection_args,
    clean_capture,
    injected,
    injection_from,
    median_channel_magnitude,
    publish_capture,
    trained_cond_acc,
)
from support import report

from pipeline.spread import t_quantile


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the t interval of the mean over independent runs."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = (
        t_quantile(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    )
    return mean, mean - half, mean + half


def difference_interval(
    a: list[float], b: list[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): Welch's t interval of the difference of two means."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(0.5 + confidence / 2, max(1, math.floor(df))) * se
    return diff, diff - half, diff + half


def trained(config, store, capture_uri: str, arch: str, seed: int, name: str) -> float:
    """Held-out cond_acc_0 of one drafter of `arch`, trained with `seed` on the capture."""
    run_config = config.model_copy(deep=True)
    run_config.drafter.architecture = arch
    run_config.train.seed = seed
    return trained_cond_acc(run_config, store, capture_uri, name)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--archs", default="eagle3,eagle3.1", help="trained on the outlier features")
    parser.add_argument("--clean-archs", default="eagle3", help="trained on the features without outliers")
    add_injection_args(parser)
    args = parser.parse_args()
    archs = [arch for arch in args.archs.split(",") if arch]
    clean_archs = [arch for arch in args.clean_archs.split(",") if arch]
    injection = injection_from(args)
    config, store, clean_uri, source, shards = clean_capture(args.samples, args.epochs)
    from pipeline import layout

    magnitude = median_channel_magnitude([s for samples in shards.values() for s in samples])
    outlier_shards = {name: injected(samples, injection, magnitude) for name, samples in shards.items()}
    prefix = layout.captures_prefix(config.target.name, "outliers")
    outlier_uri = publish_capture(store, source, outlier_shards, f"{prefix}-bf16", "bf16", 32)
    seeds = [config.train.seed + k for k in range(args.seeds)]

    runs: dict[str, list[float]] = {}
    for case, uri, case_archs in (("clean", clean_uri, clean_archs), ("outlier", outlier_uri, archs)):
        for arch in case_archs:
            values = runs.setdefault(f"{case}_{arch}", [])
            for seed in seeds:
                value = trained(config, store, uri, arch, seed, f"{case}-{arch}-seed{seed}")
                values.append(value)
                print(f"{case} {arch} seed {seed}: held-out cond_acc_0 {value:.4f}", flush=True)

    figures: dict[str, object] = {
        "samples": sum(len(v) for v in shards.values()),
        "epochs": args.epochs,
        "seeds": json.dumps(seeds),
        "injected_channels": json.dumps(injection.channels),
        "injected_ratios": json.dumps(injection.ratios),
    }
    for name, values in runs.items():
        mean, low, high = mean_interval(values)
        figures[f"{name}_cond_acc0"] = json.dumps([round(v, 4) for v in values])
        figures[f"{name}_cond_acc0_mean"] = f"{mean:.4f} [{low:.4f}, {high:.4f}]"
    for case, case_archs in (("clean", clean_archs), ("outlier", archs)):
        for arch in case_archs:
            if arch != "eagle3" and f"{case}_eagle3" in runs:
                diff, low, high = difference_interval(runs[f"{case}_{arch}"], runs[f"{case}_eagle3"])
                figures[f"{case}_{arch}_minus_eagle3_cond_acc0"] = f"{diff:+.4f} [{low:+.4f}, {high:+.4f}]"
    report(**figures)


if __name__ == "__main__":
    main()
