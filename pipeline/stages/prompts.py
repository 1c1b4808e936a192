"""prompts: sources -> normalized, deduplicated, length-filtered conversations in train/eval shards."""

from __future__ import annotations

import gzip
import hashlib
import logging
import tempfile
import uuid
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, cast

import orjson

from pipeline import layout
from pipeline.config import PromptsConfig, PromptSource, RunConfig
from pipeline.config_records import artifact_record, claim, require_same
from pipeline.credentials import without_credentials
from pipeline.data.conversations import BadRecord, normalize_conversation
from pipeline.data.dedup import ExactDuplicateFilter, NearDuplicateFilter
from pipeline.data.jsonl import conversation_id, write_jsonl
from pipeline.data.standard_sets import as_conversation
from pipeline.engines.target import load_tokenizer, resolve_model_dir
from pipeline.ids import InvalidIdError, validate_id
from pipeline.manifest import manifest_exists, publish, read_manifest
from pipeline.progress import Progress
from pipeline.stages import StageInputs, StageOutput
from pipeline.storage import ObjectInfo, ObjectStore, StorageConfig

log = logging.getLogger(__name__)
SPLITS = ("train", "eval")
JUDGE_BATCH = 256


class PromptSourceError(RuntimeError):
    pass


def _hash_order(record: dict[str, Any]) -> str:
    return hashlib.sha256(repr(record.get("source", record)).encode()).hexdigest()


SOURCE_SUFFIXES = {
    "jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),  # gzip-compressed JSON lines (HumanEval ships so)
    "json": (".json", ".jsonl"),
    "parquet": (".parquet",),
    "arrow": (".arrow",),
}
DATASETS_BUILDER = {"json": "json", "parquet": "parquet", "arrow": "arrow"}
# Objects of an s3:// source downloaded at once; sources can hold thousands of small files.
S3_DOWNLOAD_CONCURRENCY = 16


@dataclass(frozen=True)
class SourceFile:
    path: Path  # the local file that is read
    name: str  # what errors and the manifest call it: the s3:// URI of a downloaded object, else the path


class SourceRecord(NamedTuple):
    """A record of a prompt source and where it is: `file:line` in JSON lines, `source[index]` otherwise."""

    where: str
    record: Any  # the parsed record, or a BadRecord for a line that is not JSON


class _AsListed:
    """A transfer subscriber handing over the listed size and ETag, sparing a HEAD request per object.

    The ETag also keeps a ranged download of a large object from mixing versions if it is rewritten meanwhile.
    """

    def __init__(self, listed: dict[str, Any]):
        self.listed = listed

    def on_queued(self, future, **kwargs) -> None:
        future.meta.provide_transfer_size(self.listed["Size"])
        future.meta.provide_object_etag(self.listed["ETag"])


def _s3_client(storage: StorageConfig):
    from pipeline.storage import s3_client  # botocore's standard retries, as the store has them

    return s3_client(
        storage.endpoint_url,
        storage.region,
        storage.max_attempts,
        max_pool_connections=S3_DOWNLOAD_CONCURRENCY,
    )


def _list_source_objects(client, bucket: str, key: str, kind: str) -> list[dict[str, Any]]:
    """The object `key`, or every object of the kind under the prefix `key`, over all listing pages."""
    under_prefix = key.endswith("/") or not key
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
    return sorted(
        (
            obj
            for page in pages
            for obj in page.get("Contents", [])
            if obj["Key"] == key or under_prefix and obj["Key"].endswith(SOURCE_SUFFIXES[kind])
        ),
        key=lambda obj: obj["Key"],
    )


def _cache_path(storage: StorageConfig, uri: str, etag: str) -> Path:
    """Named by URI and ETag, so a rerun downloads nothing new and a rewritten object is fetched again."""
    name = hashlib.sha256(f"{uri}@{etag}".encode()).hexdigest()[:24]
    return Path(storage.local_cache) / "sources" / (name + Path(uri).suffix)


