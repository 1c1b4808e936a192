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
from pathlib import Path
from typing import Any

import torch

from pipeline import layout
from pipeline.config import DEFAULT_DOMAIN, RunConfig, default_aux_layer_ids
from pipeline.data.activation_outliers import channel_amax, merge_channel_amax, outlier_summary
from pipeline.data.capture_contract import CaptureContract, build_contract, require_same_contract
from pipeline.data.capture_shards import CaptureSample, EncodingReport, write_checked_shard
from pipeline.data.conversations import capture_sequence
from pipeline.data.jsonl import decode_jsonl
from pipeline.engines import Capture, CaptureEngine, TeacherRequest, engine_servers
from pipeline.engines.hf import HFEngine
from pipeline.engines.layer_ids import model_family_of, refuse_unservable_capture
from pipeline.engines.target import TargetInfo, describe_target, load_model, load_tokenizer
from pipeline.manifest import listed_shard, read_listed, read_manifest
from pipeline.progress import Progress
from pipeline.stages import ShardJob, StageInputs, StageOutput, already_published, publish_with_left_out
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


def make_engine(config: RunConfig, target: TargetInfo) -> CaptureEngine:
    if config.capture.engine == "hf":
        return HFEngine(target.model_dir, trust_remote_code=config.target.trust_remote_code)
    from pipeline.engines.sglang import SGLangEngine

    assert config.capture.sglang is not None
    return SGLangEngine(config.capture.sglang, hidden_size=target.hidden_size)


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


ExpectedShapes = dict[str, tuple[torch.Tensor | None, tuple[int, int]]]


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
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, (tensor, shape) in _expected_shapes(capture, length, hidden_size, teacher).items():
        if tensor is None:
            return f"missing_{name}"
        if tuple(tensor.shape) != shape:
            return f"wrong_shape_{name}"
        tensors[name] = tensor
    for name in ("aux", "last_hidden", "topk_logprobs"):
        if name in tensors and not torch.isfinite(tensors[name]).all():
            return f"non_finite_{name}"
    for name, groups in (("aux", 3), ("last_hidden", 1)):
        if name in tensors:
            blocks = tensors[name].float().reshape(length, groups, -1)
            if (blocks.abs().amax(-1) == 0).any():
                return f"zero_row_{name}"
            if (blocks.amax(-1) == blocks.amin(-1)).any():
                return f"constant_row_{name}"
    if "topk" in teacher.kinds and (
        (tensors["topk_logprobs"] > 1e-3).any() or (tensors["topk_ids"] < 0).any()
    ):
        return "invalid_topk"
    return None


