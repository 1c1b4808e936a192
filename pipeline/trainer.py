"""The training worker: one process per rank, started by torchrun or the deepspeed launcher.

The launcher side (pipeline.stages.train) downloads the dataset shards, writes a worker spec and
starts this as a separate process group; nothing here runs inside an Airflow worker.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import RunConfig, resolve_project_path
from pipeline.contract import ContractMismatch
from pipeline.drafter_model import DrafterArch, Eagle3Drafter
from pipeline.export import export_drafter, read_drafter_dir
from pipeline.progress import Progress
from pipeline.target import load_frozen_tensors, text_config
from pipeline.train_data import CaptureDataset, collate, epoch_order, rank_batches
from pipeline.ttt import MetricCounts, teacher_from_last_hidden, teacher_from_topk, ttt_loss_and_counts
from pipeline.vocab import VocabMapping, build_mapping, mapping_from_d2t

log = logging.getLogger(__name__)
CHECKPOINTS_KEPT = 2


class DraftObjective(nn.Module):
    """Wraps the drafter with the frozen teacher pieces; forward returns (loss, metric counts).

    The teacher comes from the post-norm last hidden state through the target's lm_head, or from
    stored top-K log-probs, whichever `teacher` names.
    """

    def __init__(self, drafter: Eagle3Drafter, lm_head_weight: torch.Tensor | None, teacher: str,
                 ttt_steps: int, decay: float, chunk: int):
        super().__init__()
        self.drafter = drafter
        if teacher == "last_hidden" and lm_head_weight is None:
            raise ValueError("a last_hidden teacher needs the target's lm_head")
        self.teacher = teacher
        if lm_head_weight is not None and teacher == "last_hidden":
            self.register_buffer("teacher_lm_head", lm_head_weight.detach().clone(), persistent=False)
        used_ids = torch.arange(drafter.arch.draft_vocab_size) + drafter.d2t
        draft_index = torch.full((drafter.arch.vocab_size,), -1, dtype=torch.long)
        draft_index[used_ids] = torch.arange(drafter.arch.draft_vocab_size)
        self.register_buffer("used_ids", used_ids, persistent=False)
        self.register_buffer("draft_index", draft_index, persistent=False)
        self.ttt_steps, self.decay, self.chunk = ttt_steps, decay, chunk

    def forward(self, input_ids, loss_mask, aux, last_hidden=None, topk_ids=None, topk_logprobs=None):
        if self.teacher == "last_hidden":
            teacher = teacher_from_last_hidden(last_hidden, self.teacher_lm_head, self.used_ids)
        else:
            teacher = teacher_from_topk(topk_ids, topk_logprobs, self.draft_index, self.drafter.arch.draft_vocab_size)
        h_outs = self.drafter.ttt_forward(aux, input_ids, self.ttt_steps, self.chunk)
        return ttt_loss_and_counts(h_outs, self.drafter.logits, input_ids, loss_mask, teacher,
                                   self.drafter.d2t, self.decay)


def choose_teacher(requested: str, available: set[str]) -> str:
    """The teacher signal to train on: the requested one, or (auto) last_hidden when stored, else top-k."""
    if requested != "auto":
        if requested not in available:
            raise ValueError(f"train.teacher {requested!r} is not in every capture shard (they carry {sorted(available)})")
        return requested
    for kind in ("last_hidden", "topk"):
        if kind in available:
            return kind
    raise ValueError("the capture shards carry no common teacher signal")


def drafter_arch(config: RunConfig, target_dir: Path, aux_layer_ids: list[int], draft_vocab_size: int) -> DrafterArch:
    """Drafter shape: explicit drafter.* settings, else the target's own attention/MLP shape."""
    target = text_config(target_dir)
    settings = config.drafter
    hidden = int(target["hidden_size"])
    heads = settings.num_heads or int(target["num_attention_heads"])
    rope = target.get("rope_parameters") or {}
    return DrafterArch(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=settings.num_kv_heads or int(target.get("num_key_value_heads") or heads),
        head_dim=settings.head_dim or int(target.get("head_dim") or hidden // heads),
        intermediate_size=settings.intermediate_size or int(target["intermediate_size"]),
        vocab_size=int(target["vocab_size"]),
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=list(aux_layer_ids),
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", target.get("rope_theta", 10000.0))),
        max_position_embeddings=settings.max_position_embeddings or int(target.get("max_position_embeddings", 2048)),
    )


def check_warm_start_contract(init_contract: dict[str, Any], data_contract: dict[str, Any]) -> None:
    """A warm start only makes sense when the old drafter reads features the same way."""
    problems = []
    for field in ("aux_layer_ids", "hidden_size", "teacher_norm", "layer_convention", "vocab_size"):
        if init_contract.get(field) != data_contract.get(field):
            problems.append(f"{field}: drafter {init_contract.get(field)!r} vs data {data_contract.get(field)!r}")
    if problems:
        raise ContractMismatch("refusing warm start: the initial drafter was trained on a different capture "
                               "contract:\n  " + "\n  ".join(problems))


def build_model(config: RunConfig, spec: dict[str, Any], dataset: CaptureDataset,
                frozen: dict[str, torch.Tensor]) -> tuple[Eagle3Drafter, VocabMapping]:
    target_dir = Path(spec["target_dir"])
    contract = spec["contract"]
    vocab_size = int(text_config(target_dir)["vocab_size"])
    init_dir = spec.get("init_dir")
    if init_dir:
        _, init_tensors, init_contract = read_drafter_dir(init_dir)
        check_warm_start_contract(init_contract, contract)
        mapping = mapping_from_d2t(init_tensors["d2t"], vocab_size)
    else:
        mapping = build_mapping(dataset.assistant_token_counts(vocab_size), config.drafter.draft_vocab_size)
    arch = drafter_arch(config, target_dir, contract["aux_layer_ids"], mapping.draft_vocab_size)
    model = Eagle3Drafter(arch, frozen["embed"].float())
    model.set_vocab_mapping(mapping.d2t, mapping.t2d)
    with torch.no_grad():
        if init_dir:
            model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in init_tensors.items()})
        else:
            # Start the draft head from the target's own head rows for the draft vocabulary.
            model.lm_head.weight.copy_(frozen["lm_head"].float()[mapping.used_ids])
            model.norm.weight.copy_(frozen["norm"].float())
    return model, mapping


