"""Two questions on the tiny target, each answered side by side in one run:

1. Init: a drafter trained from scratch on the target's own data vs one warm-started from the drafter
   of a DIFFERENT tiny target (same recipe and tokenizer, another seed and budget): the K2 -> K2.5
   plateau case in miniature. Prints cond_acc_0/1 per epoch for both.
2. Encoding: the same data captured with fp8 (e4m3, per-token-per-layer scales) and with bf16 aux
   states, same teacher (top-16 log-probs), trained alike; held-out cond_acc_0 of each.

    python benchmarks/exp_init_and_encoding.py [--samples 240] [--epochs 4]

The other target is built once and cached (about a minute). Last line: fp8_cond_acc0_delta (fp8 - bf16).
"""

from __future__ import annotations

import argparse
import json

from support import report, scratch_config


def data_and_drafter(config, store, snapshot: str, run_id: str, train_overrides: dict):
    from pipeline.stages import capture, evaluate, generate, prompts, train

    responses = generate.run(config, prompts.run(config, snapshot, store).uri, snapshot, store)
    captured = capture.run(config, responses.uri, snapshot, store)
    dataset = capture.publish_dataset(config, [captured.uri], snapshot, store)
    run_config = config.model_copy(deep=True)
    for key, value in train_overrides.items():
        setattr(run_config.train, key, value)
    trained = train.run(run_config, dataset.uri, run_id, store)
    evaluation = evaluate.run(run_config, trained.uri, dataset.uri, run_id, store)
    return trained, evaluation.manifest["summary"], dataset.uri


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    common = [f"prompts.num_samples={args.samples}", "prompts.eval_fraction=0.15", "capture.parity.samples=0",
              f"train.epochs={args.epochs}", "train.plateau.enabled=false", "benchmark.num_prompts=4"]
    config = scratch_config(common)
    other = scratch_config(common + [f"storage.root={config.storage.root}", "target.name=tiny-other",
                                     "target.tiny.seed=1", "target.tiny.train_steps=160"])
    from pipeline.stages import train
    from pipeline.stages.evaluate import local_drafter_dir
    from pipeline.storage import open_store
    from pipeline.target import describe_target

    store = open_store(config.storage)
    mine, other_target = describe_target(config), describe_target(other)
    assert mine.identity["tokenizer_sha256"] == other_target.identity["tokenizer_sha256"], "tokenizers must match"
    other_trained, _, _ = data_and_drafter(other, store, "other", "other-drafter", {})
    other_drafter = local_drafter_dir(store, store.key_for(other_trained.uri), other.storage.run_workdir("other"))
    scratch, scratch_eval, fp8_dataset = data_and_drafter(config, store, "fp8", "scratch", {})
    warm_config = config.model_copy(deep=True)
    warm_config.train.init_from = str(other_drafter)
    warm_config.train.init = "warm"
    warm = train.run(warm_config, fp8_dataset, "warm", store).manifest
    bf16_config = config.model_copy(deep=True)
    bf16_config.capture.encoding = "bf16"
    _, bf16_eval, _ = data_and_drafter(bf16_config, store, "bf16", "bf16", {})

    def per_epoch(result, step):
        manifest = result if isinstance(result, dict) else result.manifest
        return json.dumps([round(e["cond_acc"][step], 4) for e in manifest["history"]])

    report(samples=args.samples, epochs=args.epochs,
           scratch_cond_acc0_by_epoch=per_epoch(scratch, 0), scratch_cond_acc1_by_epoch=per_epoch(scratch, 1),
           warm_cond_acc0_by_epoch=per_epoch(warm, 0), warm_cond_acc1_by_epoch=per_epoch(warm, 1),
           fp8_heldout_cond_acc=json.dumps(scratch_eval["cond_acc"][:2]),
           bf16_heldout_cond_acc=json.dumps(bf16_eval["cond_acc"][:2]),
           fp8_cond_acc0_delta=scratch_eval["cond_acc"][0] - bf16_eval["cond_acc"][0])


if __name__ == "__main__":
    main()
