"""The training worker: one process per rank, started by a node's torchrun agent (pipeline.training.nodes).

The launcher side (pipeline.stages.train) checks the contract, fixes the draft vocabulary, writes a
worker spec to the object store and starts the nodes; nothing here runs inside an Airflow worker.
Each rank reads the spec and streams its shards from the object store (pipeline.training.stream). Checkpoints,
metrics and the exported drafter go to the spec's work dir, which every node sees (one volume).
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

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.config_base import resolve_project_path
from pipeline.data.capture_contract import ContractMismatch
from pipeline.drafter.arch import DrafterArch, architecture_norms
from pipeline.drafter.export import (
    CONFIG_NAME,
    arch_from_config,
    export_drafter,
    no_engine_here,
    read_drafter_dir,
)
from pipeline.drafter.mla import mla_shape_of_target
from pipeline.drafter.model import Eagle3Drafter
from pipeline.drafter.objective import DraftObjective, choose_teacher
from pipeline.drafter.rope import draft_rope
from pipeline.drafter.ttt import MetricCounts
from pipeline.drafter.vocab import mapping_from_used_ids
from pipeline.engines.sglang_draft_checks import derived_context_length
from pipeline.engines.target import load_frozen_tensors, text_config
from pipeline.progress import Progress
from pipeline.records import DrafterSource, WorkerSpec, parse_record
from pipeline.storage import atomic_write
from pipeline.training.checkpoint_digests import (
    CHECKPOINTS_DIR,
    CheckpointRefused,
    DigestRecords,
    copy_verified,
    record_commit,
    resume_point,
)
from pipeline.training.init_choice import gate_step0_bar, warm_plateau_reached
from pipeline.training.stream import (
    ShardCache,
    ShardRef,
    StreamingShards,
    collate,
    epoch_plan,
    sequential_plan,
)
from pipeline.training.tracking import TrainingCurves

log = logging.getLogger(__name__)
CHECKPOINTS_KEPT = 2
COMMITTED_FILE = "committed.json"
BEST_EPOCH_DIR = "best_epoch"  # in the work dir: the weights of the best epoch so far (safetensors)


def drafter_arch(
    config: RunConfig, target_dir: Path, aux_layer_ids: list[int], draft_vocab_size: int
) -> DrafterArch:
    """Drafter shape: explicit drafter.* settings, else the target's own attention/MLP shape. Context length,
    RoPE and vocabulary always come from the target's config.json, so that SGLang serves the exported
    drafter with the target and applies the RoPE it trained with (pipeline.drafter.rope)."""
    target = text_config(target_dir)
    settings = config.drafter
    hidden = int(target["hidden_size"])
    heads = settings.num_heads or int(target["num_attention_heads"])
    vocab_size = int(target["vocab_size"])
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"draft vocabulary of {draft_vocab_size} tokens exceeds the target's vocab_size {vocab_size} "
            f"({target_dir / 'config.json'}); lower drafter.draft_vocab_size"
        )
    rope_theta, rope_scaling, max_position_embeddings = draft_rope(target, derived_context_length(target))
    mla = None
    if settings.architecture == "eagle3-mla":  # refused, with the reason, for a target without MLA
        mla = mla_shape_of_target(target, str(target_dir / "config.json"))
    fc_norm, norm_output = architecture_norms(settings.architecture)
    return DrafterArch(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads
        if mla
        else settings.num_kv_heads or int(target.get("num_key_value_heads") or heads),
        head_dim=(
            mla.qk_nope_head_dim + mla.qk_rope_head_dim
            if mla
            else settings.head_dim or int(target.get("head_dim") or hidden // heads)
        ),
        intermediate_size=settings.intermediate_size or int(target["intermediate_size"]),
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=list(aux_layer_ids),
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        architecture=settings.architecture,
        mla=mla,
        fc_norm=fc_norm,
        norm_output=norm_output,
    )


def check_warm_start_contract(init_contract: dict[str, Any], data_contract: dict[str, Any]) -> None:
    """A warm start only makes sense when the old drafter reads features the same way."""
    problems = []
    for field in ("aux_layer_ids", "hidden_size", "teacher_norm", "layer_convention", "vocab_size"):
        if init_contract.get(field) != data_contract.get(field):
            problems.append(
                f"{field}: drafter {init_contract.get(field)!r} vs data {data_contract.get(field)!r}"
            )
    if problems:
        raise ContractMismatch(
            "refusing warm start: the initial drafter was trained on a different capture "
            "contract:\n  " + "\n  ".join(problems)
        )


def check_warm_start_architecture(init_config: dict[str, Any], architecture: str) -> None:
    """A warm start needs a drafter with the same layers (an eagle3 drafter has no fc_norm weights, and its
    carried state is another one); init_config is the initial drafter's config.json."""
    init = arch_from_config(init_config)
    same_norms = (init.fc_norm, init.norm_output) == architecture_norms(architecture)
    if init.architecture != architecture or not same_norms:
        raise ContractMismatch(
            f"refusing warm start: the initial drafter is a {init.architecture} drafter "
            f"(fc_norm {init.fc_norm}, norm_output {init.norm_output}) and drafter.architecture is "
            f"{architecture}"
        )


