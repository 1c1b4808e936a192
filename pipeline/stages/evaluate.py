"""evaluate: an exported drafter on held-out capture shards -> eval.json with summed-count metrics."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.contract import contract_differences, require_same_contract
from pipeline.export import load_drafter, read_drafter_dir
from pipeline.manifest import publish, read_manifest
from pipeline.progress import Progress
from pipeline.stages import StageResult
from pipeline.stages.train import cached_shard
from pipeline.storage import ObjectStore, open_store
from pipeline.target import describe_target, load_frozen_tensors
from pipeline.train_data import CaptureDataset, collate
from pipeline.trainer import DraftObjective, choose_teacher
from pipeline.ttt import MetricCounts

log = logging.getLogger(__name__)


class EvaluationFailed(RuntimeError):
    pass


def evaluate_drafter(drafter_dir: Path, shard_paths: list[Path], target_dir: Path, steps: int,
                     micro_batch: int, max_length: int, chunk: int, teacher: str = "auto") -> dict[str, Any]:
    """Metrics of one drafter over every sample of the given shards, from counts summed over all of them."""
    frozen = load_frozen_tensors(target_dir)
    drafter, contract = load_drafter(drafter_dir, frozen["embed"].float())
    dataset = CaptureDataset([str(p) for p in shard_paths], max_length)
    teacher = choose_teacher(teacher, dataset.teachers())
    objective = DraftObjective(drafter, frozen["lm_head"].float(), teacher, steps, 1.0, chunk).eval()
    totals = MetricCounts(steps)
    positions = list(range(len(dataset)))
    with torch.no_grad():
        for start in Progress(range(0, len(positions), micro_batch), desc="evaluate", unit="batch"):
            batch = collate([dataset.sample(i) for i in positions[start:start + micro_batch]], torch.float32)
            _, counts = objective(**batch)
            totals.add(counts)
    dataset.close()
    return {"samples": len(dataset), "ttt_steps": steps, "teacher": teacher, "counts": totals.as_tensor().tolist(),
            **totals.summary(), "contract": contract}


def evaluate_incumbent(incumbent: tuple[str, Path], contract: dict[str, Any], shards: list[Path], target_dir: Path,
                       steps: int, config: RunConfig) -> dict[str, Any]:
    """The incumbent on the same eval set, or why it cannot be compared (a different capture contract)."""
    version, directory = incumbent
    _, _, incumbent_contract = read_drafter_dir(directory)
    problems = contract_differences(contract, incumbent_contract)
    if problems:
        return {"version": version, "skipped": "different capture contract: " + "; ".join(problems)}
    result = evaluate_drafter(directory, shards, target_dir, steps, config.evaluate.micro_batch_size,
                              config.train.max_length, config.train.attention_chunk)
    result.pop("contract")
    return {"version": version, **{k: result[k] for k in ("acc", "full_acc", "cond_acc", "tau_simulated")}}


def local_drafter_dir(store: ObjectStore, train_prefix: str, workdir: Path) -> Path:
    """The trained drafter's files, fetched from the store and verified against the train manifest."""
    from pipeline.manifest import fetch_listed
    from pipeline.export import DRAFTER_FILES

    manifest = read_manifest(store, train_prefix, kind="train")
    out = workdir / "candidate_drafter"
    for name in DRAFTER_FILES:
        fetch_listed(store, train_prefix, manifest, f"drafter/{name}", out / name)
    return out


def run(config: RunConfig, train_uri: str, dataset_uri: str, run_id: str, store: ObjectStore | None = None,
        incumbent: tuple[str, Path] | None = None) -> StageResult:
    store = store or open_store(config.storage)
    dataset = read_manifest(store, store.key_for(dataset_uri), kind="dataset")
    if not dataset["eval_shards"]:
        raise EvaluationFailed(f"dataset {dataset_uri} has no held-out (eval) shards; raise prompts.eval_fraction")
    workdir = Path(config.storage.local_cache) / "runs" / run_id
    drafter_dir = local_drafter_dir(store, store.key_for(train_uri), workdir)
    target = describe_target(config)
    cache = Path(config.storage.local_cache)
    shards = [cached_shard(store, shard, cache) for shard in dataset["eval_shards"]]
    steps = config.evaluate.ttt_steps or config.train.ttt_steps
    result = evaluate_drafter(drafter_dir, shards, target.model_dir, steps, config.evaluate.micro_batch_size,
                              config.train.max_length, config.train.attention_chunk)
    require_same_contract(dataset["contract"], result.pop("contract"), "evaluating the candidate drafter")
    result.update({"drafter": train_uri, "dataset": dataset_uri})
    if incumbent is not None:
        result["incumbent"] = evaluate_incumbent(incumbent, dataset["contract"], shards, target.model_dir, steps, config)
    prefix = f"{layout.run_prefix(run_id)}/eval"
    info = store.put_bytes(f"{prefix}/eval.json", json.dumps(result, indent=2).encode())
    manifest = publish(store, prefix, "eval", [info], {"run_id": run_id, "summary": {
        k: result[k] for k in ("samples", "acc", "full_acc", "cond_acc", "tau_simulated")}})
    log.info("evaluate: cond_acc %s tau_simulated %.3f over %d samples", result["cond_acc"],
             result["tau_simulated"], result["samples"])
    return StageResult(store.uri(prefix), manifest)
