"""capture: conversations with the target's responses -> hidden-state shards + the capture contract.

One capture shard per response shard (same split). Every sample is validated before it is stored;
bad ones are counted by reason and left out. Finished shards carry a `.done.json` marker so a rerun
resumes; the manifest (with the contract) is written last. The dataset stage (pipeline.stages.dataset)
then publishes captures as a dataset snapshot for training.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline import layout
from pipeline.config import DEFAULT_DOMAIN, RunConfig, default_aux_layer_ids
from pipeline.config_records import artifact_record, claim, require_same
from pipeline.data.activation_outliers import merge_channel_amax, outlier_summary
from pipeline.data.capture_contract import CaptureContract, build_contract, require_same_contract
from pipeline.data.capture_shards import EncodingReport
from pipeline.data.conversations import capture_sequence
from pipeline.data.jsonl import decode_jsonl
from pipeline.data.shard_writer import PendingSample, ShardWriter
from pipeline.data.spilled_rows import Rows, row_chunks
from pipeline.engines import Capture, CaptureEngine, TeacherRequest, engine_servers
from pipeline.engines.hf import HFEngine
from pipeline.engines.inprocess import launch_rank_job, needs_rank_job
from pipeline.engines.layer_ids import model_family_of, refuse_unservable_capture
from pipeline.engines.target import TargetInfo, describe_target, load_model, load_tokenizer
from pipeline.manifest import read_listed, read_manifest
from pipeline.progress import Progress
from pipeline.stages import StageInputs, StageOutput, already_published
from pipeline.stages.shards import ShardJob, publish_with_left_out, shard_task
from pipeline.storage import ObjectInfo, ObjectStore, open_store

log = logging.getLogger(__name__)


class Inputs(StageInputs):
    responses_uri: str
    snapshot: str


Output = StageOutput


class CaptureFailed(RuntimeError):
    pass


def aux_layer_ids(config: RunConfig, num_layers: int) -> list[int]:
    return config.capture.aux_layer_ids or default_aux_layer_ids(num_layers)


@contextmanager
def opened_engine(config: RunConfig, target: TargetInfo, spill_dir: Path) -> Iterator[CaptureEngine]:
    """The capture engine of this config, closed (its worker processes stopped) when the block ends.
    SGLang's hidden states are spilled to files under spill_dir while they wait to be stored."""
    if config.capture.engine == "hf":
        yield HFEngine(target.model_dir, trust_remote_code=config.target.trust_remote_code)
        return
    if config.capture.engine == "inprocess":
        from pipeline.engines.inprocess import open_runner

        layer_ids = aux_layer_ids(config, target.num_layers)
        inprocess = open_runner(config.capture.inprocess, target, layer_ids, config.target.trust_remote_code)
        try:
            yield inprocess
        finally:
            inprocess.close()
        return
    from pipeline.engines.sglang import SGLangEngine

    assert config.capture.sglang is not None
    engine = SGLangEngine(config.capture.sglang, hidden_size=target.hidden_size, spill_dir=spill_dir)
    try:
        yield engine
    finally:
        engine.close()


@contextmanager
def workspace(config: RunConfig, target: TargetInfo) -> Iterator[tuple[CaptureEngine, Path]]:
    """The capture engine and a local directory for what waits to be stored (spilled states, parts)."""
    with (
        tempfile.TemporaryDirectory(prefix="capture-") as tmp,
        opened_engine(config, target, Path(tmp)) as engine,
    ):
        yield engine, Path(tmp)


def contract_for(config: RunConfig, target: TargetInfo, engine: CaptureEngine | None) -> CaptureContract:
    """The capture contract of this config's target and capture settings; with no engine, the contract
    any engine's capture must match (what training and evaluation expect). Layers SGLang could not capture
    for a drafter on this target's model family are refused here, before any capture work."""
    layer_ids = aux_layer_ids(config, target.num_layers)
    family = model_family_of(target.model_dir)
    refuse_unservable_capture(layer_ids, family, target.num_layers)
    return build_contract(
        layer_ids,
        target.num_layers,
        target.hidden_size,
        target.vocab_size,
        target.identity,
        {"name": engine.name, "version": engine.version} if engine else {"name": "any", "version": "any"},
        config.capture.encoding,
        list(config.capture.teacher),
        config.capture.teacher_topk,
        config.capture.fp8_block,
        config.capture.fp8_max_rel_error,
    )