def build_model(config: RunConfig, spec: DrafterSource, frozen: dict[str, torch.Tensor]) -> Eagle3Drafter:
    """The drafter, its draft vocabulary from the spec, warm-started from the spec's init_dir when given."""
    target_dir = Path(spec.target_dir)
    vocab_size = int(text_config(target_dir)["vocab_size"])
    mapping = mapping_from_used_ids(torch.tensor(spec.draft_vocab), vocab_size)
    arch = drafter_arch(config, target_dir, spec.contract.aux_layer_ids, mapping.draft_vocab_size)
    model = Eagle3Drafter(arch, frozen["embed"].float())
    model.set_vocab_mapping(mapping.d2t, mapping.t2d)
    with torch.no_grad():
        if spec.init_dir:
            init_config, tensors, _ = read_drafter_dir(spec.init_dir)
            check_warm_start_architecture(init_config, arch.architecture)
            if not torch.equal(tensors["d2t"], mapping.d2t):
                raise ContractMismatch("the warm-start drafter's vocabulary mapping differs from the spec's")
            model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
        else:
            # Start the draft head from the target's own head rows for the draft vocabulary.
            model.lm_head.weight.copy_(frozen["lm_head"].float()[mapping.used_ids])
            model.norm.weight.copy_(frozen["norm"].float())
    return model


def deepspeed_config(config: RunConfig, total_steps: int) -> dict[str, Any]:
    settings = config.train
    ds = json.loads(resolve_project_path(settings.deepspeed_config).read_text())
    ds["train_micro_batch_size_per_gpu"] = settings.micro_batch_size
    ds["gradient_accumulation_steps"] = 1
    ds["gradient_clipping"] = settings.grad_clip
    ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    ds["optimizer"]["params"].update({"lr": settings.learning_rate, "weight_decay": settings.weight_decay})
    ds["scheduler"] = {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": max(1, total_steps),
            "warmup_num_steps": max(1, int(settings.warmup_ratio * total_steps)),
            "warmup_type": "linear",
            "cos_min_ratio": 0.1,
        },
    }
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": settings.precision == "bf16"}
    ds["steps_per_print"] = 10**9
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
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["global_step"] <= global_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")


def _plateau_metric(entry: dict[str, Any]) -> float:
    """cond_acc_0 on the held-out split when the run has one (what the gate judges), else on training."""
    return (entry.get("heldout") or entry)["cond_acc"][0]


def plateau_reached(history: list[dict[str, Any]], config: RunConfig) -> bool:
    plateau = config.train.plateau
    if not plateau.enabled or len(history) <= plateau.window_epochs:
        return False
    current = _plateau_metric(history[-1])
    before = _plateau_metric(history[-1 - plateau.window_epochs])
    return current - before < plateau.min_gain and current < step0_bar(config)


def step0_bar(config: RunConfig) -> float:
    """The gate's cond_acc_0 bar: a plateau under it stops training (1.0 when the gate sets none)."""
    bar = gate_step0_bar(config)
    return 1.0 if bar is None else bar


def best_weights_path(directory: Path, epoch: int) -> Path:
    return directory / f"epoch-{epoch:04d}.safetensors"


