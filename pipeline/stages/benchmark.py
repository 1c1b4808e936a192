"""benchmark: tok/s and acceptance of baseline, n-gram, incumbent and candidate in ONE run, measured by the
engine the drafter will be served with (benchmark.engine: pipeline.benchmark), and by the reference decoder
beside it (benchmark.reference_beside). The stage reads its inputs (the evaluation, the drafters, the
held-out prompts), runs the engines, decides once (pipeline.promotion.speed_decision) and publishes
bench.json.
"""

from __future__ import annotations

import logging
from itertools import chain
from pathlib import Path

from pipeline import layout
from pipeline.benchmark.job import BenchJob, BenchmarkFailed, run_engine
from pipeline.config import DEFAULT_DOMAIN, RunConfig
from pipeline.data.conversations import prompt_ids
from pipeline.data.jsonl import decode_jsonl
from pipeline.drafter.export import read_drafter_dir
from pipeline.engines.target import describe_target, load_tokenizer
from pipeline.manifest import read_listed, read_manifest
from pipeline.ops import registry
from pipeline.promotion import deciding_engine, speed_decision
from pipeline.records import BenchRecord, EngineBench, EvalRecord, publish_record, read_record
from pipeline.stages import StageInputs, StageOutput
from pipeline.stages.evaluate import local_drafter_dir
from pipeline.storage import ObjectStore

log = logging.getLogger(__name__)


def heldout_prompts(store: ObjectStore, prompts_uri: str, tokenizer, count: int) -> list[list[int]]:
    """The first user turn of up to `count` held-out conversations, taken from every domain in turn (one of
    each, then the next of each), so the benchmark covers all domains alike."""
    return heldout_set(store, prompts_uri, tokenizer, count)[0]


def heldout_set(
    store: ObjectStore, prompts_uri: str, tokenizer, count: int
) -> tuple[list[list[int]], list[str]]:
    """heldout_prompts, with each prompt's domain."""
    prefix = store.key_for(prompts_uri)
    manifest = read_manifest(store, prefix, kind="prompts")
    shards_of: dict[str, list[str]] = {}
    for shard in manifest["shards"]:
        if shard["split"] == "eval":
            shards_of.setdefault(shard.get("domain", DEFAULT_DOMAIN), []).append(shard["name"])
    streams = [
        (
            domain,
            chain.from_iterable(decode_jsonl(read_listed(store, prefix, manifest, name)) for name in names),
        )
        for domain, names in sorted(shards_of.items())
    ]
    prompts: list[list[int]] = []
    domains: list[str] = []
    while streams and len(prompts) < count:
        for domain, stream in list(streams):
            record = next(stream, None)
            if record is None:
                streams.remove((domain, stream))
                continue
            first_user = next(i for i, m in enumerate(record["messages"]) if m["role"] == "user")
            prompts.append(prompt_ids(tokenizer, record["messages"][: first_user + 1]))
            domains.append(domain)
            if len(prompts) == count:
                break
    if not prompts:
        raise BenchmarkFailed(f"prompts {prompts_uri} have no held-out (eval) conversations to benchmark on")
    return prompts, domains


class Inputs(StageInputs):
    train_uri: str
    eval_uri: str
    prompts_uri: str


Output = StageOutput


def incumbent_dir(config: RunConfig, store: ObjectStore, evaluation: EvalRecord, run_id: str) -> Path | None:
    """The incumbent version the evaluation compared against (not whatever the alias names now)."""
    if evaluation.incumbent is None:
        return None
    workdir = config.storage.run_workdir(run_id)
    return registry.pull(
        store,
        config.target.name,
        evaluation.incumbent.version,
        workdir / "incumbent_drafter",
        describe_target(config).model_dir,
    )


def bench_job(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> BenchJob:
    """What the engines measure on: the run's candidate and the incumbent its evaluation compared against
    (both reading the same aux layers), and the held-out prompts of every domain."""
    evaluation = read_record(store, inputs.eval_uri, EvalRecord)
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir, config.target.trust_remote_code)
    workdir = config.storage.run_workdir(run_id)
    drafter_dirs = {"candidate": local_drafter_dir(store, store.key_for(inputs.train_uri), workdir)}
    incumbent = incumbent_dir(config, store, evaluation, run_id)
    if incumbent is not None:
        drafter_dirs["incumbent"] = incumbent
    contracts = {name: read_drafter_dir(path)[2] for name, path in drafter_dirs.items()}
    aux_layer_ids = contracts["candidate"]["aux_layer_ids"]
    for name, contract in contracts.items():
        if contract["aux_layer_ids"] != aux_layer_ids:
            raise BenchmarkFailed(
                f"{name} drafter reads aux layers {contract['aux_layer_ids']}, the candidate {aux_layer_ids}"
            )
    heldout = heldout_set(store, inputs.prompts_uri, tokenizer, config.benchmark.num_prompts)
    target_dir = Path(target.model_dir)
    return BenchJob(config, run_id, target_dir, tokenizer, *heldout, drafter_dirs, evaluation, aux_layer_ids)


def measured(job: BenchJob) -> tuple[EngineBench, dict[str, EngineBench]]:
    """The serving engine's figures, and what was measured beside them: the reference decoder's, whose
    acceptance check moves onto the serving engine's figures (it decides with them)."""
    settings = job.settings
    figures = run_engine(settings.engine, job)
    if not settings.reference_beside:
        return figures, {}
    reference = run_engine("reference", job.beside(figures))
    figures.acceptance, reference.acceptance = reference.acceptance, None
    return figures, {"reference": reference}


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    figures, beside = measured(bench_job(config, inputs, run_id, store))
    decision = speed_decision(figures, config.benchmark)
    record = BenchRecord.model_validate(
        {**figures.model_dump(), "run_id": run_id, "decision": decision.model_dump(), "beside": beside}
    )
    prefix = layout.run_stage_prefix(run_id, "bench")
    summary = {**record.summary().model_dump(mode="json"), "decision": decision.model_dump(mode="json")}
    manifest = publish_record(store, prefix, record, {"run_id": run_id, "summary": summary})
    log_record(record)
    return Output(uri=store.uri(prefix), kind=manifest["kind"])


def log_record(record: BenchRecord) -> None:
    log.info(
        "benchmark (%s): baseline %.1f tok/s, ngram %.1f (%s), candidate %.1f at steps %d topk %d tokens %d "
        "(tau %s measured, %.2f simulated)",
        deciding_engine(record),
        record.baseline_tok_s,
        record.methods.ngram.tok_s,
        record.ngram_sweep.best if record.ngram_sweep else "-",
        record.drafter_tok_s,
        record.draft_steps,
        record.topk,
        record.draft_tokens,
        record.tau_measured,
        record.tau_simulated,
    )
    for name, figures in record.beside.items():
        speedup = figures.speedups["baseline"]
        log.info(
            "benchmark beside (%s, not decisive): candidate %.3f [%.3f, %.3f] over its own baseline",
            name,
            speedup.ratio,
            speedup.ci_low,
            speedup.ci_high,
        )
    for reason in record.decision.reasons:
        log.info("benchmark decision: %s", reason)
    if record.decision.verdict == "inconclusive":
        log.warning("benchmark inconclusive: %s", record.decision.next_step)
