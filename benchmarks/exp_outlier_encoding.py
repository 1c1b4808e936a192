"""Massive activations vs the fp8 aux encoding, on real captured features of the tiny target.

The tiny target has no outliers (its channel amax sits within 2x of the median), so this injects them:
a few fixed channels, the same in every aux layer (massive activations appear in early layers and
persist, Sun et al. 2024, arXiv 2402.17762), at --ratios times the layer's median channel magnitude
(mean |x| of a channel over tokens), with a fixed sign and +-5% jitter per token. It then measures,
on the same injected features:

1. the fp8 round-trip error (pipeline.data.capture_shards.fp8_rel_error: RMS over channels of each
   channel's relative error) of block-scaled fp8 (--block channels per scale), of the previous
   encoding (one scale per token and layer) and of bf16, and how the first two grow with the ratio;
2. held-out cond_acc_0 of two drafters trained alike (same seed) on the injected features, one read
   through block-scaled fp8 and one through bf16; a third, bf16 with another training seed, shows how
   far cond_acc_0 moves for reasons other than the encoding (bf16_seed_cond_acc0_delta).

    python benchmarks/exp_outlier_encoding.py [--samples 240] [--epochs 3] [--block 32] [--ratios 500,3000]

The tiny target's hidden size is 128, so its default block (128) is one scale per token and layer;
--block 32 gives it 4 blocks per layer (Kimi-K2.5: 56 blocks of 128 per layer). Last line:
outlier_fp8_cond_acc0_delta (fp8 - bf16; goal |delta| <= 0.005).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from support import captured_dataset, published, report, stage


@dataclass(frozen=True)
class Injection:
    channels: list[int]
    ratios: list[float]  # per channel, times the layer's median channel magnitude
    seed: int = 0


def injected(samples, injection: Injection, median_magnitude):
    """The samples with massive activations written into their aux states (every token, every layer)."""
    import torch

    generator = torch.Generator().manual_seed(injection.seed)
    out = []
    for sample in samples:
        rows = sample.aux.shape[0]
        aux = sample.aux.clone().reshape(rows, 3, -1)
        for channel, ratio in zip(injection.channels, injection.ratios, strict=True):
            jitter = 1 + 0.05 * (2 * torch.rand(rows, 3, generator=generator) - 1)
            aux[:, :, channel] = ratio * median_magnitude[None, :] * jitter
        out.append(type(sample)(**{**sample.__dict__, "aux": aux.reshape(rows, -1)}))
    return out


def median_channel_magnitude(samples):
    """[3]: per aux layer, the median over channels of mean |x| over every token."""
    import torch

    aux = torch.cat([s.aux for s in samples])
    return aux.abs().reshape(aux.shape[0], 3, -1).mean(0).median(-1).values


def rel_errors(samples, block: int | None) -> dict[str, float]:
    """Worst layer's fp8_rel_error for fp8 (block None: one scale per token and layer) and bf16."""
    import torch

    from pipeline.data.capture_shards import dequantize_fp8, fp8_rel_error, quantize_fp8

    aux = torch.cat([s.aux for s in samples])
    width = aux.shape[1] // 3
    size = block or width
    fp8 = dequantize_fp8(*quantize_fp8(aux, 3, size), groups=3, block=size)
    return {
        "fp8": max(fp8_rel_error(aux, fp8, 3)),
        "bf16": max(fp8_rel_error(aux, aux.to(torch.bfloat16).float(), 3)),
    }


def read_capture(store, capture_uri: str):
    """(manifest, {shard name: samples}) of a published capture."""
    from pipeline.data.capture_shards import ShardReader, store_range_reader

    manifest = published_manifest(store, capture_uri)
    prefix = store.key_for(capture_uri)
    shards = {}
    for shard in manifest["shards"]:
        reader = ShardReader(store_range_reader(store, f"{prefix}/{shard['name']}"))
        shards[shard["name"]] = [reader.sample(i) for i in range(len(reader))]
    return manifest, shards


def published_manifest(store, uri: str) -> dict:
    from pipeline.manifest import read_manifest

    return read_manifest(store, store.key_for(uri), kind="capture")


def publish_capture(store, source: dict, shards: dict, prefix: str, encoding: str, block: int) -> str:
    """The shards written with `encoding` (no bf16 fallback) as a capture beside the source capture."""
    from pipeline.data.shard_writer import write_checked_shard
    from pipeline.manifest import publish

    objects, entries = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in source["shards"]:
            path = Path(tmp) / entry["name"]
            stats, _ = write_checked_shard(shards[entry["name"]], path, encoding, block, None)
            objects.append(store.put_file(f"{prefix}/{entry['name']}", path))
            entries.append({**entry, **stats})
    contract = {**source["contract"], "aux_encoding": encoding}
    contract["aux_fp8_block"] = block if encoding == "fp8" else None
    fields = {k: v for k, v in source.items() if k in ("snapshot", "responses", "config", "counts", "totals")}
    publish(store, prefix, "capture", objects, {**fields, "contract": contract, "shards": entries})
    return store.uri(prefix)


