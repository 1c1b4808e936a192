"""Warm start against scratch on a target whose hidden states lie along other axes, and train.init auto.

    python benchmarks/exp_warm_start_plateau.py [--incumbent-epochs 12] [--epochs 6] [--plateau-steps 60]

Target A is configs/local.yaml's tiny target; its drafter (the incumbent) is trained well on A's own data.
Target B computes exactly what A computes, greedy text included, but its residual stream is a signed
permutation of A's: every hidden state, the embedding and so every feature the drafter reads lie along
other axes. On B's data, each with plateau stopping off:
- scratch: a new drafter;
- warm: the incumbent, fine-tuned (what the Kimi-K2 -> K2.5 user did);
- auto: train.init auto from the incumbent (its probe, then a warm start only above the bar, and a warm
  start that stalls restarted from scratch).
Prints each one's held-out cond_acc_0 and cond_acc_1 per epoch, training cond_acc_0 by step, auto's
attempts with their reasons, and last auto_minus_scratch_heldout_tau.

Found (docs/BENCHMARKS.md): this does NOT reproduce the K2 -> K2.5 plateau. The warm start recovers within
about 25 steps and ends ahead of scratch: only the drafter's input side (fc, the embedding's norm) reads
the target's axes, and relearning it is a linear remap; the rest of the drafter works in its own space.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from support import published, report, scratch_config, stage


def signed_permutation_copy(source: Path, dest: Path, seed: int) -> None:
    """A Llama target whose residual stream is a signed permutation of `source`'s: the same function,
    hidden states along other axes. Every weight reading the residual stream has its input columns
    permuted and signed, every weight writing it its output rows, every RMSNorm its weights permuted."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(hidden, generator=generator)
    sign = torch.randint(0, 2, (hidden,), generator=generator).float() * 2 - 1

    def reads(linear) -> None:  # [out, hidden]: input columns
        linear.weight.data = linear.weight.data[:, perm] * sign

    def writes(linear) -> None:  # [hidden, in]: output rows
        linear.weight.data = linear.weight.data[perm] * sign[:, None]

    def norm(layer) -> None:
        layer.weight.data = layer.weight.data[perm]

    with torch.no_grad():
        model.model.embed_tokens.weight.data = model.model.embed_tokens.weight.data[:, perm] * sign
        for layer in model.model.layers:
            norm(layer.input_layernorm)
            norm(layer.post_attention_layernorm)
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                reads(linear)
            writes(layer.self_attn.o_proj)
            reads(layer.mlp.gate_proj)
            reads(layer.mlp.up_proj)
            writes(layer.mlp.down_proj)
        norm(model.model.norm)
        reads(model.lm_head)
    shutil.rmtree(dest, ignore_errors=True)
    model.save_pretrained(dest)
    for path in source.iterdir():
        if path.name.startswith("tokenizer") or path.name in (
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            shutil.copy(path, dest / path.name)


def data_of(config, store, snapshot: str) -> str:
    for name in ("prompts", "generate"):
        stage(name, config, store, snapshot)
    capture = stage("capture", config, store, snapshot)
    return stage("dataset", config, store, snapshot, capture_uris=[capture.uri]).uri


def attempts_of(manifest: dict) -> list[dict]:
    """Each training attempt of a train manifest: how it began, why, how it ended, its cond_acc_0 by step."""
    return [
        {
            "init": attempt["init"]["chosen"],
            "reason": attempt["init"]["reason"],
            "stop": attempt["stop_reason"],
            "steps": attempt["global_steps"],
            "cond_acc0_by_step": attempt["cond_acc0_by_step"],
        }
        for attempt in manifest["attempts"]
    ]


def heldout_curve(manifest: dict, step: int) -> list[float]:
    return [round(entry["heldout"]["cond_acc"][step], 4) for entry in manifest["history"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--incumbent-epochs", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--plateau-steps", type=int, default=60)
    args = parser.parse_args()
    common = ["capture.parity.samples=0", "train.plateau.enabled=false", "train.log_every=5"]
    config_a = scratch_config(common + [f"train.epochs={args.incumbent_epochs}"])
    from pipeline.engines.target import describe_target
    from pipeline.stages.evaluate import local_drafter_dir
    from pipeline.storage import open_store

    store = open_store(config_a.storage)
    model_a = describe_target(config_a).model_dir
    model_b = Path(config_a.storage.local_cache) / "tiny-permuted"
    signed_permutation_copy(model_a, model_b, seed=0)
    b_settings = [
        f"storage.root={config_a.storage.root}",
        "target.name=tiny-permuted",
        "target.source=hf",
        f"target.model_path={model_b}",
        "target.revision=permuted-0",
        f"train.epochs={args.epochs}",
        f"train.auto_init.plateau_steps={args.plateau_steps}",
    ]
    config_b = scratch_config(common + b_settings)

    incumbent_run = stage("train", config_a, store, "incumbent", dataset_uri=data_of(config_a, store, "a"))
    incumbent = local_drafter_dir(
        store, store.key_for(incumbent_run.uri), config_a.storage.run_workdir("inc")
    )
    dataset_b = data_of(config_b, store, "b")
    runs = {}
    for name, init in (
        ("scratch", ["train.init=scratch"]),
        ("warm", ["train.init=warm"]),
        ("auto", ["train.init=auto"]),
    ):
        config = scratch_config(common + b_settings + init + [f"train.init_from={incumbent}"])
        runs[name] = published(store, stage("train", config, store, name, dataset_uri=dataset_b))
    incumbent_manifest = published(store, incumbent_run)
    auto = runs["auto"]
    report(
        incumbent_heldout_tau_on_a=max(incumbent_manifest["result"]["heldout_tau_by_epoch"]),
        **{f"{name}_heldout_cond_acc0_by_epoch": json.dumps(heldout_curve(m, 0)) for name, m in runs.items()},
        **{f"{name}_heldout_cond_acc1_by_epoch": json.dumps(heldout_curve(m, 1)) for name, m in runs.items()},
        **{f"{name}_heldout_tau": max(m["result"]["heldout_tau_by_epoch"]) for name, m in runs.items()},
        auto_attempts=json.dumps(attempts_of(auto)),
        warm_cond_acc0_by_step=json.dumps(runs["warm"]["attempts"][0]["cond_acc0_by_step"]),
        scratch_cond_acc0_by_step=json.dumps(runs["scratch"]["attempts"][0]["cond_acc0_by_step"]),
        auto_minus_scratch_heldout_tau=max(auto["result"]["heldout_tau_by_epoch"])
        - max(runs["scratch"]["result"]["heldout_tau_by_epoch"]),
    )


if __name__ == "__main__":
    main()
