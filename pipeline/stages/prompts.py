"""prompts: sources -> normalized, deduplicated, length-filtered conversations in train/eval shards."""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from pipeline import layout
from pipeline.chat import BadRecord, normalize_conversation
from pipeline.config import PromptsConfig, PromptSource, RunConfig, StorageConfig
from pipeline.dedup import ExactDuplicateFilter, NearDuplicateFilter
from pipeline.manifest import manifest_exists, publish, read_manifest
from pipeline.progress import Progress
from pipeline.records import conversation_id, write_jsonl
from pipeline.stages import StageResult
from pipeline.storage import ObjectStore, open_store
from pipeline.target import load_tokenizer, resolve_model_dir

log = logging.getLogger(__name__)
SPLITS = ("train", "eval")
JUDGE_BATCH = 256


class PromptSourceError(RuntimeError):
    pass


def _hash_order(record: dict[str, Any]) -> str:
    return hashlib.sha256(repr(record.get("source", record)).encode()).hexdigest()


SOURCE_SUFFIXES = {"jsonl": (".jsonl", ".json"), "json": (".json", ".jsonl"), "parquet": (".parquet",),
                   "arrow": (".arrow",)}
DATASETS_BUILDER = {"jsonl": "json", "json": "json", "parquet": "parquet", "arrow": "arrow"}


def _s3_source_files(uri: str, kind: str, storage: StorageConfig) -> list[Path]:
    """Download an s3:// object, or every object of the source's kind under an s3:// prefix, to the cache.

    Files are cached under a hash of their URI and ETag, so a rerun downloads nothing new.
    """
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, key = uri[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=storage.endpoint_url, region_name=storage.region)
    try:
        listing = client.list_objects_v2(Bucket=bucket, Prefix=key)
        objects = [o for o in listing.get("Contents", [])
                   if o["Key"] == key or (key.endswith("/") or not key) and o["Key"].endswith(SOURCE_SUFFIXES[kind])]
        if not objects:
            raise PromptSourceError(f"prompt source {uri}: no {kind} objects there")
        files = []
        for obj in sorted(objects, key=lambda o: o["Key"]):
            name = hashlib.sha256(f"s3://{bucket}/{obj['Key']}@{obj['ETag']}".encode()).hexdigest()[:24]
            path = Path(storage.local_cache) / "sources" / (name + Path(obj["Key"]).suffix)
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(".part")
                client.download_file(bucket, obj["Key"], str(partial))
                partial.replace(path)
            files.append(path)
        return files
    except (BotoCoreError, ClientError) as err:
        raise PromptSourceError(f"cannot read prompt source {uri}: {err}") from err


def _local_source_files(path: str, kind: str) -> list[Path]:
    local = Path(path[len("file://"):] if path.startswith("file://") else path)
    if local.is_dir():
        files = sorted(p for p in local.rglob("*") if p.suffix in SOURCE_SUFFIXES[kind])
    elif any(ch in local.name for ch in "*?["):
        files = sorted(local.parent.glob(local.name))
    else:
        files = [local] if local.exists() else []
    if not files:
        raise PromptSourceError(f"prompt source {path!r} does not exist or holds no {kind} files")
    return files


def iter_source(source: PromptSource, storage: StorageConfig) -> Iterator[Any]:
    """Records of one source, streamed (a file is never loaded whole)."""
    if source.kind == "demo":
        from pipeline.tiny_target import demo_conversations

        yield from sorted(demo_conversations(), key=_hash_order)
        return
    path = source.path or ""
    if path.startswith("s3://"):
        files = _s3_source_files(path, source.kind, storage)
    elif "://" in path and not path.startswith("file://"):
        raise PromptSourceError(f"prompt source {path!r}: use a local path, file:// or s3://")
    else:
        files = _local_source_files(path, source.kind)
    import datasets

    try:
        stream = datasets.load_dataset(DATASETS_BUILDER[source.kind], data_files=[str(f) for f in files],
                                       split="train", streaming=True)
        yield from stream
    except Exception as err:  # datasets raises many types for unreadable files
        raise PromptSourceError(f"cannot read prompt source {path!r} as {source.kind}: {err}") from err


def mix_sources(sources: list[PromptSource], storage: StorageConfig) -> Iterator[tuple[int, Any]]:
    """Interleave sources in proportion to their weights (smooth weighted round robin)."""
    iterators = {i: iter_source(s, storage) for i, s in enumerate(sources)}
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


class PromptFilter:
    """Decides whether conversations are kept; rejections name their reason.

    Records are judged in batches so the length check tokenizes many prompts per call.
    """

    def __init__(self, settings: PromptsConfig, tokenizer):
        self.settings, self.tokenizer = settings, tokenizer
        self.exact = ExactDuplicateFilter()
        self.near = NearDuplicateFilter() if settings.near_dedup else None

    def judge(self, records: list[Any]) -> list[tuple[str, list[dict[str, str]]] | BadRecord]:
        """Per record: (sample id, messages) when kept, else the BadRecord saying why not."""
        verdicts: list[Any] = []
        candidates = []
        for record in records:
            try:
                messages = normalize_conversation(record)
            except BadRecord as bad:
                verdicts.append(bad)
                continue
            sample_id = conversation_id(messages)
            if self.exact.check_and_add(sample_id):
                verdicts.append(BadRecord("duplicate"))
                continue
            first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
            verdicts.append((sample_id, messages))
            candidates.append((len(verdicts) - 1, messages[:first_user + 1]))
        texts = [self.tokenizer.apply_chat_template(prefix, add_generation_prompt=True, tokenize=False)
                 for _, prefix in candidates]
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
        for (index, _), length in zip(candidates, lengths):
            if length < self.settings.min_prompt_tokens:
                verdicts[index] = BadRecord("too_short")
            elif length > self.settings.max_prompt_tokens:
                verdicts[index] = BadRecord("too_long")
            elif self.near is not None:
                asked = "\n".join(m["content"] for m in verdicts[index][1] if m["role"] != "assistant")
                if self.near.check_and_add(asked):
                    verdicts[index] = BadRecord("near_duplicate")
        return verdicts


def _batched(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def run(config: RunConfig, snapshot: str, store: ObjectStore | None = None) -> StageResult:
    store = store or open_store(config.storage)
    prefix = layout.prompts_prefix(snapshot)
    if manifest_exists(store, prefix):
        log.info("prompts snapshot %s already published; reusing it", store.uri(prefix))
        return StageResult(store.uri(prefix), read_manifest(store, prefix, kind="prompts"))
    settings = config.prompts
    judge = PromptFilter(settings, load_tokenizer(resolve_model_dir(config)))
    counts: Counter = Counter()
    kept_per_source: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="prompts-") as tmp:
        writer = ShardWriter(store, prefix, settings.shard_size, Path(tmp))
        progress = Progress(total=settings.num_samples, desc="prompts", unit="conv")
        for batch in _batched(mix_sources(settings.sources, config.storage), JUDGE_BATCH):
            for (source_index, record), verdict in zip(batch, judge.judge([record for _, record in batch])):
                if counts["kept"] >= settings.num_samples:
                    break
                counts["read"] += 1
                if isinstance(verdict, BadRecord):
                    counts[f"rejected.{verdict.reason}"] += 1
                    continue
                sample_id, messages = verdict
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
