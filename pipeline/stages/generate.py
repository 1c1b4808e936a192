"""generate: regenerate every assistant turn with the target itself, turn by turn.

Resumable per shard: each finished output shard gets a `<shard>.done.json` marker (its sha256 and
counts); a rerun skips shards whose marker matches, and the manifest is written last.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any

from pipeline import layout
from pipeline.config import DEFAULT_DOMAIN, RunConfig
from pipeline.config_records import artifact_record, claim, require_same
from pipeline.data.conversations import prompt_ids, user_turn_count
from pipeline.data.jsonl import decode_jsonl, encode_jsonl
from pipeline.engines import EngineError, EngineUnavailable, GenerationEngine, SamplingParams, engine_servers
from pipeline.engines.target import resolve_model_dir
from pipeline.manifest import read_listed, read_manifest
from pipeline.progress import Progress
from pipeline.stages import StageInputs, StageOutput, already_published
from pipeline.stages.shards import ShardJob, publish_with_left_out, shard_task
from pipeline.storage import ObjectInfo, ObjectStore, open_store

log = logging.getLogger(__name__)


class GenerationFailed(RuntimeError):
    pass


def make_engine(config: RunConfig) -> GenerationEngine:
    """The configured engine, started; one that holds a process (a local vLLM worker) is a context manager,
    which `started_engine` closes when the stage ends."""
    settings = config.generate
    if settings.engine == "hf":
        from pipeline.engines.hf import HFEngine

        return HFEngine(resolve_model_dir(config), trust_remote_code=config.target.trust_remote_code)
    if settings.engine == "vllm" and settings.vllm_server is not None:
        from pipeline.engines.vllm_openai import VllmServerEngine

        return VllmServerEngine(settings.vllm_server)
    if settings.engine == "vllm":
        from pipeline.engine_settings import VllmEngineConfig
        from pipeline.engines.vllm_generate import VllmGenerateEngine

        return VllmGenerateEngine(
            resolve_model_dir(config),
            settings.vllm or VllmEngineConfig(),
            trust_remote_code=config.target.trust_remote_code,
            teacher_topk=settings.teacher_topk,
        )
    from pipeline.engines.sglang import SGLangEngine

    assert settings.sglang is not None
    return SGLangEngine(settings.sglang)


def started_engine(config: RunConfig, lifetime: ExitStack) -> GenerationEngine:
    """make_engine's engine, closed when `lifetime` ends if it holds a process."""
    engine = make_engine(config)
    if isinstance(engine, AbstractContextManager):
        lifetime.enter_context(engine)
    return engine


@dataclass
class _Conversation:
    """One record being regenerated turn by turn."""

    record: dict[str, Any]
    history: list[dict[str, str]]  # system messages, then the user turns and regenerated answers so far
    users: list[dict[str, str]]
    finish: list[str] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    last_output_ids: list[int] | None = None
    last_top_logprobs: list[list[list[float]]] | None = None


def _conversation(record: dict[str, Any]) -> _Conversation:
    return _Conversation(
        record,
        history=[m for m in record["messages"] if m["role"] == "system"],
        users=[m for m in record["messages"] if m["role"] == "user"],
    )


