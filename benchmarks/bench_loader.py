"""Training-data loader throughput from an S3 server (moto's, over HTTP on 127.0.0.1) against the rate
at which the trainer consumes samples, on the same dataset, in one run.

    python benchmarks/bench_loader.py [--samples 300]

The loader starts from an empty cache: each shard is downloaded, sha256-verified, its samples read
and fp8-decoded, and batches collated, with two shards prefetched. Consumption is a training step
(forward, backward, AdamW step) on those batches.
Headline (last line): loader_ratio = loader samples/s / trainer samples/s.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from support import captured_dataset, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench-loader")
    try:
        config, store, dataset_uri = captured_dataset(
            args.samples, ["storage.root=s3://bench-loader/run", f"storage.endpoint_url={endpoint}"]
        )
        import torch

        from pipeline.engines.target import describe_target, load_frozen_tensors
        from pipeline.manifest import read_manifest
        from pipeline.stages.train import draft_vocabulary
        from pipeline.training.stream import ShardCache, ShardRef, StreamingShards, collate, epoch_plan
        from pipeline.training.worker import DraftObjective, build_model, choose_teacher

        dataset = read_manifest(store, store.key_for(dataset_uri), kind="dataset")
        shards = [ShardRef.from_manifest(entry) for entry in dataset["train_shards"]]
        settings = config.train
        plan = epoch_plan(shards, settings.seed, 0, 0, 1, settings.micro_batch_size)
        with tempfile.TemporaryDirectory() as cache_dir:
            stream = StreamingShards(
                shards,
                ShardCache(store, Path(cache_dir), 1 << 34),
                settings.max_length,
                settings.prefetch_shards,
            )
            started = time.perf_counter()
            batches = [collate(samples, torch.float32) for samples in stream.batches(plan)]
            loader_s = time.perf_counter() - started
            teacher = choose_teacher(settings.teacher, stream.teachers())
            stream.close()
        spec = {
            "target_dir": str(describe_target(config).model_dir),
            "contract": dataset["contract"],
            "draft_vocab": draft_vocabulary(config, store, dataset, None),
        }
        frozen = load_frozen_tensors(Path(spec["target_dir"]))
        objective = DraftObjective(
            build_model(config, spec, frozen),
            frozen["lm_head"].float(),
            teacher,
            settings.ttt_steps,
            settings.loss_decay,
            settings.attention_chunk,
        )
        optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-4)
        started = time.perf_counter()
        for batch in batches:
            loss, _ = objective(**batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        train_s = time.perf_counter() - started
    finally:
        server.stop()
    samples = sum(len(b) for b in plan)
    report(
        samples=samples,
        shards=len(shards),
        shard_mb=round(sum(s.bytes for s in shards) / len(shards) / 2**20, 2),
        loader_samples_per_s=samples / loader_s,
        trainer_samples_per_s=samples / train_s,
        loader_ratio=(samples / loader_s) / (samples / train_s),
    )


if __name__ == "__main__":
    main()