def capture_records(
    records: list[dict[str, Any]],
    engine: CaptureEngine,
    tokenizer,
    config: RunConfig,
    target: TargetInfo,
    layer_ids: list[int],
    counts: Counter,
    progress: Progress,
    quarantine: list[dict[str, str]],
) -> list[CaptureSample]:
    prepared = []
    for record in records:
        last_ids = (record.get("generation") or {}).get("last_output_ids")
        ids, mask = capture_sequence(tokenizer, record["messages"], last_ids, config.capture.max_length)
        if sum(mask) == 0:
            counts["quarantined.no_assistant_tokens"] += 1
            quarantine.append({"id": record["id"], "reason": "no_assistant_tokens"})
            continue
        prepared.append((record["id"], ids, mask))
    prepared.sort(key=lambda item: len(item[1]))
    samples = []
    teacher = teacher_request(config)
    for start in range(0, len(prepared), config.capture.batch_size):
        batch = prepared[start : start + config.capture.batch_size]
        captures = engine.capture([ids for _, ids, _ in batch], layer_ids, teacher)
        for (sample_id, ids, mask), capture in zip(batch, captures, strict=True):
            problem = sample_problem(capture, len(ids), target.hidden_size, teacher)
            if problem:
                counts[f"quarantined.{problem}"] += 1
                quarantine.append({"id": sample_id, "reason": problem})
                continue
            samples.append(
                CaptureSample(
                    sample_id,
                    torch.tensor(ids),
                    torch.tensor(mask, dtype=torch.uint8),
                    capture.aux,
                    capture.last_hidden,
                    capture.topk_ids,
                    capture.topk_logprobs,
                )
            )
            counts["captured"] += 1
        progress.update(len(batch))
    return samples


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    """Every response shard captured (finished shards reused), the engine checked first."""
    prefix = layout.captures_prefix(config.target.name, inputs.snapshot)
    if published := already_published(store, prefix, "capture"):
        return published
    in_prefix = store.key_for(inputs.responses_uri)
    responses = read_manifest(store, in_prefix, kind="responses")
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir, config.target.trust_remote_code)
    engine = make_engine(config, target)
    contract = contract_for(config, target, engine).model_dump(mode="json")
    unfinished = [s for s in responses["shards"] if finished_marker(store, prefix, s, contract) is None]
    parity = (
        verify_engine(config, engine, target, contract, tokenizer, store, in_prefix, responses)
        if unfinished
        else {"skipped": "every shard was already captured (the engine was checked before that)"}
    )
    counts: Counter = Counter()
    objects: list[ObjectInfo] = []
    shards, quarantine, stored_markers = [], [], []
    progress = Progress(total=sum(s["samples"] for s in responses["shards"]), desc="capture", unit="sample")
    with tempfile.TemporaryDirectory(prefix="capture-") as tmp:
        for shard in responses["shards"]:
            marker = finished_marker(store, prefix, shard, contract)
            if marker is None:
                records = decode_jsonl(read_listed(store, in_prefix, responses, shard["name"]))
                job = ShardJob(store, prefix, shard, records, progress)
                marker = _capture_shard(job, engine, tokenizer, config, target, contract, Path(tmp))
            else:
                progress.update(shard["samples"])
            counts.update(marker["counts"])
            quarantine += marker["quarantine"]
            if marker["shard"] is not None:
                objects.append(
                    ObjectInfo(f"{prefix}/{marker['shard']['name']}", marker["bytes"], marker["sha256"])
                )
                shards.append(marker["shard"])
                stored_markers.append(marker)
    progress.close()
    if not shards:
        raise CaptureFailed(f"capture stored no samples: {dict(counts)}")
    manifest = publish_with_left_out(
        store,
        prefix,
        "capture",
        objects,
        ("quarantine.jsonl", quarantine),
        {
            "snapshot": inputs.snapshot,
            "responses": store.uri(in_prefix),
            "contract": contract,
            "parity": parity,
            "config": config.capture.model_dump(mode="json"),
            "counts": dict(counts),
            "shards": shards,
            "totals": {key: sum(s[key] for s in shards) for key in ("samples", "tokens", "assistant_tokens")},
            **feature_measurements(stored_markers, contract["aux_layer_ids"]),
        },
    )
    log.info("capture: %s", dict(counts))
    return Output(uri=store.uri(prefix), kind=manifest["kind"])


def feature_measurements(markers: list[dict[str, Any]], layer_ids: list[int]) -> dict[str, Any]:
    """The capture manifest's `outliers` (per aux layer, channel amax over its median, over every shard)
    and `encoding` (per shard: what was stored and the fp8 round-trip error measured on it).

    Shards captured before these measurements existed are counted as unmeasured."""
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

        assert isinstance(engine, SGLangEngine)  # make_engine builds one for capture.engine "sglang"
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
    in_prefix, responses, shard = listed_shard(store, responses_uri, "responses", shard_name)
    target = describe_target(config)
    engine = make_engine(config, target)
    contract = contract_for(config, target, engine).model_dump(mode="json")
    prefix = layout.captures_prefix(config.target.name, snapshot)
    marker = finished_marker(store, prefix, shard, contract)
    if marker is None:
        progress = Progress(total=shard["samples"], desc=f"capture {shard_name}", unit="sample")
        with tempfile.TemporaryDirectory(prefix="capture-") as tmp:
            records = decode_jsonl(read_listed(store, in_prefix, responses, shard_name))
            marker = _capture_shard(
                ShardJob(store, prefix, shard, records, progress),
                engine,
                load_tokenizer(target.model_dir, config.target.trust_remote_code),
                config,
                target,
                contract,
                Path(tmp),
            )
        progress.close()
    return {"shard": shard_name, "counts": marker["counts"]}


