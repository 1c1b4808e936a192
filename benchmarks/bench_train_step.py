"""One training step as the trainer runs it (streamed shard read, fp8 decode, collate, teacher, DeepSpeed
forward/backward/optimizer step) against the bare model forward + backward on the same batches.

    python benchmarks/bench_train_step.py [--samples 240] [--steps 8] [--budget-s 150] [--rel-width 0.1]

The two sides run interleaved (full, bare, bare, full, ...), each over the same `--steps` batches per
round, until the ratio's 95% interval is narrower than --rel-width or --budget-s runs out. Short
rounds of a few steps keep the two sides close in time, so a load change on the shared machine falls
on both alike.
Headline (last line): step_overhead_ratio = full step seconds / bare forward+backward seconds, after
its step_overhead_ratio_ci_low= and step_overhead_ratio_ci_high= lines.
"""

from __future__ import annotations

import json
from pathlib import Path

from support import (
    captured_dataset,
    report,
    report_measurement,
    report_ratio,
    single_process_group,
    spread_parser,
)


def main() -> None:
    parser = spread_parser(budget_s=150.0)
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--steps", type=int, default=8, help="steps per side per round")
    args = parser.parse_args()
    config, store, dataset_uri = captured_dataset(args.samples)
    single_process_group()
    import torch

    from pipeline.drafter.objective import DraftObjective
    from pipeline.engines.target import describe_target, load_frozen_tensors
    from pipeline.records import WorkerSpec, read_dataset
    from pipeline.spread import measure, timed
    from pipeline.stages.train import draft_vocabulary
    from pipeline.training.stream import collate
    from pipeline.training.worker import Trainer, build_model

    dataset = read_dataset(store, dataset_uri)
    workdir = Path(config.storage.local_cache) / "bench-train-step"
    spec = WorkerSpec(
        config=config,
        run_id="bench",
        workdir=str(workdir),
        train_shards=dataset.train_shards,
        shard_cache=str(Path(config.storage.local_cache) / "shards"),
        target_dir=str(describe_target(config).model_dir),
        contract=dataset.contract,
        init_dir=None,
        draft_vocab=draft_vocabulary(config, store, dataset, None),
    )
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    trainer = Trainer(spec)
    plan = trainer.plan(0)[: args.steps]
    frozen = load_frozen_tensors(Path(spec.target_dir))
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

    def bare() -> None:
        for batch in batches:
            loss, _ = objective(**batch)
            loss.backward()
            objective.zero_grad(set_to_none=True)

    def full() -> None:
        for samples in trainer.stream.batches(plan):
            trainer.step(samples)

    measurement = measure(
        {"full": timed(full), "bare": timed(bare)},
        [("full", "bare")],
        budget_s=args.budget_s,
        rel_width=args.rel_width,
    )
    trainer.stream.close()
    torch.distributed.destroy_process_group()
    report(
        steps=len(plan),
        micro_batch=config.train.micro_batch_size,
        ttt_steps=config.train.ttt_steps,
        encoding=dataset.contract.aux_encoding,
        teacher=json.dumps(dataset.contract.teacher_kinds),
        bare_seconds_per_step=measurement.geomean("bare") / len(plan),
        full_seconds_per_step=measurement.geomean("full") / len(plan),
    )
    report_measurement(measurement)
    report_ratio("step_overhead_ratio", measurement.ratio("full", "bare"), headline=True)


if __name__ == "__main__":
    main()