def trained_cond_acc(config, store, capture_uri: str, name: str) -> list[float]:
    dataset = stage("dataset", config, store, name, capture_uris=[capture_uri]).uri
    stage("train", config, store, name, dataset_uri=dataset)
    evaluation = stage("evaluate", config, store, name, dataset_uri=dataset)
    return published(store, evaluation)["summary"]["cond_acc"]


def sweep(samples, injection: Injection, magnitude, block: int) -> dict[str, dict[str, float]]:
    """fp8 error of both encodings as the strongest injected channel grows (the others as given)."""
    out: dict[str, dict[str, float]] = {"block": {}, "per_token": {}}
    for ratio in (1e3, 1e4, 3e4, 1e5, 1e6):
        scaled = Injection(injection.channels, [*injection.ratios[:-1], ratio], injection.seed)
        features = injected(samples, scaled, magnitude)
        out["block"][f"{ratio:g}"] = round(rel_errors(features, block)["fp8"], 4)
        out["per_token"][f"{ratio:g}"] = round(rel_errors(features, None)["fp8"], 4)
    return out


def add_injection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ratios", default="500,3000", help="times the median channel magnitude")
    parser.add_argument("--channels", default="17,29", help="the massive-activation channels")


def injection_from(args: argparse.Namespace) -> Injection:
    return Injection([int(c) for c in args.channels.split(",")], [float(r) for r in args.ratios.split(",")])


def clean_capture(samples: int, epochs: int):
    """(config, store, capture uri, its manifest, {shard name: samples}): the tiny target's bf16 features of
    `samples` conversations, a quarter held out, in a scratch store whose config trains `epochs` epochs
    without the plateau stop."""
    overrides = [
        "capture.encoding=bf16",
        "prompts.eval_fraction=0.25",
        "train.plateau.enabled=false",
        f"train.epochs={epochs}",
    ]
    config, store, _ = captured_dataset(samples, overrides)
    from pipeline import layout

    clean_uri = store.uri(layout.captures_prefix(config.target.name, "bench"))
    source, shards = read_capture(store, clean_uri)
    return config, store, clean_uri, source, shards


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--block", type=int, default=32)
    add_injection_args(parser)
    args = parser.parse_args()
    injection = injection_from(args)
    config, store, clean_uri, source, shards = clean_capture(args.samples, args.epochs)
    from pipeline import layout

    every = [s for samples in shards.values() for s in samples]
    magnitude = median_channel_magnitude(every)
    outlier_shards = {name: injected(samples, injection, magnitude) for name, samples in shards.items()}
    outliers = [s for samples in outlier_shards.values() for s in samples]
    from pipeline.data.activation_outliers import channel_amax, outlier_summary

    clean_ratio = [
        layer["amax_over_median"]
        for layer in outlier_summary(channel_amax([s.aux for s in every], 3), [0, 1, 2])
    ]
    measured = [
        layer["amax_over_median"]
        for layer in outlier_summary(channel_amax([s.aux for s in outliers], 3), [0, 1, 2])
    ]
    block, per_token = rel_errors(outliers, args.block), rel_errors(outliers, None)
    clean = rel_errors(every, args.block)
    growth = sweep(every, injection, magnitude, args.block)

    prefix = layout.captures_prefix(config.target.name, "outliers")
    fp8_uri = publish_capture(store, source, outlier_shards, f"{prefix}-fp8", "fp8", args.block)
    bf16_uri = publish_capture(store, source, outlier_shards, f"{prefix}-bf16", "bf16", args.block)
    fp8_acc = trained_cond_acc(config, store, fp8_uri, "outliers-fp8")
    bf16_acc = trained_cond_acc(config, store, bf16_uri, "outliers-bf16")
    # the bf16 run with another training seed: how far held-out cond_acc moves for reasons other than encoding
    reseeded = config.model_copy(deep=True)
    reseeded.train.seed = config.train.seed + 1
    reseeded_acc = trained_cond_acc(reseeded, store, bf16_uri, "outliers-bf16-reseeded")
    report(
        samples=len(every),
        eval_samples=sum(len(v) for k, v in shards.items() if k.startswith("eval")),
        epochs=args.epochs,
        fp8_block=args.block,
        injected_channels=json.dumps(injection.channels),
        injected_ratios=json.dumps(injection.ratios),
        clean_amax_over_median=json.dumps(clean_ratio),
        outlier_amax_over_median=json.dumps(measured),
        clean_rel_error_fp8=clean["fp8"],
        rel_error_fp8_by_ratio=json.dumps(growth["block"]),
        rel_error_fp8_per_token_by_ratio=json.dumps(growth["per_token"]),
        fp8_heldout_cond_acc=json.dumps([round(a, 4) for a in fp8_acc[:2]]),
        bf16_heldout_cond_acc=json.dumps([round(a, 4) for a in bf16_acc[:2]]),
        bf16_reseeded_heldout_cond_acc=json.dumps([round(a, 4) for a in reseeded_acc[:2]]),
        bf16_seed_cond_acc0_delta=reseeded_acc[0] - bf16_acc[0],
        outlier_rel_error_fp8=block["fp8"],
        outlier_rel_error_fp8_per_token=per_token["fp8"],
        outlier_rel_error_bf16=block["bf16"],
        outlier_fp8_cond_acc0_delta=fp8_acc[0] - bf16_acc[0],
    )


if __name__ == "__main__":
    main()