def deepspeed_config(config: RunConfig, total_steps: int) -> dict[str, Any]:
    settings = config.train
    ds = json.loads(resolve_project_path(settings.deepspeed_config).read_text())
    ds["train_micro_batch_size_per_gpu"] = settings.micro_batch_size
    ds["gradient_accumulation_steps"] = 1
    ds["gradient_clipping"] = settings.grad_clip
    ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    ds["optimizer"]["params"].update({"lr": settings.learning_rate, "weight_decay": settings.weight_decay})
    ds["scheduler"] = {"type": "WarmupCosineLR", "params": {
        "total_num_steps": max(1, total_steps), "warmup_num_steps": max(1, int(settings.warmup_ratio * total_steps)),
        "warmup_type": "linear", "cos_min_ratio": 0.1}}
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": settings.precision == "bf16"}
    ds["steps_per_print"] = 10 ** 9
    return ds


def _init_distributed():
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    cpu = get_accelerator().device_name() == "cpu"
    if cpu:
        # DeepSpeed would JIT-compile a shared-memory all-reduce (~2 min per machine); gloo is enough here.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
    return cpu


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(tensor)
    return tensor


class MetricsLog:
    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, global_step: int) -> None:
        """Drop records of steps a resumed run will redo, so none appears twice."""
        if self.enabled and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["global_step"] <= global_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")


def plateau_reached(history: list[dict[str, Any]], config: RunConfig) -> bool:
    plateau = config.train.plateau
    if not plateau.enabled or len(history) <= plateau.window_epochs:
        return False
    current = history[-1]["cond_acc"][0]
    before = history[-1 - plateau.window_epochs]["cond_acc"][0]
    threshold = config.gate.min_cond_acc[0] if config.gate.min_cond_acc else 1.0
    return current - before < plateau.min_gain and current < threshold