def keep_if_best(
    best: dict[str, Any] | None,
    epoch: int,
    heldout: dict[str, Any],
    drafter: Eagle3Drafter,
    directory: Path | None,
) -> dict[str, Any] | None:
    """The new best-epoch record when `epoch` beats `best` on held-out tau_simulated (a tie keeps the
    earlier epoch), after writing its weights to `directory`; else `best` unchanged. Rank 0 calls it
    with a directory; other ranks pass None for it and only follow the decision (their metrics are the
    same all-reduced counts)."""
    tau = float(heldout["tau_simulated"])
    if best is not None and tau <= best["tau_simulated"]:
        return best
    if directory is not None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().contiguous().clone() for name, t in drafter.state_dict().items()}
        with atomic_write(best_weights_path(directory, epoch)) as partial:
            save_file(tensors, str(partial), metadata={"format": "pt", "epoch": str(epoch)})
    return {"epoch": epoch, "tau_simulated": tau}


def prune_best_weights(directory: Path, best: dict[str, Any] | None) -> None:
    """Drop the weights of epochs that are no longer the best (call after the checkpoint naming `best`
    is committed: until then the previous best is what a resume would continue from)."""
    keep = best_weights_path(directory, best["epoch"]).name if best else None
    for path in directory.glob("epoch-*.safetensors") if directory.is_dir() else []:
        if path.name != keep:
            path.unlink(missing_ok=True)


def restore_best(drafter: Eagle3Drafter, directory: Path, best: dict[str, Any]) -> None:
    """Load the best epoch's weights into `drafter` (the one exported)."""
    from safetensors.torch import load_file

    path = best_weights_path(directory, best["epoch"])
    if not path.is_file():
        raise RuntimeError(
            f"the weights of the best epoch ({best['epoch']}) are missing from {path}; the work dir "
            "was changed by hand: delete it to train from the start"
        )
    drafter.load_state_dict(load_file(str(path)))


def selection_summary(history: list[dict[str, Any]], best: dict[str, Any] | None) -> dict[str, Any]:
    """Which epoch is exported and why, with each epoch's held-out tau (for the train result)."""
    taus = [entry["heldout"]["tau_simulated"] for entry in history if entry.get("heldout")]
    if best is None:
        return {
            "chosen_epoch": history[-1]["epoch"] if history else None,
            "selection": "last epoch: the dataset has no eval split",
            "heldout_tau_by_epoch": None,
        }
    return {
        "chosen_epoch": best["epoch"],
        "selection": "best held-out tau_simulated",
        "heldout_tau_by_epoch": taus,
    }


def _save_checkpoint(
    engine, ckpt_dir: Path, tag: str, state: dict[str, Any], rank: int, records: DigestRecords
) -> None:
    """Save on every rank, then commit: `latest` names the tag only once all ranks' files are written.

    DeepSpeed's own `latest` is written by rank 0 before the other ranks finish theirs, and not atomically,
    so a kill in between would leave a pointer to a partial checkpoint; ours is replaced atomically after
    save_checkpoint's closing barrier. `latest` stays in DeepSpeed's format (its zero_to_fp32 tool reads it);
    committed.json lists the kept tags, oldest first, so pruning never depends on file times."""
    import torch.distributed as dist

    state = dict(state, rng_cpu=torch.get_rng_state())
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state, save_latest=False)
    if rank == 0:
        committed = _committed_tags(ckpt_dir) + [tag]
        # what a resume checks before it unpickles anything (pipeline.training.checkpoint_digests)
        record_commit(ckpt_dir, tag, committed[-CHECKPOINTS_KEPT:], records)
        _write_atomically(ckpt_dir / COMMITTED_FILE, json.dumps(committed[-CHECKPOINTS_KEPT:]))
        _write_atomically(ckpt_dir / "latest", tag)
        for old in ckpt_dir.iterdir():
            if old.is_dir() and old.name not in committed[-CHECKPOINTS_KEPT:]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _write_atomically(path: Path, text: str) -> None:
    with atomic_write(path) as partial:
        partial.write_text(text)


def _committed_tags(ckpt_dir: Path) -> list[str]:
    path = ckpt_dir / COMMITTED_FILE
    return json.loads(path.read_text()) if path.exists() else []


def rank_0_verdict(ckpt_dir: Path, records: DigestRecords) -> tuple[int, str, BaseException | None]:
    """Rank 0's check of the resume point as what it broadcasts: (0 nothing to resume, 1 resume, 2 refused),
    the tag, and the error to raise once it is broadcast. Any error is a refusal (an OSError reading
    `latest` too): a rank 0 that raised before broadcasting would leave the others waiting in it."""
    try:
        tag = resume_point(ckpt_dir, records)
    except Exception as error:  # noqa: BLE001 - re-raised by the caller, after the broadcast
        return 2, "", error
    return (0, "", None) if tag is None else (1, tag, None)


