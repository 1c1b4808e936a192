"""Training-data loader throughput from an S3 server (moto's, over HTTP on 127.0.0.1) against the rate
at which the trainer consumes samples, on the same dataset, in one run.

    python benchmarks/bench_loader.py [--samples 300] [--budget-s 90] [--rel-width 0.1]

The loader starts from an empty cache each time: each shard is downloaded, sha256-verified, its samples
read and fp8-decoded, and batches collated, with two shards prefetched. Consumption is a training step
(forward, backward, AdamW step) on those batches. The two sides run interleaved, one pass over the
samples each per round, until the ratio's 95% interval is narrower than --rel-width or --budget-s runs
out.
Headline (last line): loader_ratio = loader samples/s / trainer samples/s, after its loader_ratio_ci_low=
and loader_ratio_ci_high= lines.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from support import captured_dataset, report, report_measurement, report_ratio, spread_parser


def main() -> None:
    parser = spread_parser(budget_s=90.0)
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

        from pipeline.drafter.objective import DraftObjective, choose_teacher
        from pipeline.engines.target import describe_target, load_frozen_tensors
        from pipeline.records import DrafterSource, read_dataset
        from pipeline.spread import measure, timed
        from pipeline.stages.train import draft_vocabulary
        from pipeline.training.stream import ShardCache, ShardRef, StreamingShards, collate, epoch_plan
        from pipeline.training.worker import build_model

        dataset = read_dataset(store, dataset_uri)
        shards = [ShardRef.from_manifest(entry) for entry in dataset.train_shards]
        settings = config.train
        plan = epoch_plan(shards, settings.seed, 0, 0, 1, settings.micro_batch_size)
        loaded: list = []

        def load() -> float:
            """A side: seconds to stream and collate every batch of the plan, from an empty cache."""
            with tempfile.TemporaryDirectory() as cache_dir:
                stream = StreamingShards(
                    shards,
                    ShardCache(store, Path(cache_dir), 1 << 34),
                    settings.max_length,
                    settings.prefetch_shards,
                )
                started = time.perf_counter()
                collated = [collate(samples, torch.float32) for samples in stream.batches(plan)]
                seconds = time.perf_counter() - started
                loaded[:] = [collated, choose_teacher(settings.teacher, stream.teachers())]
                stream.close()
            return seconds

        load()  # the batches (and the teacher they carry) the trainer side consumes
        batches, teacher = loaded
        spec = DrafterSource(
            target_dir=str(describe_target(config).model_dir),
            contract=dataset.contract,
            draft_vocab=draft_vocabulary(config, store, dataset, None),
        )
        frozen = load_frozen_tensors(Path(spec.target_dir))
        objective = DraftObjective(
            build_model(config, spec, frozen),
            frozen["lm_head"].float(),
            teacher,
            settings.ttt_steps,
            settings.loss_decay,
            settings.attention_chunk,
        )
        optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-4)

        def train() -> None:
            for batch in batches:
                loss, _ = objective(**batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        measurement = measure(
            {"loader": load, "trainer": timed(train)},
            [("trainer", "loader")],
            budget_s=args.budget_s,
            rel_width=args.rel_width,
        )
    finally:
        server.stop()
    samples = sum(len(b) for b in plan)
    report(
        samples=samples,
        shards=len(shards),
        shard_mb=round(sum(s.bytes for s in shards) / len(shards) / 2**20, 2),
        loader_samples_per_s=samples / measurement.geomean("loader"),
        trainer_samples_per_s=samples / measurement.geomean("trainer"),
    )
    report_measurement(measurement)
    # same samples on both sides, so loader samples/s over trainer samples/s = trainer s / loader s
    report_ratio("loader_ratio", measurement.ratio("trainer", "loader"), headline=True)


if __name__ == "__main__":
    main()