def teacher_request(config: RunConfig) -> TeacherRequest:
    return TeacherRequest(tuple(config.capture.teacher), config.capture.teacher_topk)


ExpectedShapes = dict[str, tuple[Rows | None, tuple[int, int]]]


def _expected_shapes(
    capture: Capture, length: int, hidden_size: int, teacher: TeacherRequest
) -> ExpectedShapes:
    shapes: ExpectedShapes = {"aux": (capture.aux, (length, 3 * hidden_size))}
    if "last_hidden" in teacher.kinds:
        shapes["last_hidden"] = (capture.last_hidden, (length, hidden_size))
    if "topk" in teacher.kinds:
        shapes["topk_ids"] = (capture.topk_ids, (length, teacher.topk))
        shapes["topk_logprobs"] = (capture.topk_logprobs, (length, teacher.topk))
    return shapes


def sample_problem(capture: Capture, length: int, hidden_size: int, teacher: TeacherRequest) -> str | None:
    """Why a captured sample must not be stored, or None when it is sound.

    Refused: missing or mis-shaped tensors (also a length that disagrees with the token ids), NaN/inf,
    and hidden-state rows that are all zero or constant in any layer block (junk that still "trains").
    Hidden states are read a chunk of rows at a time (they may be spilled to disk)."""
    shapes = _expected_shapes(capture, length, hidden_size, teacher)
    for name, (rows, shape) in shapes.items():
        if rows is None:
            return f"missing_{name}"
        if tuple(rows.shape) != shape:
            return f"wrong_shape_{name}"
    flags = {
        name: _row_flags(shapes[name][0], groups)
        for name, groups in (("aux", 3), ("last_hidden", 1))
        if name in shapes
    }
    topk_ids, topk_logprobs = capture.topk_ids, capture.topk_logprobs
    if topk_ids is not None and topk_logprobs is not None and "topk" in teacher.kinds:
        flags["topk_logprobs"] = set() if torch.isfinite(topk_logprobs).all() else {"non_finite"}
    for flag in ("non_finite", "zero_row", "constant_row"):
        for name, raised in flags.items():
            if flag in raised:
                return f"{flag}_{name}"
    if topk_ids is not None and topk_logprobs is not None and "topk" in teacher.kinds:
        if bool((topk_logprobs > 1e-3).any()) or bool((topk_ids < 0).any()):
            return "invalid_topk"
    return None


def _row_flags(rows: Rows | None, groups: int) -> set[str]:
    """Which of non_finite, zero_row (a layer block all zero) and constant_row hold anywhere in rows."""
    assert rows is not None  # sample_problem checked its presence
    flags: set[str] = set()
    for chunk in row_chunks(rows):
        if not torch.isfinite(chunk).all():
            return {"non_finite"}
        blocks = chunk.float().reshape(chunk.shape[0], groups, -1)
        if (blocks.abs().amax(-1) == 0).any():
            flags.add("zero_row")
        if (blocks.amax(-1) == blocks.amin(-1)).any():
            flags.add("constant_row")
    return flags


def capture_records(
    records: list[dict[str, Any]],
    engine: CaptureEngine,
    tokenizer,
    config: RunConfig,
    target: TargetInfo,
    layer_ids: list[int],
    tally: CaptureTally,
    parts: ShardParts,
) -> None:
    """Capture every record into `parts`, a batch at a time; refused samples are counted in `tally`."""
    prepared = []
    for record in records:
        last_ids = (record.get("generation") or {}).get("last_output_ids")
        ids, mask = capture_sequence(tokenizer, record["messages"], last_ids, config.capture.max_length)
        if sum(mask) == 0:
            tally.refuse(record["id"], "no_assistant_tokens")
            continue
        prepared.append((record["id"], ids, mask))
    prepared.sort(key=lambda item: len(item[1]))
    teacher = teacher_request(config)
    batches = [
        prepared[i : i + config.capture.batch_size]
        for i in range(0, len(prepared), config.capture.batch_size)
    ]
    # a batch is checked and stored in its own thread while the engine captures the next one, so the GPUs (or
    # the servers) do not wait for the encoding; at most one batch waits to be stored
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-store") as storing:
        pending: Future | None = None
        captures: list[Capture] = []
        try:
            for batch in batches:
                captures = engine.capture([ids for _, ids, _ in batch], layer_ids, teacher)
                if pending is not None:
                    pending.result()
                pending = storing.submit(
                    _store_batch, batch, captures, target.hidden_size, teacher, tally, parts
                )
                captures = []  # the storing thread removes their spill files
            if pending is not None:
                pending.result()
        except BaseException:
            for capture in captures:
                capture.discard()
            # the stage's clean-up must not race the storing thread; the storing thread's error is secondary
            if pending is not None:
                wait([pending])
            raise