def _download_missing(
    client, bucket: str, objects: list[dict[str, Any]], files: list[SourceFile], max_attempts: int
) -> None:
    """Download the listed objects not cached yet, several at a time.

    Each lands under its cache name only once complete, through a partial name of its own, because
    workers on one machine share the cache and may fetch the same source at the same time.
    """
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    transfer = TransferConfig(max_concurrency=S3_DOWNLOAD_CONCURRENCY, num_download_attempts=max_attempts)
    pending = []
    try:
        with create_transfer_manager(client, transfer) as manager:
            for obj, file in zip(objects, files, strict=True):
                if file.path.exists():
                    continue
                file.path.parent.mkdir(parents=True, exist_ok=True)
                partial = file.path.with_name(f"{file.path.name}.{uuid.uuid4().hex[:8]}.part")
                download = manager.download(bucket, obj["Key"], str(partial), subscribers=[_AsListed(obj)])
                pending.append((download, partial, file.path))
            for download, partial, path in pending:
                download.result()
                partial.replace(path)
    finally:
        for _, partial, _ in pending:
            partial.unlink(missing_ok=True)


def _s3_source_files(uri: str, kind: str, storage: StorageConfig) -> list[SourceFile]:
    """Download an s3:// object, or every object of the source's kind under an s3:// prefix, to the cache."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, key = uri[len("s3://") :].partition("/")
    client = _s3_client(storage)
    try:
        objects = _list_source_objects(client, bucket, key, kind)
        if not objects:
            raise PromptSourceError(f"prompt source {uri}: no {kind} objects there")
        files = [
            SourceFile(
                _cache_path(storage, f"s3://{bucket}/{obj['Key']}", obj["ETag"]),
                f"s3://{bucket}/{obj['Key']}",
            )
            for obj in objects
        ]
        _download_missing(client, bucket, objects, files, storage.max_attempts)
        return files
    except (BotoCoreError, ClientError) as err:  # botocore's messages name the endpoint
        raise PromptSourceError(without_credentials(f"cannot read prompt source {uri}: {err}")) from err


def _local_source_files(path: str, kind: str) -> list[SourceFile]:
    local = Path(path[len("file://") :] if path.startswith("file://") else path)
    if local.is_dir():
        files = sorted(p for p in local.rglob("*") if p.name.endswith(SOURCE_SUFFIXES[kind]))
    elif any(ch in local.name for ch in "*?["):
        files = sorted(local.parent.glob(local.name))
    else:
        files = [local] if local.exists() else []
    if not files:
        raise PromptSourceError(f"prompt source {path!r} does not exist or holds no {kind} files")
    return [SourceFile(file, str(file)) for file in files]


def _source_files(source: PromptSource, storage: StorageConfig) -> list[SourceFile]:
    path = source.path or ""
    if path.startswith("s3://"):
        return _s3_source_files(path, source.kind, storage)
    if "://" in path and not path.startswith("file://"):
        raise PromptSourceError(f"prompt source {path!r}: use a local path, file:// or s3://")
    return _local_source_files(path, source.kind)


def _open_lines(path: Path) -> IO[bytes]:
    return cast(IO[bytes], gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb"))


def _iter_json_lines(file: SourceFile) -> Iterator[SourceRecord]:
    """One record per non-blank line; a line that is not JSON becomes a BadRecord, so the rest still
    counts."""
    try:
        with _open_lines(file.path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{file.name}:{number}"
                try:
                    yield SourceRecord(where, orjson.loads(line))
                except orjson.JSONDecodeError as err:
                    yield SourceRecord(where, BadRecord("malformed_json", f"{err.msg} at column {err.colno}"))
    except (OSError, EOFError, zlib.error) as err:  # EOFError, zlib.error: a gzip file cut short or corrupt
        raise PromptSourceError(f"cannot read prompt file {file.name}: {err}") from err


def _iter_json_line_files(files: list[SourceFile], source: PromptSource) -> Iterator[SourceRecord]:
    """The records of every file; an empty one among others is skipped (Spark writes a part per partition,
    empty ones too), a source with no record at all fails naming its empty files."""
    empty = []
    for file in files:
        records = 0
        for item in _iter_json_lines(file):
            records += 1
            yield item
        if records == 0:
            empty.append(file)
            if len(files) > 1:
                log.warning(_skipping_empty(file, source))
    if len(empty) == len(files):
        raise PromptSourceError(_empty_source(source, empty))


def _skipping_empty(file: SourceFile, source: PromptSource) -> str:
    return (
        f"prompt file {file.name} is empty: skipping it (the other files of source {source.path!r} are read)"
    )


def _empty_source(source: PromptSource, empty: list[SourceFile]) -> str:
    # files that were meant to hold prompts and hold none (a failed export, a truncated upload)
    if len(empty) == 1:
        return (
            f"prompt file {empty[0].name} is empty: it holds no records "
            "(remove it from the source, or fill it)"
        )
    shown = ", ".join(file.name for file in empty[:5]) + (", ..." if len(empty) > 5 else "")
    return (
        f"prompt source {source.path!r} is empty: none of its {len(empty)} files holds a record ({shown}); "
        "point it at files that hold prompts"
    )


def _iter_with_datasets(files: list[SourceFile], source: PromptSource) -> Iterator[SourceRecord]:
    """JSON documents and tables, streamed by `datasets`; an unreadable file fails the source, named. Empty
    files are treated as _iter_json_line_files treats them (`datasets` fails on a 0-byte one)."""
    import datasets

    empty = [file for file in files if file.path.stat().st_size == 0]
    if len(empty) == len(files):
        raise PromptSourceError(_empty_source(source, empty))
    for file in empty:
        log.warning(_skipping_empty(file, source))
    files = [file for file in files if file not in empty]
    try:
        stream = datasets.load_dataset(
            DATASETS_BUILDER[source.kind],
            data_files=[str(f.path) for f in files],
            split="train",
            streaming=True,
        )
        for index, record in enumerate(stream):
            yield SourceRecord(f"{source.path}[{index}]", record)
    except Exception as err:  # datasets raises many types for unreadable files
        message = str(err)
        for file in files:  # errors name the cached copy of an S3 object; name the object instead
            message = message.replace(str(file.path), file.name)
        raise PromptSourceError(
            f"cannot read prompt source {source.path!r} as {source.kind}: {message}"
        ) from err


def iter_source(source: PromptSource, storage: StorageConfig) -> Iterator[SourceRecord]:
    """Records of one source, streamed (a file is never loaded whole, except a JSON array of kind json);
    a standard set's records (source.format) as conversation records."""
    records = _iter_raw(source, storage)
    if source.format == "conversation":
        yield from records
        return
    for item in records:
        if isinstance(item.record, BadRecord):
            yield item
            continue
        try:
            yield SourceRecord(item.where, as_conversation(source.format, item.record))
        except BadRecord as bad:
            yield SourceRecord(item.where, bad)


