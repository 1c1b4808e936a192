"""One training step as the trainer runs it (streamed shard read, fp8 decode, collate, teacher, DeepSpeed
forward/backward/optimizer step) against the bare model forward + backward on the same batches.

    python benchmarks/bench_train_step.py [--samples 240] [--steps 30]

Headline (last line): step_overhead_ratio = full step seconds / bare forward+backward seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from support import captured_dataset, report, single_process_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    config, store, dataset_uri = captured_dataset(args.samples)
    single_process_group()
    import torch

    from pipeline.engines.target import describe_target, load_frozen_tensors
    from pipeline.manifest import read_manifest
    from pipeline.stages.train import draft_vocabulary
    from pipeline.training.stream import collate
    from pipeline.training.worker import DraftObjective, Trainer, build_model

    dataset = read_manifest(store, store.key_for(dataset_uri), kind="dataset")
    workdir = Path(config.storage.local_cache) / "bench-train-step"
    spec = {
        "config": config.dump(),
        "workdir": str(workdir),
        "train_shards": dataset["train_shards"],
        "shard_cache": str(Path(config.storage.local_cache) / "shards"),
        "target_dir": str(describe_target(config).model_dir),
        "contract": dataset["contract"],
        "init_dir": None,
        "draft_vocab": draft_vocabulary(config, store, dataset, None),
    }
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    trainer = Trainer(spec)
    plan = trainer.plan(0)[: args.steps]
    frozen = load_frozen_tensors(Path(spec["target_dir"]))
    settings = config.train
    # the same model math, outside DeepSpeed (its gradient hooks are attached to the engine's copy)
    objective = DraftObjective(
        build_model(config, spec, frozen),
        frozen["lm_head"].float(),
        trainer.teacher,
        settings.ttt_steps,
        settings.loss_decay,
        settings.attention_chunk,
    )
    batches = [collate(samples, trainer.dtype) for samples in trainer.stream.batches(plan)]

    def bare() -> float:
        started = time.perf_counter()
        for batch in batches:
            loss, _ = objective(**batch)
            loss.backward()
            objective.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    def full() -> float:
        started = time.perf_counter()
        for samples in trainer.stream.batches(plan):
            trainer.step(samples)
        return time.perf_counter() - started

    bare(), full()  # warm-up
    bare_s = min(bare(), bare())
    full_s = min(full(), full())
    trainer.stream.close()
    torch.distributed.destroy_process_group()
    report(
        steps=len(plan),
        micro_batch=config.train.micro_batch_size,
        ttt_steps=config.train.ttt_steps,
        encoding=dataset["contract"]["aux_encoding"],
        teacher=json.dumps(dataset["contract"]["teacher_kinds"]),
        bare_seconds_per_step=bare_s / len(plan),
        full_seconds_per_step=full_s / len(plan),
        step_overhead_ratio=full_s / bare_s,
    )


if __name__ == "__main__":
    main()