def _store_batch(
    batch: list[tuple[str, list[int], list[int]]],
    captures: list[Capture],
    hidden_size: int,
    teacher: TeacherRequest,
    tally: CaptureTally,
    parts: ShardParts,
) -> None:
    """Check a captured batch and add its sound samples to `parts`; its spill files are removed after."""
    try:
        for (sample_id, ids, mask), capture in zip(batch, captures, strict=True):
            if not parts.stores:  # a tensor-parallel rank above 0: rank 0 checks and stores the batch
                continue
            if problem := sample_problem(capture, len(ids), hidden_size, teacher):
                tally.refuse(sample_id, problem)
                continue
            parts.add(
                PendingSample(
                    sample_id,
                    torch.tensor(ids),
                    torch.tensor(mask, dtype=torch.uint8),
                    capture.aux,
                    capture.last_hidden,
                    capture.topk_ids,
                    capture.topk_logprobs,
                )
            )
            tally.counts["captured"] += 1
    finally:
        for capture in captures:
            capture.discard()
    tally.progress.update(len(batch))


@dataclass
class CaptureTally:
    """What became of a response shard's records: counts by outcome, and the refused ones with why."""

    progress: Progress
    counts: Counter = field(default_factory=Counter)
    quarantine: list[dict[str, str]] = field(default_factory=list)

    def refuse(self, sample_id: str, reason: str) -> None:
        self.counts[f"quarantined.{reason}"] += 1
        self.quarantine.append({"id": sample_id, "reason": reason})


def part_name(response_shard: str, index: int) -> str:
    """The capture shard holding part `index` of a response shard: the first keeps the shard's own name."""
    stem = response_shard.removesuffix(".jsonl")
    return f"{stem}.safetensors" if index == 0 else f"{stem}-part{index:03d}.safetensors"


