"""Which teacher trains the better drafter: the full distribution or the stored top-16?

On the tiny target, the same conversations are captured once with both teacher signals stored
(capture.teacher [last_hidden, topk]): the post-norm last hidden state, which training turns into the
target's full next-token distribution through its lm_head, and the target's top-16 log-probs. The
drafter is then trained twice on that one dataset, same seed and same batches, once per teacher
(train.teacher last_hidden / topk), and each exported drafter (the epoch with the best held-out
acceptance) is scored by the evaluate stage on the held-out split. Both trainings mask the positions
whose target top-1 is outside the draft vocabulary; the held-out metrics count them as misses.

    python benchmarks/exp_teacher.py [--samples 320] [--epochs 4] [--seeds 1] [--draft-vocab 1024]

With --seeds N the pair is trained with N training seeds; the per-seed differences and their range
show how much of the difference is noise. Last line: full_minus_topk_tau (held-out tau_simulated of
the full-distribution teacher minus that of the top-16 teacher, the mean over seeds).
"""

from __future__ import annotations

import argparse
import json
import statistics

from support import captured_dataset, published, report, trained_and_evaluated

TEACHERS = {"full": "last_hidden", "topk": "topk"}


def heldout(config, store, dataset_uri: str, teacher: str, seed: int) -> tuple[dict, dict]:
    """(the evaluation record, the train result) of a drafter trained with `teacher` and `seed`."""
    run_id = f"{teacher.replace('_', '-')}-seed{seed}"
    settings = {"train.teacher": teacher, "train.seed": seed}
    train, record = trained_and_evaluated(config, store, dataset_uri, run_id, **settings)
    return record.model_dump(mode="json"), published(store, train)["result"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=1, help="training seeds per teacher")
    parser.add_argument("--draft-vocab", type=int, default=1024, help="drafter.draft_vocab_size")
    args = parser.parse_args()
    overrides = [
        "capture.teacher=[last_hidden, topk]",
        f"drafter.draft_vocab_size={args.draft_vocab}",
        f"train.epochs={args.epochs}",
        "train.plateau.enabled=false",
    ]
    config, store, dataset_uri = captured_dataset(
        args.samples, overrides, eval_fraction=0.2, run_id="teachers"
    )

    results: dict[str, list[tuple[dict, dict]]] = {name: [] for name in TEACHERS}
    for seed in range(args.seeds):
        for name, teacher in TEACHERS.items():
            results[name].append(heldout(config, store, dataset_uri, teacher, seed))

    def per_seed(name: str, key: str, index: int | None = None) -> list[float]:
        values = [evaluation[key] for evaluation, _ in results[name]]
        return [round(v if index is None else v[index], 4) for v in values]

    def full_minus_topk(key: str, index: int | None = None) -> list[float]:
        pairs = zip(per_seed("full", key, index), per_seed("topk", key, index), strict=True)
        return [full - topk for full, topk in pairs]

    tau_deltas, acc_deltas = full_minus_topk("tau_simulated"), full_minus_topk("cond_acc", 0)
    first_eval, _ = results["topk"][0]
    report(
        samples=args.samples,
        epochs=args.epochs,
        seeds=args.seeds,
        draft_vocab_size=args.draft_vocab,
        heldout_samples=first_eval["samples"],
        heldout_inexpressible_fraction_step0=first_eval["inexpressible_fraction"][0],
        **{
            f"{name}_{what}": json.dumps(values)
            for name in TEACHERS
            for what, values in (
                ("tau_by_seed", per_seed(name, "tau_simulated")),
                ("cond_acc0_by_seed", per_seed(name, "cond_acc", 0)),
                ("cond_acc1_by_seed", per_seed(name, "cond_acc", 1)),
                ("chosen_epoch_by_seed", [result["chosen_epoch"] for _, result in results[name]]),
            )
        },
        full_minus_topk_cond_acc0=statistics.fmean(acc_deltas),
        full_minus_topk_tau_by_seed=json.dumps([round(d, 4) for d in tau_deltas]),
        full_minus_topk_tau_min=min(tau_deltas),
        full_minus_topk_tau_max=max(tau_deltas),
        full_minus_topk_tau=statistics.fmean(tau_deltas),
    )


if __name__ == "__main__":
    main()