def _iter_raw(source: PromptSource, storage: StorageConfig) -> Iterator[SourceRecord]:
    if source.kind == "demo":
        from pipeline.engines.tiny_target import demo_conversations

        for index, record in enumerate(sorted(demo_conversations(), key=_hash_order)):
            yield SourceRecord(f"demo[{index}]", record)
        return
    files = _source_files(source, storage)
    if source.kind == "jsonl":
        yield from _iter_json_line_files(files, source)
    else:
        yield from _iter_with_datasets(files, source)


def mix_sources(sources: list[PromptSource], storage: StorageConfig) -> Iterator[tuple[int, SourceRecord]]:
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


def source_records(sources: list[PromptSource], storage: StorageConfig) -> Iterator[tuple[int, SourceRecord]]:
    """(source index, record): the eval sources whole, one after another, then the others interleaved
    by weight (mix_sources)."""
    for index, source in enumerate(sources):
        if source.split == "eval":
            for item in iter_source(source, storage):
                yield index, item
    mixed = [index for index, source in enumerate(sources) if source.split != "eval"]
    for position, item in mix_sources([sources[index] for index in mixed], storage):
        yield mixed[position], item


def all_capped(sources: list[PromptSource], kept_per_source: Counter) -> bool:
    """Whether every source that prompts.num_samples shares out (split auto) has kept its max_samples
    (False when there is none: eval sources alone are read to their end)."""
    mixed = [(index, source) for index, source in enumerate(sources) if source.split != "eval"]
    return bool(mixed) and all(
        source.max_samples is not None and kept_per_source[index] >= source.max_samples
        for index, source in mixed
    )


