"""Warm start against scratch on a target whose frequent output tokens carry other ids, and train.init auto.

    python benchmarks/exp_warm_start_vocab_shift.py [--incumbent-epochs 10] [--epochs 5] [--plateau-steps 60]
        [--swap-fraction 1.0] [--step0-bar GATE_BAR] [--nproc 1] [--seed 0]

Target A is configs/local.yaml's tiny target; its drafter (the incumbent) is trained on A's own data, and
its draft vocabulary D is the draft_vocab_size ids A's answers use most. Target B computes exactly what A
computes, greedy text and hidden states included, with its token ids relabelled: one permutation of the
vocabulary moves the rows of embed_tokens and lm_head and the ids of the tokenizer's vocabulary together.
The special tokens (pad, eos and the chat-template roles) keep their ids. The permutation swaps ids inside
D with ids outside it (--swap-fraction of the pairs; all by default), so B's frequent tokens lie outside
the incumbent's vocabulary. On B's data, each with plateau stopping off:
- scratch: a new drafter (its vocabulary B's own frequent ids);
- warm: the incumbent, fine-tuned;
- auto: train.init auto from the incumbent as the registry holds it (published with its lineage: its
  held-out evaluation on A), with its probe bar (the gate's step-0 bar, --step0-bar) and vocabulary check;
- auto_forced_warm: the same with the probe bar at 0 and the vocabulary check off
  (train.auto_init.max_vocabulary_gap 1), so that it warm-starts and the in-run plateau check must
  restart it from scratch: its restart bar is the incumbent's held-out cond_acc_0 on A less
  train.auto_init.plateau_shortfall_vs_own, over the gate's bar.
Prints the share of B's held-out assistant tokens outside the incumbent's vocabulary, each run's held-out
cond_acc_0, cond_acc_1 and inexpressible fraction per epoch, held-out tau, training cond_acc_0 by step,
the auto runs' attempts with their reasons, and last auto_forced_warm_minus_scratch_heldout_tau.

Found (2026-12-03, one CPU core, 21.6 min with the defaults, 24.7 min with --swap-fraction 0.5): this
reproduces the K2 -> K2.5 plateau. A warm start keeps the incumbent's vocabulary (its d2t,
pipeline.stages.train.draft_vocabulary): it can never emit a token outside D, such positions carry no loss
and count as misses (pipeline/drafter/ttt.py), so held-out cond_acc_0 is capped at 1 - the inexpressible
fraction, whatever the steps. With every pair swapped, 97.5% of B's held-out assistant tokens are outside D
(0% of A's): warm sits at cond_acc_0 0.026 (tau 1.03) for 5 epochs while scratch reaches 0.738 (tau 3.39).
With half swapped, 60% are outside D: warm goes 0.344 -> 0.385 (K2.5: 38.0 -> 38.3%) while scratch reaches
0.755. Auto ended with the scratch result in every run, but not always by design: with every pair swapped
its probe scores the incumbent at 0.022 (under the bar of 0.3: scratch), and with the bar at 0 it
warm-starts and the warm attempt stops with warm_plateau after 65 steps and restarts from scratch. With
half swapped the probe (0.345) clears 0.3, and the stalled warm start was caught only because one logged
interval dipped to 0.294, under the bar the in-run check requires: a stall above the gate's step-0 bar is
not restarted. With --step0-bar 0.6 the probe chooses scratch and the bar-0 warm start stops after 65 steps
at 0.319. Since then (auto_bar0 became auto_forced_warm): auto's probe also refuses an incumbent whose
draft vocabulary misses the new data's tokens, and a stalled warm start is restarted under the incumbent's
own held-out level less a shortfall, not only under the gate's bar (docs/BENCHMARKS.md). The signed
permutation (exp_warm_start_plateau.py) changed what the drafter reads, a linear remap gradient steps
relearn; this changes which ids it may write, fixed when the run starts.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from exp_warm_start_plateau import attempts_of, data_of, heldout_curve
from support import published, report, scratch_config, stage


def vocab_shift(
    vocab_size: int, kept: set[int], used_ids: list[int], fraction: float, seed: int
) -> list[int]:
    """A permutation of the vocabulary (new id of each old id) that swaps ids inside `used_ids` with ids
    outside it, `fraction` of the possible pairs, both sides picked at random; ids in `kept` stay."""
    import torch

    inside = sorted(set(used_ids) - kept)
    outside = sorted(set(range(vocab_size)) - set(used_ids) - kept)
    pairs = round(fraction * min(len(inside), len(outside)))
    generator = torch.Generator().manual_seed(seed)
    moved_in = [inside[i] for i in torch.randperm(len(inside), generator=generator)[:pairs].tolist()]
    moved_out = [outside[i] for i in torch.randperm(len(outside), generator=generator)[:pairs].tolist()]
    perm = list(range(vocab_size))
    for a, b in zip(moved_in, moved_out, strict=True):
        perm[a], perm[b] = b, a
    return perm


def special_ids(model_dir: Path) -> set[int]:
    """The ids that must not move: the tokenizer's added (special) tokens and the config's named ids."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    ids = {token["id"] for token in tokenizer["added_tokens"]}
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = config.get(name)
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return ids