def _checked_resume_point(
    engine, ckpt_dir: Path, rank: int, records: DigestRecords
) -> tuple[str, str] | None:
    """The committed tag to resume from and a random token naming this resume's private copies, once rank 0
    has checked the tag's files against the digests recorded at commit. Rank 0 hands both to every rank, so
    none reads another; all refuse together, before any of them unpickles anything."""
    import secrets

    verdict, tag, refused = rank_0_verdict(ckpt_dir, records) if rank == 0 else (0, "", None)
    token = secrets.token_hex(8) if rank == 0 else ""
    verdict, said = _from_rank_0(engine.device, verdict, f"{tag}\n{token}")
    if refused is not None:
        raise refused
    if verdict == 2:
        raise CheckpointRefused(
            f"rank 0 refused the checkpoint in {ckpt_dir} (its log names the file); nothing was loaded"
        )
    tag, token = said.split("\n")
    return (tag, token) if verdict == 1 else None


def _from_rank_0(device, verdict: int, text: str) -> tuple[int, str]:
    """Rank 0's verdict (0 nothing to resume, 1 resume, 2 refused) and text (a tag and a token), on every
    rank."""
    import torch.distributed as dist

    encoded = text.encode()  # a tag is an id (at most 128 bytes), the token 16 hex
    message = torch.zeros(2 + 256, dtype=torch.int64, device=device)
    message[0], message[1] = verdict, len(encoded)
    message[2 : 2 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.int64)
    dist.broadcast(message, src=0)
    length = int(message[1])
    return int(message[0]), bytes(message[2 : 2 + length].tolist()).decode()