def split_of(sample_id: str, eval_fraction: float) -> str:
    return "eval" if int(sample_id[:8], 16) / 0x100000000 < eval_fraction else "train"


class DomainSplitter:
    """The split of each kept conversation, keeping a held-out set per domain: a source with split 'eval'
    is held out whole; otherwise the sample id's hash decides (split_of), except that a domain's first
    conversation is held out while none of that domain is, so that no domain of a run with eval_fraction
    > 0 goes unevaluated."""

    def __init__(self, eval_fraction: float):
        self.eval_fraction = eval_fraction
        self.held_out: Counter = Counter()

    def split(self, sample_id: str, domain: str, source: PromptSource) -> str:
        if source.split == "eval":
            split = "eval"
        elif self.eval_fraction > 0 and not self.held_out[domain]:
            split = "eval"
        else:
            split = split_of(sample_id, self.eval_fraction)
        self.held_out[domain] += split == "eval"
        return split


def record_domain(record: Any, source: PromptSource) -> str:
    """A record's own `domain`, else its source's; a record's that is not an id is a bad record."""
    own = record.get("domain") if isinstance(record, dict) else None
    if own is None:
        return source.domain
    try:
        return validate_id(own, "domain")
    except InvalidIdError as err:
        raise BadRecord("bad_domain", str(err)) from err


def domain_counts(shards: list[dict]) -> dict[str, dict[str, int]]:
    """Conversations per domain and split, from the shards' entries."""
    counts: dict[str, dict[str, int]] = {}
    for shard in shards:
        per_split = counts.setdefault(shard["domain"], dict.fromkeys(SPLITS, 0))
        per_split[shard["split"]] += shard["samples"]
    return dict(sorted(counts.items()))