def relabelled_copy(source: Path, dest: Path, perm: list[int]) -> None:
    """A Llama target (with a `tokenizers` BPE) computing what `source` computes, its token ids relabelled:
    old id t becomes perm[t] in the embedding, the LM head and the tokenizer's vocabulary alike."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    inverse = torch.empty(len(perm), dtype=torch.long)
    inverse[torch.tensor(perm)] = torch.arange(len(perm))  # row new id <- old id
    with torch.no_grad():
        model.model.embed_tokens.weight.data = model.model.embed_tokens.weight.data[inverse].clone()
        model.lm_head.weight.data = model.lm_head.weight.data[inverse].clone()
    shutil.rmtree(dest, ignore_errors=True)
    model.save_pretrained(dest)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = {token: perm[old] for token, old in tokenizer["model"]["vocab"].items()}
    for token in tokenizer["added_tokens"]:
        assert perm[token["id"]] == token["id"], "special tokens keep their ids"
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    for path in source.iterdir():
        if path.name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(path, dest / path.name)


def same_greedy_text(model_a: Path, model_b: Path, prompt: str = "def add(a, b):", tokens: int = 24) -> bool:
    """Whether A and B answer a prompt with the same text (the relabelling changes ids, not the function)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = []
    for path in (model_a, model_b):
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
        texts.append(tokenizer.decode(out[0]))
    return texts[0] == texts[1]


def share_outside(store, dataset_uri: str, used_ids: list[int], split: str) -> float:
    """The share of a dataset split's assistant tokens whose id is outside `used_ids`."""
    from pipeline.records import read_dataset
    from pipeline.training.stream import ShardRef, assistant_token_counts

    dataset = read_dataset(store, dataset_uri)
    shards = [ShardRef.from_manifest(entry) for entry in getattr(dataset, f"{split}_shards")]
    counts = assistant_token_counts(store, shards, dataset.contract.vocab_size)
    return 1.0 - counts[used_ids].sum().item() / counts.sum().item()


def used_ids_of(drafter_dir: Path) -> list[int]:
    """The target ids of a drafter's draft vocabulary (from its d2t)."""
    from pipeline.drafter.export import read_drafter_dir
    from pipeline.drafter.vocab import mapping_from_d2t

    _, tensors, contract = read_drafter_dir(drafter_dir)
    return mapping_from_d2t(tensors["d2t"], contract["vocab_size"]).used_ids.tolist()


def heldout_inexpressible(manifest: dict) -> list[float]:
    return [round(entry["heldout"]["inexpressible_fraction"][0], 4) for entry in manifest["history"]]


def best_tau(manifest: dict) -> float:
    return max(manifest["result"]["heldout_tau_by_epoch"])


def own_evaluation(manifest: dict) -> dict:
    """A train manifest's best held-out epoch, as a promoted version's lineage holds its evaluation."""
    best = max((entry["heldout"] for entry in manifest["history"]), key=lambda held: held["tau_simulated"])
    return {"cond_acc": best["cond_acc"], "tau_simulated": best["tau_simulated"]}