def _private_copy(engine, ckpt_dir: Path, tag: str, token: str, records: DigestRecords) -> Path:
    """A directory that holds checkpoint `tag` as this node's copy of it, checked against the store's record
    byte for byte as it was copied (copy_verified): DeepSpeed loads it from there, never from the shared
    volume, so nothing changed on the volume after the check is unpickled. One copy a node (local rank 0
    makes it in the node's temp dir, 0700, under rank 0's random token; the node's other ranks wait), and
    every node's copy checked before any rank loads."""
    import tempfile

    import torch.distributed as dist

    node = os.environ.get("GROUP_RANK", "0")
    root = Path(tempfile.gettempdir()) / f"drafter-resume-{token}-node{node}"
    refused: BaseException | None = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            root.mkdir(mode=0o700)
            recorded = records.read(tag) or {}
            copy_verified(ckpt_dir / tag, root / tag, recorded, records.uri(tag))
        except Exception as error:  # noqa: BLE001 - raised below, once every rank knows
            refused = error
    flag = torch.tensor([1 if refused is not None else 0], dtype=torch.int64, device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if refused is not None:
        shutil.rmtree(root, ignore_errors=True)
        raise refused
    if int(flag[0]):
        raise CheckpointRefused(
            f"another node refused its copy of checkpoint {ckpt_dir / tag} (its log names the file); nothing "
            "was loaded"
        )
    return root


def _resume(engine, ckpt_dir: Path, rank: int, records: DigestRecords) -> dict[str, Any]:
    """Training state from the last committed checkpoint, loaded from a copy checked against what the run
    committed (_private_copy; model, optimizer and scheduler are restored by DeepSpeed)."""
    import torch.distributed as dist

    state = {
        "epoch": 0,
        "batch_in_epoch": 0,
        "global_step": 0,
        "history": [],
        "stop_reason": None,
        "epoch_counts": None,
        "best": None,  # {"epoch", "tau_simulated"} of the best held-out epoch so far (BEST_EPOCH_DIR)
        # (global step, training cond_acc_0) of every log interval: a warm start's step plateau check
        "intervals": [],
    }
    point = _checked_resume_point(engine, ckpt_dir, rank, records)
    if point is None:
        return state
    tag, token = point
    copy = _private_copy(engine, ckpt_dir, tag, token, records)
    try:
        _, client = engine.load_checkpoint(str(copy), tag=tag)
    finally:
        dist.barrier()  # every rank of the node has read the copy
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(copy, ignore_errors=True)
    if client is None:
        raise RuntimeError(
            f"checkpoint {ckpt_dir / tag} is named in {ckpt_dir / 'latest'} but could not be "
            "loaded; delete the checkpoints directory to train from the start"
        )
    state = {k: client.get(k, default) for k, default in state.items()}
    torch.set_rng_state(client["rng_cpu"])
    log.info("resumed from checkpoint %s at epoch %d batch %d", tag, state["epoch"], state["batch_in_epoch"])
    return state


class Trainer:
    """One rank's training loop over the streamed dataset; the engine is DeepSpeed's."""

    def __init__(self, spec: WorkerSpec):
        import deepspeed
        import torch.distributed as dist

        from pipeline.storage import open_store

        self.spec = spec
        self.config = spec.config
        self.settings = settings = self.config.train
        _init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(settings.seed)
        self.workdir = Path(spec.workdir)
        self.ckpt_dir = self.workdir / CHECKPOINTS_DIR
        self.shards = [ShardRef.from_manifest(entry) for entry in spec.train_shards]
        store = open_store(self.config.storage)
        # where commits record their checkpoints' digests, off the volume the checkpoints are on
        self.digests = DigestRecords(store, spec.run_id, self.workdir.name)
        cache = ShardCache(store, Path(spec.shard_cache), int(settings.cache_gb * (1 << 30)))
        self.stream = StreamingShards(self.shards, cache, settings.max_length, settings.prefetch_shards)
        frozen = load_frozen_tensors(Path(spec.target_dir))
        self.model = build_model(self.config, spec, frozen)
        self.dtype = torch.bfloat16 if settings.precision == "bf16" else torch.float32
        self.teacher = choose_teacher(settings.teacher, self.stream.teachers())
        objective = DraftObjective(
            self.model,
            frozen["lm_head"].to(self.dtype),
            self.teacher,
            settings.ttt_steps,
            settings.loss_decay,
            settings.attention_chunk,
        )
        self.steps_per_epoch = len(self.plan(0))
        if self.steps_per_epoch == 0:
            raise RuntimeError(
                f"{sum(s.samples for s in self.shards)} training samples are too few for "
                f"{self.world} ranks of micro-batch {settings.micro_batch_size}"
            )
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=objective,
            model_parameters=[p for p in objective.parameters() if p.requires_grad],
            config=deepspeed_config(self.config, self.steps_per_epoch * settings.epochs),
        )
        self.heldout = (
            self._heldout_set(spec, cache, frozen["lm_head"].to(self.dtype)) if spec.eval_shards else None
        )
        self.state = _resume(self.engine, self.ckpt_dir, self.rank, self.digests)
        self.metrics = MetricsLog(self.workdir / "metrics.jsonl", self.rank == 0)
        self.metrics.truncate_after(self.state["global_step"])
        self.curves = TrainingCurves(
            self.config.tracking,
            self.workdir,
            store,
            layout.run_stage_prefix(spec.run_id, "train"),
            spec.run_id,
            self.state["global_step"],
            self.rank == 0,
        )

    def record(self, entry: dict[str, Any]) -> None:
        """A metrics record, to metrics.jsonl and the trackers (rank 0 only)."""
        self.metrics.write(entry)
        self.curves.write(entry)

    def _heldout_set(
        self, spec: WorkerSpec, cache: ShardCache, lm_head: torch.Tensor
    ) -> tuple[StreamingShards, DraftObjective]:
        """The eval split and the objective that scores the drafter on it, as the evaluate stage does
        (its ttt_steps, no loss decay, the teacher the captures carry); the drafter is the trained one,
        already cast and placed by DeepSpeed (ZeRO stages 1-2 keep every parameter on every rank)."""
        settings = self.settings
        refs = [ShardRef.from_manifest(entry) for entry in spec.eval_shards]
        stream = StreamingShards(refs, cache, settings.max_length, settings.prefetch_shards)
        objective = DraftObjective(
            self.model,
            lm_head,
            choose_teacher("auto", stream.teachers()),
            self.config.evaluate.ttt_steps or settings.ttt_steps,
            1.0,
            settings.attention_chunk,
        ).to(self.engine.device)
        return stream, objective

    def heldout_summary(self) -> dict[str, Any] | None:
        """Metrics on the eval split, each rank scoring every world-th batch, counts summed over ranks."""
        if self.heldout is None:
            return None
        stream, objective = self.heldout
        plan = sequential_plan(stream.shards, self.config.evaluate.micro_batch_size)[self.rank :: self.world]
        totals = MetricCounts.empty(objective.ttt_steps)
        with torch.no_grad():
            for samples in stream.batches(plan):
                batch = {k: v.to(self.engine.device) for k, v in collate(samples, self.dtype).items()}
                totals.add(objective(**batch)[1])
        return MetricCounts.from_tensor(_all_reduce(totals.as_tensor())).summary()

    def plan(self, epoch: int):
        return epoch_plan(
            self.shards, self.settings.seed, epoch, self.rank, self.world, self.settings.micro_batch_size
        )

    def step(self, samples) -> torch.Tensor:
        batch = {k: v.to(self.engine.device) for k, v in collate(samples, self.dtype).items()}
        loss, counts = self.engine(**batch)
        self.engine.backward(loss)
        self.engine.step()
        return counts.as_tensor()

    def warm_start_stalled(self, cond_acc0: float) -> bool:
        """A warm start train.init auto chose that stopped improving within auto_init.plateau_steps under
        its restart bar (the spec's warm_restart_bar): ends the attempt (stop_reason warm_plateau) for the
        train stage to restart from scratch. Every rank sees the same all-reduced figures, so all stop at
        the same step."""
        bar = self.spec.warm_restart_bar
        if bar is None:
            return False
        state, auto = self.state, self.settings.auto_init
        state["intervals"].append([state["global_step"], cond_acc0])
        intervals = [(int(step), float(value)) for step, value in state["intervals"]]
        if not warm_plateau_reached(intervals, auto.plateau_steps, auto.plateau_min_gain, bar):
            return False
        state["stop_reason"] = "warm_plateau"
        log.info(
            "stopping the warm start: training cond_acc_0 %.3f gained less than %s over %d steps, under %.3f",
            cond_acc0,
            auto.plateau_min_gain,
            auto.plateau_steps,
            bar,
        )
        return True

    def run_epoch(self, progress: Progress) -> None:
        state, settings = self.state, self.settings
        epoch = state["epoch"]
        epoch_counts = torch.zeros_like(MetricCounts(settings.ttt_steps).as_tensor())
        interval_counts = torch.zeros_like(epoch_counts)
        interval_started = time.monotonic()
        if state["epoch_counts"] is not None and self.rank == 0:
            # counts of the part of this epoch done before the checkpoint, summed over ranks
            epoch_counts += torch.tensor(state["epoch_counts"], dtype=epoch_counts.dtype)
        for samples in self.stream.batches(self.plan(epoch), state["batch_in_epoch"]):
            counts = self.step(samples)
            epoch_counts += counts
            interval_counts += counts
            state["global_step"] += 1
            state["batch_in_epoch"] += 1
            progress.update(1)
            if state["global_step"] % settings.log_every == 0:
                summary = MetricCounts.from_tensor(_all_reduce(interval_counts.clone())).summary()
                seconds = time.monotonic() - interval_started
                self.record(
                    {
                        "kind": "interval",
                        "epoch": epoch,
                        "global_step": state["global_step"],
                        "lr": self.scheduler.get_lr()[0],
                        # positions trained at the first TTT step, all ranks, per second of this interval
                        "tokens_per_s": round(summary["masked_tokens"][0] / seconds, 1) if seconds else None,
                        **summary,
                    }
                )
                interval_counts.zero_()
                interval_started = time.monotonic()
                if self.warm_start_stalled(summary["cond_acc"][0]):
                    break
            if (
                settings.checkpoint_every_steps
                and state["global_step"] % settings.checkpoint_every_steps == 0
            ):
                state["epoch_counts"] = _all_reduce(epoch_counts.clone()).tolist()
                _save_checkpoint(
                    self.engine,
                    self.ckpt_dir,
                    f"step-{state['global_step']:08d}",
                    state,
                    self.rank,
                    self.digests,
                )
        summary = MetricCounts.from_tensor(_all_reduce(epoch_counts.clone())).summary()
        heldout = self.heldout_summary()
        entry = {"epoch": epoch, **summary, **({"heldout": heldout} if heldout else {})}
        state["history"].append(entry)
        self.record({"kind": "epoch", "global_step": state["global_step"], **entry})
        if heldout is not None:
            best_dir = self.workdir / BEST_EPOCH_DIR if self.rank == 0 else None
            state["best"] = keep_if_best(state["best"], epoch, heldout, self.model, best_dir)
        if self.rank == 0:
            log.info(
                "epoch %d: cond_acc %s tau_simulated %.3f, held out %s",
                epoch,
                summary["cond_acc"],
                summary["tau_simulated"],
                heldout and heldout["tau_simulated"],
            )
        if state["stop_reason"] is None and plateau_reached(state["history"], self.config):
            state["stop_reason"] = "plateau"
            log.info(
                "stopping: cond_acc_0 gained less than %s over %d epochs",
                settings.plateau.min_gain,
                settings.plateau.window_epochs,
            )
        state.update({"epoch": epoch + 1, "batch_in_epoch": 0, "epoch_counts": None})
        _save_checkpoint(self.engine, self.ckpt_dir, f"epoch-{epoch:04d}", state, self.rank, self.digests)
        if self.rank == 0:
            prune_best_weights(self.workdir / BEST_EPOCH_DIR, state["best"])

    def run(self) -> dict[str, Any]:
        import torch.distributed as dist

        settings, state = self.settings, self.state
        progress = Progress(
            total=self.steps_per_epoch * settings.epochs, desc="train", unit="step", enabled=self.rank == 0
        )
        progress.update(state["global_step"])
        started, first_step = time.monotonic(), state["global_step"]
        try:
            while state["epoch"] < settings.epochs and state["stop_reason"] is None:
                self.run_epoch(progress)
        except BaseException:
            self.curves.close("FAILED")
            raise
        self.curves.close()
        progress.close()
        result = {
            "stop_reason": state["stop_reason"] or "completed",
            "epochs_run": state["epoch"],
            "global_steps": state["global_step"],
            "world_size": self.world,
            "nodes": _nodes(),
            "history": state["history"],
            "draft_vocab_size": self.model.arch.draft_vocab_size,
            "teacher": self.teacher,
            "train_samples": sum(s.samples for s in self.shards),
            "seconds_this_attempt": round(time.monotonic() - started, 1),
            "steps_this_attempt": state["global_step"] - first_step,
            "steps_per_epoch": self.steps_per_epoch,
            **selection_summary(state["history"], state["best"]),
        }
        if self.rank == 0:
            if state["best"] is not None:
                restore_best(self.engine.module.drafter, self.workdir / BEST_EPOCH_DIR, state["best"])
            export_drafter(
                self.engine.module.drafter,
                self.spec.contract.model_dump(mode="json"),
                self.workdir / "drafter",
                self.config.drafter.export_dtype,
                target_dir=self.spec.target_dir,  # records its config; refuses what SGLang would refuse
            )
            exported = json.loads((self.workdir / "drafter" / CONFIG_NAME).read_text())
            result["no_engine_here"] = no_engine_here(exported)  # the run report says so (None: one does)
            (self.workdir / "train_result.json").write_text(json.dumps(result, indent=2))
        dist.barrier()
        self.stream.close()
        if self.heldout is not None:
            self.heldout[0].close()
        return result