def _save_checkpoint(engine, ckpt_dir: Path, tag: str, state: dict[str, Any], rank: int) -> None:
    state = dict(state, rng_cpu=torch.get_rng_state())
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state)
    if rank == 0:
        tags = sorted((p for p in ckpt_dir.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        for old in tags[:-CHECKPOINTS_KEPT]:
            shutil.rmtree(old, ignore_errors=True)


def train(spec: dict[str, Any]) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    config = RunConfig.model_validate(spec["config"])
    settings = config.train
    _init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(settings.seed)
    workdir = Path(spec["workdir"])
    ckpt_dir = workdir / "checkpoints"
    dataset = CaptureDataset(spec["train_shards"], settings.max_length)
    frozen = load_frozen_tensors(Path(spec["target_dir"]))
    model, mapping = build_model(config, spec, dataset, frozen)
    dtype = torch.bfloat16 if config.train.precision == "bf16" else torch.float32
    teacher = choose_teacher(settings.teacher, dataset.teachers())
    objective = DraftObjective(model, frozen["lm_head"].to(dtype), teacher, settings.ttt_steps,
                               settings.loss_decay, settings.attention_chunk)
    steps_per_epoch = len(rank_batches(list(range(len(dataset))), 0, world, settings.micro_batch_size))
    if steps_per_epoch == 0:
        raise RuntimeError(f"{len(dataset)} training samples are too few for {world} ranks")
    engine, _, _, scheduler = deepspeed.initialize(
        model=objective, model_parameters=[p for p in objective.parameters() if p.requires_grad],
        config=deepspeed_config(config, steps_per_epoch * settings.epochs))
    state = {"epoch": 0, "batch_in_epoch": 0, "global_step": 0, "history": [], "stop_reason": None,
             "epoch_counts": None}
    if (ckpt_dir / "latest").exists():
        _, client = engine.load_checkpoint(str(ckpt_dir))
        state = {k: client[k] for k in state}
        torch.set_rng_state(client["rng_cpu"])
        log.info("resumed from checkpoint at epoch %d batch %d", state["epoch"], state["batch_in_epoch"])
    metrics = MetricsLog(workdir / "metrics.jsonl", rank == 0)
    metrics.truncate_after(state["global_step"])
    progress = Progress(total=steps_per_epoch * settings.epochs, desc="train", unit="step", enabled=rank == 0)
    progress.update(state["global_step"])
    started = time.monotonic()
    while state["epoch"] < settings.epochs and state["stop_reason"] is None:
        epoch = state["epoch"]
        batches = rank_batches(epoch_order(len(dataset), settings.seed, epoch), rank, world, settings.micro_batch_size)
        epoch_counts = torch.zeros_like(MetricCounts(settings.ttt_steps).as_tensor())
        interval_counts = torch.zeros_like(epoch_counts)
        if state["epoch_counts"] is not None and rank == 0:
            # counts of the part of this epoch done before the checkpoint, summed over ranks
            epoch_counts += torch.tensor(state["epoch_counts"], dtype=epoch_counts.dtype)
        for index in range(state["batch_in_epoch"], len(batches)):
            batch = {k: v.to(engine.device) for k, v in
                     collate([dataset.sample(i) for i in batches[index]], dtype).items()}
            loss, counts = engine(**batch)
            engine.backward(loss)
            engine.step()
            step_counts = counts.as_tensor()
            epoch_counts += step_counts
            interval_counts += step_counts
            state["global_step"] += 1
            state["batch_in_epoch"] = index + 1
            progress.update(1)
            if state["global_step"] % settings.log_every == 0:
                summary = MetricCounts.from_tensor(_all_reduce(interval_counts.clone())).summary()
                metrics.write({"kind": "interval", "epoch": epoch, "global_step": state["global_step"],
                               "lr": scheduler.get_lr()[0], **summary})
                interval_counts.zero_()
            if settings.checkpoint_every_steps and state["global_step"] % settings.checkpoint_every_steps == 0:
                state["epoch_counts"] = _all_reduce(epoch_counts.clone()).tolist()
                _save_checkpoint(engine, ckpt_dir, f"step-{state['global_step']:08d}", state, rank)
        summary = MetricCounts.from_tensor(_all_reduce(epoch_counts.clone())).summary()
        state["history"].append({"epoch": epoch, **summary})
        metrics.write({"kind": "epoch", "epoch": epoch, "global_step": state["global_step"],
                       "seconds": round(time.monotonic() - started, 1), **summary})
        if rank == 0:
            log.info("epoch %d: cond_acc %s tau_simulated %.3f", epoch, summary["cond_acc"], summary["tau_simulated"])
        if plateau_reached(state["history"], config):
            state["stop_reason"] = "plateau"
        state["epoch"] += 1
        state["batch_in_epoch"] = 0
        state["epoch_counts"] = None
        _save_checkpoint(engine, ckpt_dir, f"epoch-{epoch:04d}", state, rank)
    progress.close()
    result = {"stop_reason": state["stop_reason"] or "completed", "epochs_run": state["epoch"],
              "global_steps": state["global_step"], "world_size": world, "history": state["history"],
              "draft_vocab_size": mapping.draft_vocab_size, "train_samples": len(dataset), "teacher": teacher,
              "seconds": round(time.monotonic() - started, 1)}
    if rank == 0:
        export_drafter(engine.module.drafter, spec["contract"], workdir / "drafter", config.drafter.export_dtype)
        (workdir / "train_result.json").write_text(json.dumps(result, indent=2))
    dist.barrier()
    dataset.close()
    return result


def worker_main(spec_path: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    train(spec)