class ShardParts:
    """A response shard's capture shards ("parts"), written as samples arrive and uploaded in the
    background while capture goes on.

    A part is closed once its encoded rows reach capture.part_max_mib; it is then written to local disk
    and uploaded by a background thread while the next part fills. At most one upload is in flight, so
    local disk holds about three parts (the one uploading, the one being written out, the one filling with
    its bf16 fall-back spool) and memory a chunk of rows (ShardWriter)."""

    def __init__(
        self, job: ShardJob, config: RunConfig, layer_ids: list[int], tmp: Path, stores: bool = True
    ):
        self.job, self.config, self.layer_ids, self.tmp = job, config, layer_ids, tmp
        self.stores = stores  # False: samples are counted but not kept (a tensor-parallel rank above 0)
        self.max_bytes = int(config.capture.part_max_mib * (1 << 20))
        self.parts: list[dict[str, Any]] = []
        self.writer: ShardWriter | None = None
        self.uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-upload")
        self.upload: Future | None = None

    def add(self, sample: PendingSample) -> None:
        if not self.stores:
            return
        if self.upload is not None and self.upload.done():
            self._wait()  # a failed upload stops the capture now, not at the next part
        if self.writer is None:
            settings = self.config.capture
            self.writer = ShardWriter(
                settings.encoding, settings.fp8_block, settings.fp8_max_rel_error, spool_dir=self.tmp
            )
        self.writer.add(sample)
        if self.writer.spooled_bytes >= self.max_bytes:
            self._close_part()

    def finish(self) -> list[dict[str, Any]]:
        """Close the last part and wait for every upload; the parts' records for the shard's marker."""
        try:
            if self.writer is not None:
                self._close_part()
            self._wait()
        finally:
            self.close()
        return self.parts

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.uploads.shutdown(wait=True, cancel_futures=True)

    def _close_part(self) -> None:
        assert self.writer is not None
        writer, self.writer = self.writer, None
        name = part_name(self.job.shard["name"], len(self.parts))
        path = self.tmp / name
        stats, encoding = writer.finish(path)
        if encoding.fell_back:
            _warn_fell_back(name, encoding)
        amax = writer.aux_channel_amax
        part: dict[str, Any] = {
            "shard": {
                "name": name,
                "split": self.job.shard["split"],
                "domain": self.job.shard.get("domain", DEFAULT_DOMAIN),
                **stats,
            },
            "encoding": encoding.as_dict(),
            "aux_channel_amax": [[float(f"{v:.4g}") for v in row] for row in amax.tolist()],
            "outliers": outlier_summary(amax, self.layer_ids, top=3),
        }
        self.parts.append(part)
        self._wait()
        self.upload = self.uploads.submit(self._upload, path, part)

    def _upload(self, path: Path, part: dict[str, Any]) -> None:
        info = self.job.store.put_file(f"{self.job.prefix}/{part['shard']['name']}", path)
        path.unlink()
        part.update({"bytes": info.bytes, "sha256": info.sha256})
        log.info("capture: uploaded %s (%d bytes)", part["shard"]["name"], info.bytes)

    def _wait(self) -> None:
        if self.upload is not None:
            self.upload.result()
            self.upload = None


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    """Every response shard captured (finished shards reused), the engine checked first."""
    prefix = layout.captures_prefix(config.target.name, inputs.snapshot)
    record = artifact_record(store, prefix, "captures")
    require_same(store, record, config)  # finished shards are reused only under their config
    if published := already_published(store, prefix, "capture"):
        return published
    if needs_rank_job(config.capture):  # every rank runs this function; rank 0 publishes
        launch_rank_job(config.capture.inprocess.tp_size, _rank_args(run_id, inputs), config.dump())
        if published := already_published(store, prefix, "capture"):
            return published
        raise CaptureFailed("the in-process capture job finished without publishing the capture")
    in_prefix = store.key_for(inputs.responses_uri)
    responses = read_manifest(store, in_prefix, kind="responses")
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir, config.target.trust_remote_code)
    counts: Counter = Counter()
    objects: list[ObjectInfo] = []
    shards, quarantine, stored_parts = [], [], []
    progress = Progress(total=sum(s["samples"] for s in responses["shards"]), desc="capture", unit="sample")
    with workspace(config, target) as (engine, tmp):
        contract = contract_for(config, target, engine).model_dump(mode="json")
        unfinished = [s for s in responses["shards"] if finished_marker(store, prefix, s, contract) is None]
        parity = (
            verify_engine(config, engine, target, contract, tokenizer, store, in_prefix, responses)
            if unfinished
            else {"skipped": "every shard was already captured (the engine was checked before that)"}
        )
        for shard in responses["shards"]:
            marker = finished_marker(store, prefix, shard, contract)
            if marker is None:
                records = decode_jsonl(read_listed(store, in_prefix, responses, shard["name"]))
                job = ShardJob(store, prefix, shard, records, progress)
                claim(store, record, config)  # recorded before the first part made with it
                marker = _capture_shard(job, engine, tokenizer, config, target, contract, tmp)
            else:
                progress.update(shard["samples"])
            counts.update(marker["counts"])
            quarantine += marker["quarantine"]
            for part in marker_parts(marker):
                objects.append(ObjectInfo(f"{prefix}/{part['shard']['name']}", part["bytes"], part["sha256"]))
                shards.append(part["shard"])
                stored_parts.append(part)
        stores = _stores_shards(engine)
    progress.close()
    if not stores:  # a tensor-parallel rank other than 0: it captured in step, rank 0 stored and publishes
        return Output(uri=store.uri(prefix), kind="capture")
    if not shards:
        raise CaptureFailed(f"capture stored no samples: {dict(counts)}")
    fields = {
        "snapshot": inputs.snapshot,
        "responses": store.uri(in_prefix),
        "contract": contract,
        "parity": parity,
        "config": config.capture.model_dump(mode="json"),
        "counts": dict(counts),
        "shards": shards,
        "totals": {key: sum(s[key] for s in shards) for key in ("samples", "tokens", "assistant_tokens")},
        **feature_measurements(stored_parts, contract["aux_layer_ids"]),
    }
    claim(store, record, config)
    manifest = publish_with_left_out(
        store, prefix, "capture", objects, ("quarantine.jsonl", quarantine), fields
    )
    log.info("capture: %s", dict(counts))
    return Output(uri=store.uri(prefix), kind=manifest["kind"])