def regenerate(
    records: list[dict[str, Any]], engine: GenerationEngine, tokenizer, config: RunConfig, progress: Progress
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Replace every assistant turn by the target's answer given the regenerated history.

    Turn r of all conversations that have one is generated in batches before turn r + 1.
    Returns the regenerated records and the failures ({"id", "error"}).
    """
    settings = config.generate
    states = [_conversation(r) for r in records]
    for turn in range(max(user_turn_count(r["messages"]) for r in records)):
        active = [s for s in states if turn < len(s.users) and s.error is None]
        for s in active:
            s.history.append(s.users[turn])
        active.sort(key=lambda s: len(prompt_ids(tokenizer, s.history)))
        for start in range(0, len(active), settings.batch_size):
            batch = active[start : start + settings.batch_size]
            prompts = [prompt_ids(tokenizer, s.history) for s in batch]
            params = SamplingParams(
                settings.max_new_tokens,
                settings.temperature,
                seed=turn * 1_000_003 + start,
                top_logprobs=settings.teacher_topk or 0,
            )
            try:
                results = engine.generate(prompts, params)
            except EngineUnavailable:
                raise  # the servers are gone: stop, keep the finished parts, and let a rerun resume
            except EngineError as err:
                for s in batch:
                    s.error = str(err)
                continue
            for s, result in zip(batch, results, strict=True):
                # kept verbatim (no strip): capture must see exactly what the target wrote
                text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
                if not text.strip():
                    s.error = "empty response"
                    continue
                s.history.append({"role": "assistant", "content": text})
                s.finish.append(result.finish_reason)
                s.tokens += len(result.output_ids)
                s.last_output_ids = result.output_ids
                s.last_top_logprobs = result.top_logprobs
            if turn == 0:
                progress.update(len(batch))
    done, failures = [], []
    for s in states:
        if s.error is not None:
            failures.append({"id": s.record["id"], "error": s.error})
            continue
        done.append(_regenerated_record(s, getattr(engine, "name", "?")))
    return done, failures


def _regenerated_record(conversation: _Conversation, engine_name: str) -> dict[str, Any]:
    if conversation.last_output_ids is None:  # the prompts stage keeps only records with a user turn
        raise ValueError(f"record {conversation.record['id']} has no user turn: nothing was generated for it")
    record = dict(conversation.record)
    record["messages"] = conversation.history
    record["generation"] = {
        "engine": engine_name,
        "finish_reasons": conversation.finish,
        "completion_tokens": conversation.tokens,
        "last_output_ids": conversation.last_output_ids,
    }
    if conversation.last_top_logprobs is not None:
        record["generation"]["last_top_logprobs"] = conversation.last_top_logprobs
    return record


def finished_shard(store: ObjectStore, prefix: str, shard_name: str) -> dict[str, Any] | None:
    """The record of a prompt shard regenerated by an earlier attempt, if its output is complete."""
    key = layout.shard_marker_key(prefix, shard_name)
    if not store.exists(key) or not store.exists(f"{prefix}/{shard_name}"):
        return None
    return json.loads(store.get_bytes(key))


def _finished_parts(store: ObjectStore, prefix: str, shard_name: str) -> dict[str, dict[str, Any]]:
    """Records regenerated by earlier attempts at this shard, by sample id (each part is one atomic
    object)."""
    done: dict[str, dict[str, Any]] = {}
    for key in store.list(layout.shard_parts_prefix(prefix, shard_name)):
        for record in decode_jsonl(store.get_bytes(key)):
            done[record["id"]] = record
    return done


def generate_shard(job: ShardJob, engine: GenerationEngine, tokenizer, config: RunConfig) -> dict[str, Any]:
    """Regenerate one shard part by part; a rerun skips every record an earlier attempt finished."""
    store, prefix, shard, records, progress = job.store, job.prefix, job.shard, job.records, job.progress
    started = time.monotonic()
    earlier = _finished_parts(store, prefix, shard["name"])
    todo = [r for r in records if r["id"] not in earlier]
    progress.update(len(records) - len(todo))
    part_size = config.generate.checkpoint_every
    failures: list[dict[str, str]] = []
    parts_prefix = layout.shard_parts_prefix(prefix, shard["name"])
    first_part = len(store.list(parts_prefix))
    for number, start in enumerate(range(0, len(todo), part_size)):
        done, failed = regenerate(todo[start : start + part_size], engine, tokenizer, config, progress)
        failures += failed
        if done:
            store.put_bytes(f"{parts_prefix}/part-{first_part + number:05d}.jsonl", encode_jsonl(done))
            earlier.update({record["id"]: record for record in done})
    ordered = [earlier[r["id"]] for r in records if r["id"] in earlier]
    info = store.put_bytes(f"{prefix}/{shard['name']}", encode_jsonl(ordered))
    counts = {
        "succeeded": len(todo) - len(failures),
        "skipped": len(records) - len(todo),
        "failed": len(failures),
    }
    marker = {
        "bytes": info.bytes,
        "sha256": info.sha256,
        "failures": failures,
        "counts": counts,
        "shard": {
            "name": shard["name"],
            "split": shard["split"],
            "domain": shard.get("domain", DEFAULT_DOMAIN),
            "samples": len(ordered),
        },
        "timing": {
            "seconds": round(time.monotonic() - started, 3),
            "servers": engine_servers(config.generate),
        },
    }
    store.put_bytes(layout.shard_marker_key(prefix, shard["name"]), json.dumps(marker).encode())
    _delete_parts(store, prefix, shard["name"])
    return marker


def _delete_parts(store: ObjectStore, prefix: str, shard_name: str) -> None:
    """The parts of a finished shard: its marker is written first, so a process killed in between leaves
    parts that the next attempt (which finds the shard finished) deletes here."""
    for key in store.list(layout.shard_parts_prefix(prefix, shard_name)):
        store.delete(key)


def run_shard(
    config: RunConfig, prompts_uri: str, snapshot: str, shard_name: str, store: ObjectStore | None = None
) -> dict[str, Any]:
    """One prompt shard (a mapped scheduler task); `run` then publishes once every shard is done."""
    store = store or open_store(config.storage)
    task = shard_task(config, store, "responses", snapshot, prompts_uri, shard_name)
    marker = finished_shard(store, task.prefix, shard_name)
    if marker is not None:
        _delete_parts(store, task.prefix, shard_name)
    else:
        from pipeline.engines.target import load_tokenizer

        progress = Progress(total=task.shard["samples"], desc=f"generate {shard_name}", unit="conv")
        records = task.records(store)
        with ExitStack() as lifetime:
            engine = started_engine(config, lifetime)
            claim(store, task.record, config)
            marker = generate_shard(
                ShardJob(store, task.prefix, task.shard, records, progress),
                engine,
                load_tokenizer(resolve_model_dir(config), config.target.trust_remote_code),
                config,
            )
        progress.close()
    return {"shard": shard_name, "samples": marker["shard"]["samples"], "failed": len(marker["failures"])}


class Inputs(StageInputs):
    prompts_uri: str
    snapshot: str


Output = StageOutput


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    """Every prompt shard regenerated (finished shards reused), then the responses manifest."""
    prompts_uri, snapshot = inputs.prompts_uri, inputs.snapshot
    in_prefix = store.key_for(prompts_uri)
    prompts = read_manifest(store, in_prefix, kind="prompts")
    prefix = layout.responses_prefix(config.target.name, snapshot)
    record = artifact_record(store, prefix, "responses")
    require_same(store, record, config)  # finished shards and parts are reused only under their config
    if published := already_published(store, prefix, "responses"):
        return published
    from pipeline.engines.target import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(config), config.target.trust_remote_code)
    engine = None
    objects: list[ObjectInfo] = []
    shards, failures = [], []
    totals = {"input": 0, "succeeded": 0, "skipped": 0, "failed": 0}
    progress = Progress(total=sum(s["samples"] for s in prompts["shards"]), desc="generate", unit="conv")
    with ExitStack() as lifetime:  # the engine starts at the first unfinished shard and stops at the end
        for shard in prompts["shards"]:
            totals["input"] += shard["samples"]
            marker = finished_shard(store, prefix, shard["name"])
            if marker is not None:  # finished by an earlier attempt: every sample it holds is skipped
                _delete_parts(store, prefix, shard["name"])
                progress.update(shard["samples"])
                totals["skipped"] += marker["shard"]["samples"]
                totals["failed"] += marker["counts"]["failed"]
            else:
                engine = engine or started_engine(config, lifetime)
                records = decode_jsonl(read_listed(store, in_prefix, prompts, shard["name"]))
                claim(store, record, config)  # recorded before the first part made with it
                marker = generate_shard(
                    ShardJob(store, prefix, shard, records, progress), engine, tokenizer, config
                )
                for key, value in marker["counts"].items():
                    totals[key] += value
            failures += marker["failures"]
            objects.append(ObjectInfo(f"{prefix}/{shard['name']}", marker["bytes"], marker["sha256"]))
            shards.append(marker["shard"])
    progress.close()
    if totals["succeeded"] + totals["skipped"] == 0:
        raise GenerationFailed(f"generation produced no responses: {totals}")
    fields = {
        "snapshot": snapshot,
        "prompts": store.uri(in_prefix),
        "target": config.target.name,
        "engine": config.generate.engine,
        "config": config.generate.model_dump(mode="json"),
        "counts": totals,
        "shards": shards,
    }
    claim(store, record, config)
    manifest = publish_with_left_out(
        store, prefix, "responses", objects, ("failures.jsonl", failures), fields
    )
    log.info("generate: %s", totals)
    return Output(uri=store.uri(prefix), kind=manifest["kind"])