def registry_incumbent(store, target: str, drafter_dir: Path, run_id: str, manifest: dict) -> str:
    """The incumbent published to B's registry with its lineage's evaluation on A: registry:<version>."""
    from pipeline.ops.registry import publish_version

    lineage = {"run_id": run_id, "eval": own_evaluation(manifest)}
    version, _ = publish_version(
        store, target, drafter_dir, lineage, {"steps": 3, "topk": 1, "draft_tokens": 4}
    )
    return f"registry:{version}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--incumbent-epochs", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--plateau-steps", type=int, default=60)
    parser.add_argument("--swap-fraction", type=float, default=1.0)
    parser.add_argument("--nproc", type=int, default=1, help="training ranks (train.nproc)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--step0-bar",
        type=float,
        default=None,
        help="gate.min_cond_acc[0] for B's runs: auto's default probe bar and the in-run plateau check's "
        "ceiling (default the config's)",
    )
    args = parser.parse_args()
    common = [
        "capture.parity.samples=0",
        "train.plateau.enabled=false",
        "train.log_every=5",
        f"train.nproc={args.nproc}",
    ]
    config_a = scratch_config(common + [f"train.epochs={args.incumbent_epochs}"])
    from pipeline.engines.target import describe_target
    from pipeline.stages.evaluate import local_drafter_dir
    from pipeline.storage import open_store

    store = open_store(config_a.storage)
    model_a = describe_target(config_a).model_dir
    dataset_a = data_of(config_a, store, "a")
    incumbent_run = stage("train", config_a, store, "incumbent", dataset_uri=dataset_a)
    incumbent = local_drafter_dir(
        store, store.key_for(incumbent_run.uri), config_a.storage.run_workdir("inc")
    )
    draft_vocab = used_ids_of(incumbent)
    kept = special_ids(model_a)
    vocab_size = json.loads((model_a / "config.json").read_text())["vocab_size"]
    perm = vocab_shift(vocab_size, kept, draft_vocab, args.swap_fraction, args.seed)
    model_b = Path(config_a.storage.local_cache) / f"tiny-vocab-shifted-{args.swap_fraction}-{args.seed}"
    relabelled_copy(model_a, model_b, perm)
    b_settings = [
        f"storage.root={config_a.storage.root}",
        "target.name=tiny-vocab-shifted",
        "target.source=hf",
        f"target.model_path={model_b}",
        f"target.revision=vocab-shift-{args.swap_fraction}-{args.seed}",
        f"train.epochs={args.epochs}",
        f"train.auto_init.plateau_steps={args.plateau_steps}",
        *([f"gate.min_cond_acc=[{args.step0_bar}]"] if args.step0_bar is not None else []),
    ]
    config_b = scratch_config(common + b_settings)
    dataset_b = data_of(config_b, store, "b")
    incumbent_manifest = published(store, incumbent_run)
    in_registry = registry_incumbent(store, config_b.target.name, incumbent, "incumbent", incumbent_manifest)
    runs, outputs = {}, {}
    for name, init in (
        ("scratch", ["train.init=scratch"]),
        ("warm", ["train.init=warm", f"train.init_from={incumbent}"]),
        ("auto", ["train.init=auto", f"train.init_from={in_registry}"]),
        (
            "auto_forced_warm",
            [
                "train.init=auto",
                f"train.init_from={in_registry}",
                "train.auto_init.min_probe_cond_acc=0.0",
                "train.auto_init.max_vocabulary_gap=1.0",
            ],
        ),
    ):
        config = scratch_config(common + b_settings + init)
        outputs[name] = stage("train", config, store, name, dataset_uri=dataset_b)
        runs[name] = published(store, outputs[name])
    scratch = local_drafter_dir(
        store, store.key_for(outputs["scratch"].uri), config_b.storage.run_workdir("s")
    )
    report(
        step0_bar=config_b.gate.min_cond_acc[0],
        special_ids_kept=json.dumps(sorted(kept)),
        ids_swapped_out_of_incumbent_vocab=sum(1 for t in draft_vocab if perm[t] != t),
        b_same_greedy_text_as_a=same_greedy_text(model_a, model_b),
        a_heldout_share_outside_incumbent_vocab=share_outside(store, dataset_a, draft_vocab, "eval"),
        b_heldout_share_outside_incumbent_vocab=share_outside(store, dataset_b, draft_vocab, "eval"),
        b_heldout_share_outside_scratch_vocab=share_outside(store, dataset_b, used_ids_of(scratch), "eval"),
        incumbent_heldout_tau_on_a=best_tau(incumbent_manifest),
        incumbent_heldout_cond_acc0_on_a_by_epoch=json.dumps(heldout_curve(incumbent_manifest, 0)),
        **{f"{name}_heldout_cond_acc0_by_epoch": json.dumps(heldout_curve(m, 0)) for name, m in runs.items()},
        **{f"{name}_heldout_cond_acc1_by_epoch": json.dumps(heldout_curve(m, 1)) for name, m in runs.items()},
        **{
            f"{name}_heldout_inexpressible0_by_epoch": json.dumps(heldout_inexpressible(m))
            for name, m in runs.items()
        },
        **{f"{name}_heldout_tau": best_tau(m) for name, m in runs.items()},
        incumbent_own_heldout_cond_acc0=own_evaluation(incumbent_manifest)["cond_acc"][0],
        auto_forced_warm_restart_bar=json.dumps(
            runs["auto_forced_warm"]["attempts"][0]["init"]["restart_under"]
        ),
        **{f"{name}_attempts": json.dumps(attempts_of(runs[name])) for name in ("auto", "auto_forced_warm")},
        warm_cond_acc0_by_step=json.dumps(runs["warm"]["attempts"][0]["cond_acc0_by_step"]),
        scratch_cond_acc0_by_step=json.dumps(runs["scratch"]["attempts"][0]["cond_acc0_by_step"]),
        warm_minus_scratch_heldout_tau=best_tau(runs["warm"]) - best_tau(runs["scratch"]),
        auto_minus_scratch_heldout_tau=best_tau(runs["auto"]) - best_tau(runs["scratch"]),
        auto_forced_warm_minus_scratch_heldout_tau=best_tau(runs["auto_forced_warm"])
        - best_tau(runs["scratch"]),
    )


if __name__ == "__main__":
    main()