def feature_measurements(parts: list[dict[str, Any]], layer_ids: list[int]) -> dict[str, Any]:
    """The capture manifest's `outliers` (per aux layer, channel amax over its median, over every shard)
    and `encoding` (per shard: what was stored and the fp8 round-trip error measured on it).

    Shards captured before these measurements existed are counted as unmeasured."""
    markers = parts
    measured = [m for m in markers if "aux_channel_amax" in m]
    amaxes = [torch.tensor(m["aux_channel_amax"]) for m in measured]
    per_shard = [
        {
            "name": m["shard"]["name"],
            **m["encoding"],
            "aux_amax_over_median": [layer["amax_over_median"] for layer in m["outliers"]],
        }
        for m in measured
    ]
    return {
        "outliers": {
            "layers": outlier_summary(merge_channel_amax(amaxes), layer_ids) if amaxes else [],
            "shards_measured": len(measured),
            "shards_unmeasured": len(markers) - len(measured),
        },
        "encoding": {
            "shards": per_shard,
            "fell_back_to_bf16": [s["name"] for s in per_shard if s["fell_back"]],
        },
    }


def verify_engine(
    config: RunConfig,
    engine: CaptureEngine,
    target: TargetInfo,
    contract: dict[str, Any],
    tokenizer,
    store: ObjectStore,
    responses_prefix: str,
    responses: dict[str, Any],
) -> dict[str, Any]:
    """Check the engine before anything is captured; raises on any disagreement with the contract.

    SGLang servers' settings are always checked; then, unless parity.samples is 0, the engine's states
    for a few real samples are compared with an independent reference forward.
    """
    teacher = teacher_request(config)
    if config.capture.engine == "sglang":
        from pipeline.engines.sglang import SGLangEngine

        assert isinstance(engine, SGLangEngine)  # opened_engine opens one for capture.engine "sglang"
        engine.verify_capture_servers(
            contract["aux_layer_ids"],
            target.num_layers,
            config.capture.max_length,
            teacher,
            family=model_family_of(target.model_dir),
        )
    settings = config.capture.parity
    if settings.samples == 0:
        return {"skipped": "capture.parity.samples is 0"}
    from pipeline.engines.parity import ParityFailed, check_parity

    first = responses["shards"][0]["name"]
    records = decode_jsonl(read_listed(store, responses_prefix, responses, first))[: settings.samples]
    sequences = [
        capture_sequence(
            tokenizer,
            r["messages"],
            (r.get("generation") or {}).get("last_output_ids"),
            config.capture.max_length,
        )[0]
        for r in records
    ]
    reference = (
        engine.model
        if isinstance(engine, HFEngine)
        else load_model(target.model_dir, trust_remote_code=config.target.trust_remote_code)
    )
    report = check_parity(
        engine, reference, sequences, contract["aux_layer_ids"], teacher, settings.tolerance
    )
    if not report.passed:
        raise ParityFailed(
            "capture engine disagrees with the reference forward:\n  " + "\n  ".join(report.problems)
        )
    log.info(
        "capture parity on %d samples: aux relative errors %s",
        report.samples,
        [f"{e:.2g}" for e in report.aux_rel_error],
    )
    return report.as_dict()


def run_shard(
    config: RunConfig, responses_uri: str, snapshot: str, shard_name: str, store: ObjectStore | None = None
) -> dict[str, Any]:
    """One response shard (a mapped scheduler task); `run` then publishes once every shard is done."""
    store = store or open_store(config.storage)
    task = shard_task(config, store, "captures", snapshot, responses_uri, shard_name)
    if needs_rank_job(config.capture):
        args = ["--responses", responses_uri, "--snapshot", snapshot, "--shard", shard_name]
        launch_rank_job(config.capture.inprocess.tp_size, args, config.dump())
        marker = store_marker(store, task.prefix, task.shard)
        if marker is None:
            raise CaptureFailed(f"the in-process capture job left no record of {shard_name}")
        return {"shard": shard_name, "counts": marker["counts"]}
    target = describe_target(config)
    with workspace(config, target) as (engine, tmp):
        contract = contract_for(config, target, engine).model_dump(mode="json")
        marker = finished_marker(store, task.prefix, task.shard, contract)
        if marker is None:
            progress = Progress(total=task.shard["samples"], desc=f"capture {shard_name}", unit="sample")
            records = task.records(store)
            claim(store, task.record, config)  # recorded before the first part made with it
            marker = _capture_shard(
                ShardJob(store, task.prefix, task.shard, records, progress),
                engine,
                load_tokenizer(target.model_dir, config.target.trust_remote_code),
                config,
                target,
                contract,
                tmp,
            )
            progress.close()
    return {"shard": shard_name, "counts": marker["counts"]}


