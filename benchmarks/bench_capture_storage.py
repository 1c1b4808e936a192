"""Bytes per captured token: the default shard encoding against the plain bf16 layout other tools use,
(3 aux + 1 last) x H x 2 bytes, on the same real samples of the tiny target.

    python benchmarks/bench_capture_storage.py [--samples 200]

Also prints what the same encoding costs for Kimi-K2.5's shape (H 7168), from a synthetic shard.
Headline (last line): bytes_per_token_ratio.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from support import published, regenerated, report, stage


def kimi_shape_bytes_per_token(
    encoding: str, teacher_topk: int, tokens: int = 64, hidden: int = 7168
) -> float:
    import torch

    from pipeline.data.capture_shards import CaptureSample
    from pipeline.data.shard_writer import write_shard

    logprobs = torch.log_softmax(torch.randn(tokens, 1000), -1).topk(teacher_topk, -1)
    sample = CaptureSample(
        "kimi",
        torch.randint(0, 163840, (tokens,)),
        torch.ones(tokens, dtype=torch.uint8),
        torch.randn(tokens, 3 * hidden),
        None,
        logprobs.indices,
        logprobs.values,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kimi.safetensors"
        write_shard([sample], path, encoding)
        return path.stat().st_size / tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    config, store, responses = regenerated(args.samples)
    default = published(store, stage("capture", config, store, "bench-default", responses_uri=responses.uri))
    plain_config = config.model_copy(deep=True)
    plain_config.capture.encoding = "bf16"
    plain_config.capture.teacher = ["last_hidden"]
    plain = published(store, stage("capture", plain_config, store, "bench-bf16", responses_uri=responses.uri))

    def bytes_per_token(manifest):
        data = [o for o in manifest["objects"] if o["name"].endswith(".safetensors")]
        return sum(o["bytes"] for o in data) / manifest["totals"]["tokens"]

    hidden = default["contract"]["hidden_size"]
    plain_layout = (3 + 1) * hidden * 2
    ours = bytes_per_token(default)
    kimi = kimi_shape_bytes_per_token(config.capture.encoding, config.capture.teacher_topk)
    # byte counts of written files: exact, with no timing noise, so the ratios print without an interval
    report(
        samples=default["totals"]["samples"],
        tokens=default["totals"]["tokens"],
        hidden_size=hidden,
        default_encoding=f"{config.capture.encoding}+{'+'.join(config.capture.teacher)}"
        f"{config.capture.teacher_topk if 'topk' in config.capture.teacher else ''}",
        default_bytes_per_token=ours,
        bf16_last_hidden_shard_bytes_per_token=bytes_per_token(plain),
        plain_bf16_bytes_per_token=plain_layout,
        kimi_default_bytes_per_token=kimi,
        kimi_plain_bf16_bytes_per_token=(3 + 1) * 7168 * 2,
        kimi_bytes_per_token_ratio=kimi / ((3 + 1) * 7168 * 2),
        bytes_per_token_ratio=ours / plain_layout,
    )


if __name__ == "__main__":
    main()