class ShardWriter:
    """Buffers records per split and domain and uploads a JSONL shard whenever one fills up: every shard
    holds one split of one domain, so evaluation can report each domain."""

    def __init__(self, store: ObjectStore, prefix: str, shard_size: int, workdir: Path):
        self.store, self.prefix, self.shard_size, self.workdir = store, prefix, shard_size, workdir
        self.buffers: dict[tuple[str, str], list[dict]] = {}
        self.objects: list[ObjectInfo] = []
        self.shards: list[dict] = []

    def add(self, record: dict) -> None:
        key = (record["split"], record["domain"])
        buffer = self.buffers.setdefault(key, [])
        buffer.append(record)
        if len(buffer) >= self.shard_size:
            self.flush(key)

    def flush(self, key: tuple[str, str]) -> None:
        buffer = self.buffers.get(key)
        if not buffer:
            return
        split, domain = key
        index = sum(1 for s in self.shards if s["split"] == split)
        name = f"{split}-{index:05d}.jsonl"
        path = self.workdir / name
        write_jsonl(path, buffer)
        self.objects.append(self.store.put_file(f"{self.prefix}/{name}", path))
        self.shards.append({"name": name, "split": split, "domain": domain, "samples": len(buffer)})
        path.unlink()
        self.buffers[key] = []

    def close(self) -> None:
        for key in sorted(self.buffers, key=lambda k: (SPLITS.index(k[0]), k[1])):
            self.flush(key)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: the longest spelling in the vocabulary. Byte-level
    vocabularies spell a token with one character per byte and piece vocabularies with its text, so no
    token covers more characters of a prompt than this (at least 1)."""
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


class PromptFilter:
    """Decides whether conversations are kept; rejections name their reason.

    Records are judged in batches so the length check tokenizes many prompts per call.
    """

    def __init__(self, settings: PromptsConfig, tokenizer):
        self.settings, self.tokenizer = settings, tokenizer
        self.exact = ExactDuplicateFilter()
        self.near = NearDuplicateFilter() if settings.near_dedup else None
        self.max_prompt_chars = settings.max_prompt_tokens * longest_token_chars(tokenizer)

    def _too_long_to_tokenize(self, messages: list[dict[str, str]], first_user: int) -> BadRecord | None:
        """A prompt with more characters than max_prompt_tokens tokens can spell is too long, known without
        templating and tokenizing it (a 45 MB line took 98 s and 6 GB to tokenize): the first one (the
        messages up to the first user turn) and every later user or system turn, which near-dedup hashes and
        generate tokenizes with the history. Assistant turns are neither: generate replaces them."""
        chars = sum(len(message["content"]) for message in messages[: first_user + 1])
        if chars > self.max_prompt_chars:
            return self._too_long(chars, "")
        for turn, message in enumerate(messages[first_user + 1 :], start=first_user + 1):
            if message["role"] != "assistant" and len(message["content"]) > self.max_prompt_chars:
                return self._too_long(len(message["content"]), f" in message {turn} ({message['role']})")
        return None

    def _too_long(self, chars: int, where: str) -> BadRecord:
        return BadRecord(
            "too_long",
            f"{chars} characters{where}, more than prompts.max_prompt_tokens="
            f"{self.settings.max_prompt_tokens} tokens can hold ({self.max_prompt_chars})",
        )

    def judge(self, records: list[Any]) -> list[tuple[str, list[dict[str, str]]] | BadRecord]:
        """Per record: (sample id, messages) when kept, else the BadRecord saying why not."""
        verdicts: list[Any] = []
        candidates = []
        for record in records:
            if isinstance(record, BadRecord):  # refused by the reader already (a line that is not JSON)
                verdicts.append(record)
                continue
            try:
                messages = normalize_conversation(record)
            except BadRecord as bad:
                verdicts.append(bad)
                continue
            first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
            too_long = self._too_long_to_tokenize(messages, first_user)
            if too_long is not None:  # before either dedup: neither hashes a huge text
                verdicts.append(too_long)
                continue
            sample_id = conversation_id(messages)
            if self.exact.check_and_add(sample_id):
                verdicts.append(BadRecord("duplicate"))
                continue
            verdicts.append((sample_id, messages))
            candidates.append((len(verdicts) - 1, messages[: first_user + 1]))
        texts = [
            self.tokenizer.apply_chat_template(prefix, add_generation_prompt=True, tokenize=False)
            for _, prefix in candidates
        ]
        lengths = (
            [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
            if texts
            else []
        )
        for (index, _), length in zip(candidates, lengths, strict=True):
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


class RejectedExamples:
    """Where the first few rejected records of each reason are, and why the first of each was rejected."""

    def __init__(self, per_reason: int = 10):
        self.per_reason = per_reason
        self.places: dict[str, list[str]] = {}
        self.first_detail: dict[str, str] = {}

    def add(self, bad: BadRecord, where: str) -> None:
        places = self.places.setdefault(bad.reason, [])
        if not places:
            self.first_detail[bad.reason] = str(bad)
        if len(places) < self.per_reason:
            places.append(where)


def _check_malformed_share(counts: Counter, examples: RejectedExamples, max_bad_fraction: float) -> None:
    """Fail when more of the records read than prompts.max_bad_fraction could not be parsed at all."""
    malformed, read = counts["rejected.malformed_json"], counts["read"]
    if malformed <= max_bad_fraction * read:
        return
    first = examples.places["malformed_json"]
    raise PromptSourceError(
        f"{malformed} of {read} prompt records read are not valid JSON ({malformed / read:.1%}, more than "
        f"prompts.max_bad_fraction={max_bad_fraction}): {', '.join(first[:3])}"
        f"{', ...' if malformed > 3 else ''} (the first: {examples.first_detail['malformed_json']}); "
        "fix or remove those lines, or raise prompts.max_bad_fraction to skip them "
        "(a file holding one JSON array is kind json)"
    )


class Inputs(StageInputs):
    snapshot: str


class Output(StageOutput):
    shards: list[str]


def _output(store: ObjectStore, prefix: str, manifest: dict[str, Any]) -> Output:
    return Output(
        uri=store.uri(prefix), kind=manifest["kind"], shards=[shard["name"] for shard in manifest["shards"]]
    )


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    """The snapshot `inputs.snapshot` of the configured prompt sources (reused when published)."""
    snapshot = inputs.snapshot
    prefix = layout.prompts_prefix(snapshot)
    record = artifact_record(store, prefix, "prompts snapshot")
    require_same(store, record, config)  # a rerun of its run id reuses the snapshot only under its config
    if manifest_exists(store, prefix):
        log.info("prompts snapshot %s already published; reusing it", store.uri(prefix))
        return _output(store, prefix, read_manifest(store, prefix, kind="prompts"))
    settings = config.prompts
    judge = PromptFilter(settings, load_tokenizer(resolve_model_dir(config), config.target.trust_remote_code))
    counts: Counter = Counter()
    kept_per_source: Counter = Counter()
    kept_mixed = 0  # from the sources that prompts.num_samples shares out (split auto)
    rejected_examples = RejectedExamples()
    with tempfile.TemporaryDirectory(prefix="prompts-") as tmp:
        writer = ShardWriter(store, prefix, settings.shard_size, Path(tmp))
        splitter = DomainSplitter(settings.eval_fraction)
        progress = Progress(total=settings.num_samples, desc="prompts", unit="conv")
        for batch in _batched(source_records(settings.sources, config.storage), JUDGE_BATCH):
            verdicts = judge.judge([item.record for _, item in batch])
            for (source_index, item), verdict in zip(batch, verdicts, strict=True):
                source = settings.sources[source_index]
                if source.split != "eval" and kept_mixed >= settings.num_samples:
                    break
                if source.max_samples is not None and kept_per_source[source_index] >= source.max_samples:
                    if source.split != "eval" and all_capped(settings.sources, kept_per_source):
                        break  # every source num_samples shares out has given what it may
                    continue
                counts["read"] += 1
                if isinstance(verdict, BadRecord):
                    counts[f"rejected.{verdict.reason}"] += 1
                    rejected_examples.add(verdict, item.where)
                    continue
                sample_id, messages = verdict
                try:
                    domain = record_domain(item.record, source)
                except BadRecord as bad:
                    counts[f"rejected.{bad.reason}"] += 1
                    rejected_examples.add(bad, item.where)
                    continue
                writer.add(
                    {
                        "id": sample_id,
                        "split": splitter.split(sample_id, domain, source),
                        "domain": domain,
                        "source": item.record.get("source") or source.path or source.kind,
                        "messages": messages,
                    }
                )
                counts["kept"] += 1
                kept_per_source[source_index] += 1
                if source.split != "eval":
                    kept_mixed += 1
                    progress.update(1)
            if kept_mixed >= settings.num_samples or all_capped(settings.sources, kept_per_source):
                break
        progress.close()
        _check_malformed_share(counts, rejected_examples, settings.max_bad_fraction)
        writer.close()
    if counts["kept"] == 0:
        raise PromptSourceError(f"no usable conversations in the prompt sources; counts: {dict(counts)}")
    claim(store, record, config)  # nothing of an earlier attempt is reused: recorded as it is published
    manifest = publish(
        store,
        prefix,
        "prompts",
        writer.objects,
        {
            "snapshot": snapshot,
            "config": settings.model_dump(mode="json"),
            "counts": dict(counts),
            "rejected_examples": rejected_examples.places,
            "kept_per_source": {
                settings.sources[i].path or settings.sources[i].kind: n for i, n in kept_per_source.items()
            },
            "shards": writer.shards,
            "domains": domain_counts(writer.shards),
        },
    )
    rejected = {k: v for k, v in counts.items() if k.startswith("rejected.")}
    log.info("prompts: kept %d of %d read; rejected %s", counts["kept"], counts["read"], rejected or "none")
    return _output(store, prefix, manifest)