def _stores_shards(engine: CaptureEngine) -> bool:
    """Whether this process stores what it captures: all but the ranks above 0 of an in-process job."""
    return bool(getattr(engine, "stores_shards", True))


def _rank_args(run_id: str, inputs: Inputs) -> list[str]:
    return ["--run-id", run_id, "--responses", inputs.responses_uri, "--snapshot", inputs.snapshot]


def store_marker(store: ObjectStore, prefix: str, response_shard: dict[str, Any]) -> dict[str, Any] | None:
    """A response shard's marker as stored, unchecked (None when there is none)."""
    key = layout.shard_marker_key(prefix, response_shard["name"])
    return json.loads(store.get_bytes(key)) if store.exists(key) else None


def finished_marker(
    store: ObjectStore, prefix: str, response_shard: dict[str, Any], contract: dict[str, Any]
) -> dict[str, Any] | None:
    """The record of a response shard captured by an earlier attempt, if its output is complete."""
    key = layout.shard_marker_key(prefix, response_shard["name"])
    if not store.exists(key):
        return None
    marker = json.loads(store.get_bytes(key))
    if any(not store.exists(f"{prefix}/{part['shard']['name']}") for part in marker_parts(marker)):
        return None
    require_same_contract(marker["contract"], contract, f"resuming capture of {response_shard['name']}")
    return marker


def marker_parts(marker: dict[str, Any]) -> list[dict[str, Any]]:
    """The capture shards (parts) a response shard's marker lists; a marker written before shards had
    parts holds its one shard's record at its top level."""
    if "parts" in marker:
        return marker["parts"]
    return [] if marker["shard"] is None else [marker]


def _capture_shard(
    job: ShardJob,
    engine: CaptureEngine,
    tokenizer,
    config: RunConfig,
    target: TargetInfo,
    contract: dict[str, Any],
    tmp: Path,
) -> dict[str, Any]:
    """Capture one response shard into one or more capture shards (parts); the marker is written after
    every part is stored."""
    started = time.monotonic()
    tally = CaptureTally(job.progress)
    stores = _stores_shards(engine)
    parts = ShardParts(job, config, contract["aux_layer_ids"], tmp, stores=stores)
    try:
        capture_records(
            job.records, engine, tokenizer, config, target, contract["aux_layer_ids"], tally, parts
        )
        stored = parts.finish()
    finally:
        parts.close()
    if stores and not stored:
        log.warning("capture: shard %s produced no valid samples: %s", job.shard["name"], dict(tally.counts))
    marker: dict[str, Any] = {
        "parts": stored,
        "counts": dict(tally.counts),
        "quarantine": tally.quarantine,
        "contract": contract,
        "timing": {
            "seconds": round(time.monotonic() - started, 3),
            "servers": engine_servers(config.capture),
        },
    }
    if stores:
        key = layout.shard_marker_key(job.prefix, job.shard["name"])
        job.store.put_bytes(key, json.dumps(marker).encode())
    return marker


def _warn_fell_back(shard_name: str, encoding: EncodingReport) -> None:
    errors = ", ".join(f"{name} {[round(e, 4) for e in v]}" for name, v in encoding.fp8_rel_error.items())
    log.warning(
        "capture: shard %s stored bf16, not fp8: its fp8 round-trip error %.4f (per layer: %s) exceeds "
        "capture.fp8_max_rel_error %s (fp8 block %s channels)",
        shard_name,
        encoding.worst,
        errors,
        encoding.max_rel_error,
        encoding.fp8_block,
    )