def _nodes() -> int:
    """How many torchrun agents (nodes) this run's ranks came from."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1"))


def train(spec: WorkerSpec) -> dict[str, Any]:
    return Trainer(spec).run()


def read_worker_spec(location: str) -> WorkerSpec:
    """The worker spec from a local path, a file:// URI or an s3:// URI.

    Every rank reads it itself, so no node needs another's filesystem for it. An s3:// spec is read with
    the standard AWS environment the node's agent handed on (credentials, region, and AWS_ENDPOINT_URL_S3
    for an S3-compatible server); the config inside it says where everything else is."""
    if not location.startswith("s3://"):
        from pipeline.user_files import UserFile

        spec = UserFile(Path(location.removeprefix("file://")), "worker spec").read_bytes()
        return parse_record(WorkerSpec, spec, location)
    from pipeline.storage import NoS3Credentials, S3Store

    bucket, _, key = location.removeprefix("s3://").partition("/")
    try:
        data = S3Store(bucket, "").get_bytes(key)
    except NoS3Credentials as err:
        raise RuntimeError(
            f"cannot read the worker spec {location}: this rank has no AWS credentials; its "
            "node's torchrun agent hands on its own environment, so start the agent with "
            "them (the pod's IRSA role, or AWS_* variables)"
        ) from err
    return parse_record(WorkerSpec, data, location)


def worker_main(spec_location: str) -> None:
    from pipeline.credentials import install_log_masking
    from pipeline.processes import die_with_parent

    # the launcher (torchrun) starts workers in their own sessions; they must not outlive it
    die_with_parent()
    install_log_masking()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = read_worker_spec(spec_location)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    train(spec)
