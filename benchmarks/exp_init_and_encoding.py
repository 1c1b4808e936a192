"""Two questions on the tiny target, each answered side by side in one run:

1. Init: a drafter trained from scratch on the target's own data vs one warm-started from the drafter
   of a DIFFERENT tiny target (same recipe and tokenizer, another seed and budget): the K2 -> K2.5
   plateau case in miniature. Prints cond_acc_0/1 per epoch for both.
2. Encoding: the same data captured with fp8 (e4m3, per-token-per-layer scales) and with bf16 aux
   states, same teacher (top-16 log-probs), trained alike; held-out cond_acc_0 of each.

    python benchmarks/exp_init_and_encoding.py [--samples 320] [--epochs 4]

The other target is built once and cached (about a minute). A second bf16 run with another training
seed shows how far held-out cond_acc moves for reasons other than the encoding.
Last line: fp8_cond_acc0_delta (fp8 - bf16).
"""

from __future__ import annotations

import argparse
import json

from support import published, report, scratch_config, stage


def captured(config, store, responses_uri: str, snapshot: str) -> str:
    capture = stage("capture", config, store, snapshot, responses_uri=responses_uri)
    return stage("dataset", config, store, snapshot, capture_uris=[capture.uri]).uri


def trained(config, store, dataset_uri: str, run_id: str, evaluate_it: bool = True):
    """(the train stage's manifest, the evaluation's summary or None)."""
    result = stage("train", config, store, run_id, dataset_uri=dataset_uri)
    evaluation = stage("evaluate", config, store, run_id, dataset_uri=dataset_uri) if evaluate_it else None
    return published(store, result), published(store, evaluation)["summary"] if evaluation else None


def regenerated(config, store, snapshot: str) -> str:
    stage("prompts", config, store, snapshot)
    return stage("generate", config, store, snapshot).uri


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    common = ["prompts.eval_fraction=0.25", "capture.parity.samples=0", "train.plateau.enabled=false"]
    config = scratch_config(common + [f"prompts.num_samples={args.samples}", f"train.epochs={args.epochs}"])
    other = scratch_config(
        common
        + [
            f"storage.root={config.storage.root}",
            "target.name=tiny-other",
            "target.tiny.seed=1",
            "target.tiny.train_steps=160",
            f"prompts.num_samples={args.samples // 2}",
            "train.epochs=2",
        ]
    )
    from pipeline.engines.target import describe_target
    from pipeline.stages.evaluate import local_drafter_dir
    from pipeline.storage import open_store

    store = open_store(config.storage)
    assert (
        describe_target(config).identity["tokenizer_sha256"]
        == describe_target(other).identity["tokenizer_sha256"]
    )
    other_responses = regenerated(other, store, "other")
    other_run, _ = trained(other, store, captured(other, store, other_responses, "other"), "other", False)
    other_drafter = local_drafter_dir(
        store, store.key_for(other_run["uri"]), other.storage.run_workdir("other")
    )

    responses = regenerated(config, store, "mine")
    fp8_dataset = captured(config, store, responses, "mine-fp8")
    scratch, fp8_eval = trained(config, store, fp8_dataset, "scratch")
    warm_config = config.model_copy(deep=True)
    warm_config.train.init_from = str(other_drafter)
    warm_config.train.init = "warm"
    warm, _ = trained(warm_config, store, fp8_dataset, "warm", False)
    bf16_config = config.model_copy(deep=True)
    bf16_config.capture.encoding = "bf16"
    bf16_dataset = captured(bf16_config, store, responses, "mine-bf16")
    _, bf16_eval = trained(bf16_config, store, bf16_dataset, "bf16")
    # the same bf16 run with another training seed: how much cond_acc moves for reasons other than encoding
    reseeded = bf16_config.model_copy(deep=True)
    reseeded.train.seed = 1
    _, reseeded_eval = trained(reseeded, store, bf16_dataset, "bf16-seed1")

    def per_epoch(result, step):
        return json.dumps([round(e["cond_acc"][step], 4) for e in result["history"]])

    report(
        samples=args.samples,
        epochs=args.epochs,
        heldout_samples=fp8_eval["samples"],
        scratch_cond_acc0_by_epoch=per_epoch(scratch, 0),
        scratch_cond_acc1_by_epoch=per_epoch(scratch, 1),
        warm_cond_acc0_by_epoch=per_epoch(warm, 0),
        warm_cond_acc1_by_epoch=per_epoch(warm, 1),
        fp8_heldout_cond_acc=json.dumps(fp8_eval["cond_acc"][:2]),
        bf16_heldout_cond_acc=json.dumps(bf16_eval["cond_acc"][:2]),
        bf16_seed1_heldout_cond_acc=json.dumps(reseeded_eval["cond_acc"][:2]),
        bf16_seed_cond_acc0_delta=reseeded_eval["cond_acc"][0] - bf16_eval["cond_acc"][0],
        fp8_cond_acc0_delta=fp8_eval["cond_acc"][0] - bf16_eval["cond_acc"][0],
    )


if __name__ == "__main__":
    main()
