"""generate: regenerate every assistant turn with the target itself, turn by turn.

Resumable per shard: each finished output shard gets a `<shard>.done.json` marker (its sha256 and
counts); a rerun skips shards whose marker matches, and the manifest is written last.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pipeline import layout
from pipeline.chat import prompt_ids, user_turn_count
from pipeline.config import RunConfig
from pipeline.engines import EngineError, GenerationEngine, SamplingParams
from pipeline.manifest import manifest_exists, publish, read_listed, read_manifest
from pipeline.progress import Progress
from pipeline.records import decode_jsonl, encode_jsonl
from pipeline.stages import StageResult
from pipeline.storage import ObjectInfo, ObjectStore, open_store
from pipeline.target import resolve_model_dir

log = logging.getLogger(__name__)


class GenerationFailed(RuntimeError):
    pass


def make_engine(config: RunConfig) -> GenerationEngine:
    if config.generate.engine == "hf":
        from pipeline.engines.hf import HFEngine

        return HFEngine(resolve_model_dir(config))
    from pipeline.engines.sglang import SGLangEngine

    assert config.generate.sglang is not None
    return SGLangEngine(config.generate.sglang)


def regenerate(records: list[dict[str, Any]], engine: GenerationEngine, tokenizer, config: RunConfig,
               progress: Progress) -> tuple[list[dict[str, Any]], int]:
    """Replace every assistant turn by the target's answer given the regenerated history.

    Turn r of all conversations that have one is generated in batches before turn r + 1.
    Returns the regenerated records and the number that failed.
    """
    settings = config.generate
    states = [{"record": r, "history": [m for m in r["messages"] if m["role"] == "system"],
               "users": [m for m in r["messages"] if m["role"] == "user"], "finish": [], "tokens": 0}
              for r in records]
    failed = 0
    for turn in range(max(user_turn_count(r["messages"]) for r in records)):
        active = [s for s in states if turn < len(s["users"]) and s.get("error") is None]
        for s in active:
            s["history"].append(s["users"][turn])
        active.sort(key=lambda s: len(prompt_ids(tokenizer, s["history"])))
        for start in range(0, len(active), settings.batch_size):
            batch = active[start:start + settings.batch_size]
            prompts = [prompt_ids(tokenizer, s["history"]) for s in batch]
            params = SamplingParams(settings.max_new_tokens, settings.temperature, seed=turn * 1_000_003 + start)
            try:
                results = engine.generate(prompts, params)
            except EngineError as err:
                for s in batch:
                    s["error"] = str(err)
                failed += len(batch)
                continue
            for s, result in zip(batch, results):
                # kept verbatim (no strip): capture must see exactly what the target wrote
                text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
                if not text.strip():
                    s["error"] = "empty response"
                    failed += 1
                    continue
                s["history"].append({"role": "assistant", "content": text})
                s["finish"].append(result.finish_reason)
                s["tokens"] += len(result.output_ids)
                s["last_output_ids"] = result.output_ids
            if turn == 0:
                progress.update(len(batch))
    done = []
    for s in states:
        if s.get("error") is not None:
            continue
        record = dict(s["record"])
        record["messages"] = s["history"]
        record["generation"] = {"engine": getattr(engine, "name", "?"), "finish_reasons": s["finish"],
                                "completion_tokens": s["tokens"], "last_output_ids": s["last_output_ids"]}
        done.append(record)
    return done, failed


def _marker_key(prefix: str, shard_name: str) -> str:
    return f"{prefix}/{shard_name}.done.json"


def _finished_shard(store: ObjectStore, prefix: str, shard_name: str) -> dict[str, Any] | None:
    key = _marker_key(prefix, shard_name)
    if not store.exists(key):
        return None
    marker = json.loads(store.get_bytes(key))
    data_key = f"{prefix}/{shard_name}"
    if not store.exists(data_key):
        return None
    return marker


def run(config: RunConfig, prompts_uri: str, snapshot: str, store: ObjectStore | None = None) -> StageResult:
    store = store or open_store(config.storage)
    in_prefix = store.key_for(prompts_uri)
    prompts = read_manifest(store, in_prefix, kind="prompts")
    prefix = layout.responses_prefix(config.target.name, snapshot)
    if manifest_exists(store, prefix):
        log.info("responses %s already published; reusing them", store.uri(prefix))
        return StageResult(store.uri(prefix), read_manifest(store, prefix, kind="responses"))
    from pipeline.target import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(config))
    engine = None
    objects: list[ObjectInfo] = []
    shards, totals = [], {"input": 0, "succeeded": 0, "failed": 0, "skipped_shards": 0}
    progress = Progress(total=sum(s["samples"] for s in prompts["shards"]), desc="generate", unit="conv")
    for shard in prompts["shards"]:
        totals["input"] += shard["samples"]
        marker = _finished_shard(store, prefix, shard["name"])
        if marker is not None:
            objects.append(ObjectInfo(f"{prefix}/{shard['name']}", marker["bytes"], marker["sha256"]))
            shards.append(marker["shard"])
            totals["succeeded"] += marker["shard"]["samples"]
            totals["failed"] += marker["failed"]
            totals["skipped_shards"] += 1
            progress.update(shard["samples"])
            continue
        engine = engine or make_engine(config)
        records = decode_jsonl(read_listed(store, in_prefix, prompts, shard["name"]))
        done, failed = regenerate(records, engine, tokenizer, config, progress)
        info = store.put_bytes(f"{prefix}/{shard['name']}", encode_jsonl(done))
        entry = {"name": shard["name"], "split": shard["split"], "samples": len(done)}
        store.put_bytes(_marker_key(prefix, shard["name"]), json.dumps(
            {"bytes": info.bytes, "sha256": info.sha256, "shard": entry, "failed": failed}).encode())
        objects.append(info)
        shards.append(entry)
        totals["succeeded"] += len(done)
        totals["failed"] += failed
    progress.close()
    if totals["succeeded"] == 0:
        raise GenerationFailed(f"generation produced no responses: {totals}")
    manifest = publish(store, prefix, "responses", objects, {
        "snapshot": snapshot, "prompts": store.uri(in_prefix), "target": config.target.name,
        "engine": config.generate.engine, "config": config.generate.model_dump(mode="json"),
        "counts": totals, "shards": shards,
    })
    log.info("generate: %s", totals)
    return StageResult(store.uri(prefix), manifest)
