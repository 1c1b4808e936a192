"""evaluate: an exported drafter on held-out capture shards -> eval.json with summed-count metrics."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from pipeline import layout
from pipeline.config import DEFAULT_DOMAIN, RunConfig
from pipeline.data.capture_contract import feature_differences, require_same_contract
from pipeline.decoding.speedup import candidate_settings
from pipeline.decoding.tree_acceptance import Shape, TreeAcceptance
from pipeline.drafter.export import load_drafter, read_drafter_dir
from pipeline.drafter.objective import DraftObjective, choose_teacher
from pipeline.drafter.ttt import MetricCounts, Teacher
from pipeline.engines.target import describe_target, load_frozen_tensors
from pipeline.manifest import read_manifest
from pipeline.ops import registry
from pipeline.progress import Progress
from pipeline.records import (
    AcceptanceMetrics,
    DatasetRecord,
    EvalRecord,
    IncumbentEval,
    IncumbentSkipped,
    InitChoice,
    publish_record,
    read_dataset,
)
from pipeline.stages import StageInputs, StageOutput
from pipeline.storage import ObjectStore
from pipeline.training.init_choice import target_differences
from pipeline.training.stream import ShardCache, ShardRef, StreamingShards, collate, sequential_plan

log = logging.getLogger(__name__)
TREE_WIDTHS = (2, 4)  # draft-tree widths whose acceptance the evaluation also counts


class Inputs(StageInputs):
    train_uri: str
    dataset_uri: str


Output = StageOutput


class EvaluationFailed(RuntimeError):
    pass


def domain_plan(shards: StreamingShards, domains: list[str], micro_batch: int) -> list[tuple[str, list]]:
    """Every sample once, as (domain, micro-batch): a batch never mixes domains (`domains`: each shard's)."""
    if len(domains) != len(shards.shards):
        raise EvaluationFailed(f"{len(domains)} domains for {len(shards.shards)} shards")
    plan = []
    for domain in sorted(set(domains)):
        indices = [i for i, shard_domain in enumerate(domains) if shard_domain == domain]
        plan += [(domain, batch) for batch in sequential_plan(shards.shards, micro_batch, indices)]
    return plan


def evaluate_drafter(
    drafter_dir: Path,
    shards: StreamingShards,
    target_dir: Path,
    steps: int,
    micro_batch: int,
    chunk: int,
    teacher: str = "auto",
    domains: list[str] | None = None,
    shapes: list[Shape] | None = None,
    anchors: int = 0,
) -> dict[str, Any]:
    """Metrics of one drafter over every sample of the shards, from counts summed over all of them, and
    the same per domain (`domains`: each shard's; default: all in DEFAULT_DOMAIN). With `shapes`, each
    shape's acceptance simulated at about `anchors` anchors spread over every sample (`shapes` in the
    result; pipeline.decoding.tree_acceptance)."""
    frozen = load_frozen_tensors(target_dir)
    drafter, contract = load_drafter(drafter_dir, frozen["embed"].float())
    teacher = choose_teacher(teacher, shards.teachers())
    objective = DraftObjective(
        drafter, frozen["lm_head"].float(), teacher, steps, 1.0, chunk, TREE_WIDTHS
    ).eval()
    shard_domains = domains or [DEFAULT_DOMAIN] * len(shards.shards)
    plan = domain_plan(shards, shard_domains, micro_batch)
    per_domain = {domain: MetricCounts.empty(steps, TREE_WIDTHS) for domain, _ in plan}
    batches = shards.batches([batch for _, batch in plan])
    total_samples = sum(s.samples for s in shards.shards)
    simulated = TreeAcceptance(drafter, shapes or [], -(-anchors // max(total_samples, 1)))
    with torch.no_grad():
        for (domain, _), samples in zip(
            plan, Progress(batches, total=len(plan), desc="evaluate", unit="batch"), strict=True
        ):
            batch = collate(samples, torch.float32)
            view = objective.teacher_of(
                batch.get("last_hidden"), batch.get("topk_ids"), batch.get("topk_logprobs")
            )
            _, counts = objective.with_teacher(view, batch["input_ids"], batch["loss_mask"], batch["aux"])
            per_domain[domain].add(counts)
            if simulated.shapes:
                simulate_batch(simulated, view, samples, batch)
    totals = MetricCounts.empty(steps, TREE_WIDTHS)
    for counts in per_domain.values():
        totals.add(counts)
    samples_of: Counter[str] = Counter()
    for shard, domain in zip(shards.shards, shard_domains, strict=True):
        samples_of[domain] += shard.samples
    if simulated.shapes:
        log.info(
            "evaluate: %d draft shapes simulated at %d anchors", len(simulated.shapes), simulated.anchors
        )
    return {
        "samples": total_samples,
        "shapes": simulated.results(),
        "ttt_steps": steps,
        "teacher": teacher,
        "counts": totals.as_tensor().tolist(),
        **totals.summary(),
        "domains": {
            domain: {"samples": samples_of[domain], **domain_metrics(counts.summary())}
            for domain, counts in per_domain.items()
        },
        "contract": contract,
    }


def simulate_batch(
    simulated: TreeAcceptance, teacher: Teacher, samples: list, batch: dict[str, torch.Tensor]
) -> None:
    """Every sample of a collated batch into the shape simulation, with the teacher's top-1 as the target's
    greedy continuation."""
    for row, sample in enumerate(samples):
        n = sample.length
        simulated.add_sample(
            batch["input_ids"][row, :n],
            batch["aux"][row, :n],
            batch["loss_mask"][row, :n],
            teacher.argmax[row, :n],
        )


def benchmark_shapes(config: RunConfig, ttt_steps: int) -> list[Shape]:
    """Every draft shape the benchmark may run: the grid its speed model ranks (pipeline.decoding.speedup),
    or the configured chain, and SGLang's configured setting and candidates."""
    bench = config.benchmark
    if bench.auto_select:
        shapes = candidate_settings(
            min(bench.max_draft_steps, ttt_steps), tuple(bench.tree_widths), bench.max_draft_tokens
        )
    else:
        shapes = [(bench.draft_steps, 1, bench.draft_steps + 1)]
    if bench.sglang is not None:
        shapes += [bench.sglang.setting(), *bench.sglang.candidate_settings()]
    return sorted(set(shapes))


def domain_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The acceptance figures of a summary (MetricCounts.summary) that a domain reports."""
    return {name: summary[name] for name in AcceptanceMetrics.model_fields if name in summary}


def evaluate_incumbent(
    incumbent: tuple[str, Path],
    contract: dict[str, Any],
    shards: StreamingShards,
    target_dir: Path,
    steps: int,
    config: RunConfig,
    domains: list[str],
) -> IncumbentEval | IncumbentSkipped:
    """The incumbent on the same eval set, or why it cannot be compared: features it cannot read (other
    layers or widths). An incumbent trained for another target that reads the same features is scored:
    it is what serves this target until a candidate replaces it (the differences are recorded)."""
    version, directory = incumbent
    _, _, incumbent_contract = read_drafter_dir(directory)
    problems = feature_differences(contract, incumbent_contract)
    if problems:
        return IncumbentSkipped(version=version, skipped="different capture contract: " + "; ".join(problems))
    result = evaluate_drafter(
        directory,
        shards,
        target_dir,
        steps,
        config.evaluate.micro_batch_size,
        config.train.attention_chunk,
        domains=domains,
    )
    return IncumbentEval(
        version=version,
        domains=result["domains"],
        target_differs=target_differences(incumbent_contract, contract),
        **{k: result[k] for k in AcceptanceMetrics.model_fields},
    )


def training_attempts(store: ObjectStore, train_uri: str) -> list[InitChoice]:
    """How each attempt of the training began (pipeline.training.init_choice), from its manifest."""
    manifest = read_manifest(store, store.key_for(train_uri), kind="train")
    return [InitChoice.model_validate(attempt["init"]) for attempt in manifest.get("attempts") or []]


def heldout_shards(config: RunConfig, store: ObjectStore, dataset: DatasetRecord) -> StreamingShards:
    """The dataset's eval (held-out) shards, streamed through the local shard cache."""
    refs = [ShardRef.from_manifest(entry) for entry in dataset.eval_shards]
    cache = ShardCache(
        store, Path(config.storage.local_cache) / "shards", int(config.train.cache_gb * (1 << 30))
    )
    return StreamingShards(refs, cache, config.train.max_length, config.train.prefetch_shards)


def local_drafter_dir(store: ObjectStore, train_prefix: str, workdir: Path) -> Path:
    """The trained drafter's files, fetched from the store and verified against the train manifest."""
    from pipeline.drafter.export import DRAFTER_FILES
    from pipeline.manifest import fetch_listed

    manifest = read_manifest(store, train_prefix, kind="train")
    out = workdir / "candidate_drafter"
    for name in DRAFTER_FILES:
        fetch_listed(store, train_prefix, manifest, f"drafter/{name}", out / name)
    return out


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    """The candidate, and the incumbent now behind the registry alias, on the dataset's eval shards."""
    train_uri, dataset_uri = inputs.train_uri, inputs.dataset_uri
    dataset = read_dataset(store, dataset_uri)
    if not dataset.eval_shards:
        raise EvaluationFailed(
            f"dataset {dataset_uri} has no held-out (eval) shards; raise prompts.eval_fraction"
        )
    workdir = config.storage.run_workdir(run_id)
    target = describe_target(config)
    incumbent = registry.pull_incumbent(
        store, config.target.name, config.registry.alias, workdir, target_config=target.model_dir
    )
    drafter_dir = local_drafter_dir(store, store.key_for(train_uri), workdir)
    shards = heldout_shards(config, store, dataset)
    steps = config.evaluate.ttt_steps or config.train.ttt_steps
    domains = [entry.domain for entry in dataset.eval_shards]
    result = evaluate_drafter(
        drafter_dir,
        shards,
        target.model_dir,
        steps,
        config.evaluate.micro_batch_size,
        config.train.attention_chunk,
        domains=domains,
        shapes=benchmark_shapes(config, steps),
        anchors=config.evaluate.simulated_anchors,
    )
    contract = dataset.contract.model_dump(mode="json")
    require_same_contract(contract, result.pop("contract"), "evaluating the candidate drafter")
    record = EvalRecord(
        **result,
        drafter=train_uri,
        dataset=dataset_uri,
        init=training_attempts(store, train_uri),
        incumbent=(
            evaluate_incumbent(incumbent, contract, shards, target.model_dir, steps, config, domains)
            if incumbent is not None
            else None
        ),
    )
    shards.close()
    prefix = layout.run_stage_prefix(run_id, "eval")
    manifest = publish_record(
        store, prefix, record, {"run_id": run_id, "summary": record.summary().model_dump(mode="json")}
    )
    log.info(
        "evaluate: cond_acc %s tau_simulated %.3f over %d samples (top-1 outside the draft vocabulary, "
        "counted as misses: %s)",
        record.cond_acc,
        record.tau_simulated,
        record.samples,
        record.inexpressible_fraction,
    )
    for domain, metrics in record.domains.items():
        log.info(
            "evaluate: domain %s: cond_acc %s tau_simulated %.3f over %d samples",
            domain,
            metrics.cond_acc,
            metrics.tau_simulated,
            metrics.samples,
        )
    return Output(uri=store.uri(prefix), kind=manifest["kind"])
