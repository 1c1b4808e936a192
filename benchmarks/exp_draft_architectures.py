"""Which draft architecture for a DeepSeek-shaped target: eagle3 (a Llama layer), eagle3.1 (EAGLE-3.1's norms)
or eagle3-mla (an MLA layer), trained on the same data.

    python benchmarks/exp_draft_architectures.py [--samples 240] [--epochs 6] [--seeds 0 1 2]

The target is the rehearsal's tiny DeepSeek-V3-architecture model (harness.rehearsal.TARGET_RECIPE: MLA +
MoE, Kimi-K2.5's shape at a tiny width). Its own answers to the demo prompts are captured once; each
architecture is then trained on that one dataset with each seed (same batches for the same seed, plateau
stopping off), and each exported drafter (the epoch with the best held-out acceptance) is scored by the
evaluate stage on the held-out split.

Prints, per architecture:
- heldout_tau_<arch>= the mean over seeds (arch: eagle3, eagle3.1, eagle3-mla), with _ci_low/_ci_high (a
  Student-t 95% interval over seeds) and _by_seed;
- parameters_<arch>= (trained and exported; the shared embedding is not);
- train_tok_s_<arch>= trained tokens per second of the training loop (all TTT steps), the mean over seeds;
and last mla_minus_eagle3_tau= the mean over seeds of the per-seed difference, with its interval.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from support import captured_dataset, published, report, trained_and_evaluated

ARCHITECTURES = ("eagle3", "eagle3.1", "eagle3-mla")


def target_overrides() -> list[str]:
    """The rehearsal's tiny Kimi-like target in place of configs/local.yaml's Llama one."""
    from harness.rehearsal import TARGET_RECIPE

    recipe = json.dumps(TARGET_RECIPE.model_dump(exclude_none=True))
    return [
        "target.name=tiny-kimi",
        "target.source=tiny",
        f"target.tiny={recipe}",
        "target.trust_remote_code=true",
    ]


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): a Student-t 95% interval of the mean over seeds."""
    from pipeline.spread import t_quantile

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    half = t_quantile(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


def trained(config, store, dataset_uri: str, architecture: str, seed: int) -> dict:
    """Held-out tau, parameters and the training loop's tokens/s of one architecture and seed."""
    from pipeline.records import read_dataset
    from pipeline.stages.evaluate import local_drafter_dir

    run_id = f"{architecture.replace('.', '')}-seed{seed}"
    settings = {"drafter.architecture": architecture, "train.seed": seed}
    train, record = trained_and_evaluated(config, store, dataset_uri, run_id, **settings)
    result = published(store, train)["result"]
    epochs = result["steps_this_attempt"] / result["steps_per_epoch"]
    tokens = read_dataset(store, dataset_uri).totals["train"].tokens
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as fetched:
        drafter_dir = local_drafter_dir(store, store.key_for(train.uri), Path(fetched) / run_id)
        weights = load_file(str(drafter_dir / "model.safetensors"))
    parameters = sum(tensor.numel() for name, tensor in weights.items() if name not in ("d2t", "t2d"))
    return {
        "tau": record.tau_simulated,
        "cond_acc_0": record.cond_acc[0],
        "parameters": parameters,
        "train_tok_s": tokens * epochs / result["seconds_this_attempt"] / result["world_size"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if len(args.seeds) < 2:
        parser.error("--seeds needs at least 2 seeds: the intervals are over seeds")
    overrides = [*target_overrides(), f"train.epochs={args.epochs}", "train.plateau.enabled=false"]
    config, store, dataset_uri = captured_dataset(args.samples, overrides, eval_fraction=0.2, run_id="data")
    runs = {
        arch: [trained(config, store, dataset_uri, arch, seed) for seed in args.seeds]
        for arch in ARCHITECTURES
    }

    values: dict[str, object] = {"seeds": json.dumps(args.seeds), "epochs": args.epochs}
    for arch, by_seed in runs.items():
        name = arch
        taus = [run["tau"] for run in by_seed]
        mean, low, high = interval(taus)
        values.update(
            {
                f"heldout_tau_{name}_by_seed": json.dumps([round(t, 4) for t in taus]),
                f"heldout_tau_{name}_ci_low": low,
                f"heldout_tau_{name}_ci_high": high,
                f"heldout_tau_{name}": mean,
                f"heldout_cond_acc_0_{name}": statistics.fmean(run["cond_acc_0"] for run in by_seed),
                f"parameters_{name}": by_seed[0]["parameters"],
                f"train_tok_s_{name}": statistics.fmean(run["train_tok_s"] for run in by_seed),
            }
        )
    for other in ("eagle3.1", "eagle3-mla"):
        deltas = [b["tau"] - a["tau"] for a, b in zip(runs["eagle3"], runs[other], strict=True)]
        mean, low, high = interval(deltas)
        name = "eagle31" if other == "eagle3.1" else "mla"
        values.update(
            {
                f"{name}_minus_eagle3_tau_by_seed": json.dumps([round(d, 4) for d in deltas]),
                f"{name}_minus_eagle3_tau_ci_low": low,
                f"{name}_minus_eagle3_tau_ci_high": high,
                f"{name}_minus_eagle3_tau": mean,
            }
        )
    mla = values.pop("mla_minus_eagle3_tau")
    report(**values, mla_minus_eagle3_tau=mla)


if __name__ == "__main__":
    main()
