"""prompts: sources -> normalized, deduplicated, length-filtered conversations in train/eval shards."""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from pipeline import layout
from pipeline.chat import BadRecord, normalize_conversation, prompt_ids
from pipeline.config import PromptSource, RunConfig
from pipeline.manifest import manifest_exists, publish, read_manifest
from pipeline.progress import Progress
from pipeline.records import conversation_id, write_jsonl
from pipeline.stages import StageResult
from pipeline.storage import ObjectStore, open_store
from pipeline.target import load_tokenizer, resolve_model_dir

log = logging.getLogger(__name__)
SPLITS = ("train", "eval")


class PromptSourceError(RuntimeError):
    pass


def _hash_order(record: dict[str, Any]) -> str:
    return hashlib.sha256(repr(record.get("source", record)).encode()).hexdigest()


def iter_source(source: PromptSource) -> Iterator[Any]:
    if source.kind == "demo":
        from pipeline.tiny_target import demo_conversations

        yield from sorted(demo_conversations(), key=_hash_order)
        return
    path = source.path or ""
    if "://" in path and not path.startswith("file://"):
        raise PromptSourceError(f"prompt source {path!r}: only local files are read in this version")
    local = path[len("file://"):] if path.startswith("file://") else path
    if not Path(local).exists():
        raise PromptSourceError(f"prompt source {path!r} does not exist")
    import datasets

    builder = {"jsonl": "json", "json": "json", "parquet": "parquet"}[source.kind]
    try:
        stream = datasets.load_dataset(builder, data_files=local, split="train", streaming=True)
        yield from stream
    except Exception as err:  # datasets raises many types for unreadable files
        raise PromptSourceError(f"cannot read prompt source {path!r} as {source.kind}: {err}") from err


def mix_sources(sources: list[PromptSource]) -> Iterator[tuple[int, Any]]:
    """Interleave sources in proportion to their weights (smooth weighted round robin)."""
    iterators = {i: iter_source(s) for i, s in enumerate(sources)}
    credit = {i: 0.0 for i in iterators}
    total = sum(s.weight for s in sources)
    while iterators:
        for i in iterators:
            credit[i] += sources[i].weight
        chosen = max(iterators, key=lambda i: credit[i])
        credit[chosen] -= total
        try:
            yield chosen, next(iterators[chosen])
        except StopIteration:
            del iterators[chosen]
            del credit[chosen]
            total = sum(sources[i].weight for i in iterators)


def split_of(sample_id: str, eval_fraction: float) -> str:
    return "eval" if int(sample_id[:8], 16) / 0x100000000 < eval_fraction else "train"


class ShardWriter:
    """Buffers records per split and uploads a JSONL shard whenever one fills up."""

    def __init__(self, store: ObjectStore, prefix: str, shard_size: int, workdir: Path):
        self.store, self.prefix, self.shard_size, self.workdir = store, prefix, shard_size, workdir
        self.buffers: dict[str, list[dict]] = {split: [] for split in SPLITS}
        self.objects = []
        self.shards: list[dict] = []

    def add(self, record: dict) -> None:
        buffer = self.buffers[record["split"]]
        buffer.append(record)
        if len(buffer) >= self.shard_size:
            self.flush(record["split"])

    def flush(self, split: str) -> None:
        buffer = self.buffers[split]
        if not buffer:
            return
        index = sum(1 for s in self.shards if s["split"] == split)
        name = f"{split}-{index:05d}.jsonl"
        path = self.workdir / name
        write_jsonl(path, buffer)
        self.objects.append(self.store.put_file(f"{self.prefix}/{name}", path))
        self.shards.append({"name": name, "split": split, "samples": len(buffer)})
        path.unlink()
        self.buffers[split] = []

    def close(self) -> None:
        for split in SPLITS:
            self.flush(split)


def run(config: RunConfig, snapshot: str, store: ObjectStore | None = None) -> StageResult:
    store = store or open_store(config.storage)
    prefix = layout.prompts_prefix(snapshot)
    if manifest_exists(store, prefix):
        log.info("prompts snapshot %s already published; reusing it", store.uri(prefix))
        return StageResult(store.uri(prefix), read_manifest(store, prefix, kind="prompts"))
    settings = config.prompts
    tokenizer = load_tokenizer(resolve_model_dir(config))
    counts: Counter = Counter()
    seen: set[str] = set()
    kept_per_source: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="prompts-") as tmp:
        writer = ShardWriter(store, prefix, settings.shard_size, Path(tmp))
        progress = Progress(total=settings.num_samples, desc="prompts", unit="conv")
        for source_index, record in mix_sources(settings.sources):
            counts["read"] += 1
            try:
                messages = normalize_conversation(record)
            except BadRecord as bad:
                counts[f"rejected.{bad.reason}"] += 1
                continue
            sample_id = conversation_id(messages)
            if sample_id in seen:
                counts["rejected.duplicate"] += 1
                continue
            seen.add(sample_id)
            first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
            length = len(prompt_ids(tokenizer, messages[:first_user + 1]))
            if length < settings.min_prompt_tokens:
                counts["rejected.too_short"] += 1
                continue
            if length > settings.max_prompt_tokens:
                counts["rejected.too_long"] += 1
                continue
            source = settings.sources[source_index]
            writer.add({"id": sample_id, "split": split_of(sample_id, settings.eval_fraction),
                        "source": record.get("source") or source.path or source.kind, "messages": messages})
            counts["kept"] += 1
            kept_per_source[source_index] += 1
            progress.update(1)
            if counts["kept"] >= settings.num_samples:
                break
        progress.close()
        writer.close()
    if counts["kept"] == 0:
        raise PromptSourceError(f"no usable conversations in the prompt sources; counts: {dict(counts)}")
    manifest = publish(store, prefix, "prompts", writer.objects, {
        "snapshot": snapshot,
        "config": settings.model_dump(mode="json"),
        "counts": dict(counts),
        "kept_per_source": {settings.sources[i].path or settings.sources[i].kind: n
                            for i, n in kept_per_source.items()},
        "shards": writer.shards,
    })
    rejected = {k: v for k, v in counts.items() if k.startswith("rejected.")}
    log.info("prompts: kept %d of %d read; rejected %s", counts["kept"], counts["read"], rejected or "none")
    return StageResult(store.uri(prefix), manifest)