def finished_marker(
    store: ObjectStore, prefix: str, response_shard: dict[str, Any], contract: dict[str, Any]
) -> dict[str, Any] | None:
    """The record of a response shard captured by an earlier attempt, if its output is complete."""
    key = layout.shard_marker_key(prefix, response_shard["name"])
    if not store.exists(key):
        return None
    marker = json.loads(store.get_bytes(key))
    if marker["shard"] is not None and not store.exists(f"{prefix}/{marker['shard']['name']}"):
        return None
    require_same_contract(marker["contract"], contract, f"resuming capture of {response_shard['name']}")
    return marker


def _capture_shard(
    job: ShardJob,
    engine: CaptureEngine,
    tokenizer,
    config: RunConfig,
    target: TargetInfo,
    contract: dict[str, Any],
    tmp: Path,
) -> dict[str, Any]:
    """Capture one response shard into one capture shard; the marker is written after the data."""
    store, prefix, response_shard, records, progress = (
        job.store,
        job.prefix,
        job.shard,
        job.records,
        job.progress,
    )
    started = time.monotonic()
    counts: Counter = Counter()
    quarantine: list[dict[str, str]] = []
    samples = capture_records(
        records, engine, tokenizer, config, target, contract["aux_layer_ids"], counts, progress, quarantine
    )
    marker: dict[str, Any] = {
        "shard": None,
        "counts": dict(counts),
        "quarantine": quarantine,
        "contract": contract,
    }
    if samples:
        name = response_shard["name"].replace(".jsonl", ".safetensors")
        path = tmp / name
        stats, measurements = write_measured_shard(samples, path, config, contract["aux_layer_ids"])
        marker.update(measurements)
        info = store.put_file(f"{prefix}/{name}", path)
        path.unlink()
        marker.update(
            {
                "bytes": info.bytes,
                "sha256": info.sha256,
                "shard": {
                    "name": name,
                    "split": response_shard["split"],
                    "domain": response_shard.get("domain", DEFAULT_DOMAIN),
                    **stats,
                },
            }
        )
    else:
        log.warning("capture: shard %s produced no valid samples: %s", response_shard["name"], dict(counts))
    marker["timing"] = {
        "seconds": round(time.monotonic() - started, 3),
        "servers": engine_servers(config.capture),
    }
    store.put_bytes(layout.shard_marker_key(prefix, response_shard["name"]), json.dumps(marker).encode())
    return marker


def write_measured_shard(
    samples: list[CaptureSample], path: Path, config: RunConfig, layer_ids: list[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write one capture shard; returns its manifest entry and what was measured on it for the marker:
    the encoding stored (bf16 when fp8's round-trip error exceeds capture.fp8_max_rel_error, with a
    warning), and every aux channel's amax."""
    settings = config.capture
    stats, encoding = write_checked_shard(
        samples, path, settings.encoding, settings.fp8_block, settings.fp8_max_rel_error
    )
    if encoding.fell_back:
        _warn_fell_back(path.name, encoding)
    amax = channel_amax([s.aux for s in samples], groups=3)
    return stats, {
        "encoding": encoding.as_dict(),
        "aux_channel_amax": [[float(f"{v:.4g}") for v in row] for row in amax.tolist()],
        "outliers": outlier_summary(amax, layer_ids, top=3),
    }


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
