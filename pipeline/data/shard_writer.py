"""Writing capture shards a sample at a time, in memory bounded by a chunk of rows.

A capture shard (pipeline.data.capture_shards) is one safetensors file, each tensor one contiguous
buffer. ShardWriter encodes every sample as it arrives, a chunk of rows at a time, and appends the
encoded rows of each tensor to a spool file of its own; `finish` writes the header and copies the spools
after it. So neither a shard nor a sample is ever held whole: a 32K-token sample at Kimi-K2.5's width
(2.8 GB of float32 aux states) can come from a file on local disk (SpilledRows) and leave as fp8 rows.

The bytes are those of writing every sample at once: rows are encoded independently (bf16 casts, fp8
scales per row and block), names sorted, header keys sorted. The fp8 round-trip error that decides a
fall-back to bf16 is summed over chunks per channel, so it is the error of the whole shard; with a bound
set, the bf16 rows are spooled beside the fp8 ones and the shard keeps whichever the bound allows.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from pipeline.data.capture_shards import (
    DEFAULT_FP8_BLOCK,
    ENCODINGS,
    FORMAT,
    TEACHERS,
    CaptureSample,
    EncodingReport,
    ShardFormatError,
    dequantize_fp8,
    quantize_fp8,
    safetensors_header,
)
from pipeline.data.spilled_rows import CHUNK_BYTES, Rows, row_chunks


@dataclass
class PendingSample:
    """A captured sample on its way into a shard: its hidden states may still be spilled to local disk."""

    sample_id: str
    input_ids: torch.Tensor  # [L] int
    loss_mask: torch.Tensor  # [L] 0/1
    aux: Rows  # [L, 3H] float
    last_hidden: Rows | None = None  # [L, H] float
    topk_ids: torch.Tensor | None = None  # [L, K] int
    topk_logprobs: torch.Tensor | None = None  # [L, K] float

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())


class _FP8ErrorSums:
    """fp8_rel_error (capture_shards) accumulated over chunks: per channel, the squared error and the
    squared value summed over tokens."""

    def __init__(self, groups: int):
        self.groups = groups
        self.error: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def add(self, x: torch.Tensor, restored: torch.Tensor) -> None:
        rows = x.shape[0]  # sums over a chunk's rows in float32, over the shard's chunks in float64
        original = x.float().reshape(rows, self.groups, -1)
        error = (restored.float().reshape(rows, self.groups, -1) - original).pow_(2).sum(0).double()
        value = original.pow(2).sum(0).double()
        self.error = error if self.error is None else self.error + error
        self.value = value if self.value is None else self.value + value

    def per_group(self) -> list[float]:
        assert self.error is not None and self.value is not None
        per_channel = self.error.sqrt() / self.value.sqrt().clamp(min=1e-30)
        return [float(v) for v in per_channel.pow(2).mean(-1).sqrt()]


class ShardWriter:
    """One capture shard, written a sample at a time (see the module docstring).

    add() every sample, then finish(path) once; the spools live in a temporary directory under
    spool_dir (default: the system's) and are removed by finish() or close()."""

    def __init__(
        self,
        encoding: str,
        fp8_block: int = DEFAULT_FP8_BLOCK,
        max_rel_error: float | None = None,
        spool_dir: Path | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        if encoding not in ENCODINGS:
            raise ShardFormatError(f"unsupported aux encoding {encoding!r}; use one of {ENCODINGS}")
        self.encoding, self.fp8_block, self.max_rel_error = encoding, fp8_block, max_rel_error
        self.chunk_bytes = chunk_bytes
        self._dir = Path(tempfile.mkdtemp(prefix="shard-spool-", dir=spool_dir))
        self._spools: dict[str, BinaryIO] = {}
        self._row_shapes: dict[str, tuple[list[int], torch.dtype]] = {}
        self._errors: dict[str, _FP8ErrorSums] = {}
        self._amax: torch.Tensor | None = None
        self.sample_ids: list[str] = []
        self.offsets = [0]
        self.assistant_tokens = 0
        self.teachers: list[str] | None = None

    @property
    def tokens(self) -> int:
        return self.offsets[-1]

    @property
    def spooled_bytes(self) -> int:
        """Bytes the shard will hold if its requested encoding is kept (the bf16 fall-back spool of an fp8
        shard is not counted)."""
        dropped = "bf16/" if self.encoding == "fp8" else "fp8/"
        return sum(spool.tell() for name, spool in self._spools.items() if not name.startswith(dropped))

    @property
    def aux_channel_amax(self) -> torch.Tensor:
        """[3, H]: every aux channel's largest |value| over the samples added."""
        if self._amax is None:
            raise ShardFormatError("no samples were added")
        return self._amax

    def add(self, sample: CaptureSample | PendingSample) -> None:
        teachers = [
            t for t, v in (("last_hidden", sample.last_hidden), ("topk", sample.topk_ids)) if v is not None
        ]
        if not teachers:
            raise ShardFormatError("samples carry no teacher signal (last_hidden or top-k log-probs)")
        if self.teachers is None:
            self.teachers = teachers
        elif teachers != self.teachers:
            raise ShardFormatError(
                f"sample {sample.sample_id} carries teachers {teachers}, the shard {self.teachers}"
            )
        if sample.topk_ids is not None and sample.topk_logprobs is None:
            raise ShardFormatError("samples carry top-k ids without their log-probabilities")
        self._append("input_ids", sample.input_ids.to(torch.int32))
        self._append("loss_mask", sample.loss_mask.to(torch.uint8))
        self._add_hidden("aux", sample.aux, groups=3)
        if sample.last_hidden is not None:
            self._add_hidden("last_hidden", sample.last_hidden, groups=1)
        if sample.topk_ids is not None and sample.topk_logprobs is not None:
            self._append("topk_ids", sample.topk_ids.to(torch.int32))
            self._append("topk_logprobs", sample.topk_logprobs.to(torch.float16))
        self.sample_ids.append(sample.sample_id)
        self.offsets.append(self.offsets[-1] + sample.length)
        self.assistant_tokens += int(sample.loss_mask.sum())

    def _add_hidden(self, name: str, rows: Rows, groups: int) -> None:
        for chunk in row_chunks(rows, self.chunk_bytes):
            chunk = chunk.float()
            if name == "aux":
                amax = chunk.abs().amax(0).reshape(groups, -1)
                self._amax = amax if self._amax is None else torch.maximum(self._amax, amax)
            if self.encoding == "fp8":
                quantized, scale = quantize_fp8(chunk, groups, self.fp8_block)
                restored = dequantize_fp8(quantized, scale, groups, self.fp8_block)
                self._errors.setdefault(name, _FP8ErrorSums(groups)).add(chunk, restored)
                self._append(f"fp8/{name}", quantized)
                self._append(f"fp8/{name}_scale", scale)
            if self.encoding == "bf16" or self.max_rel_error is not None:
                self._append(f"bf16/{name}", chunk.to(torch.bfloat16))

    def _append(self, spool: str, rows: torch.Tensor) -> None:
        if spool not in self._spools:
            self._spools[spool] = open(self._dir / spool.replace("/", "."), "wb")
            self._row_shapes[spool] = (list(rows.shape[1:]), rows.dtype)
        elif (list(rows.shape[1:]), rows.dtype) != self._row_shapes[spool]:
            raise ShardFormatError(f"{spool} rows of shape {list(rows.shape[1:])} do not match the shard's")
        self._spools[spool].write(rows.contiguous().view(torch.uint8).numpy().tobytes())

    def report(self) -> EncodingReport:
        errors = {name: sums.per_group() for name, sums in self._errors.items()}
        report = EncodingReport(
            self.encoding,
            self.encoding,
            self.fp8_block if self.encoding == "fp8" else None,
            errors,
            self.max_rel_error,
        )
        if self.encoding == "fp8" and self.max_rel_error is not None and report.worst > self.max_rel_error:
            return EncodingReport(self.encoding, "bf16", self.fp8_block, errors, self.max_rel_error)
        return report

    def finish(self, path: str | Path) -> tuple[dict, EncodingReport]:
        """Write the shard to path; returns its counts for the manifest and the encoding report."""
        if not self.sample_ids:
            self.close()
            raise ShardFormatError("refusing to write an empty shard")
        try:
            report = self.report()
            self._append("offsets", torch.tensor(self.offsets, dtype=torch.int64))
            for spool in self._spools.values():
                spool.flush()
            chosen = self._chosen_spools(report.stored)
            metadata = {
                "format": FORMAT,
                "encoding": report.stored,
                "teacher": ",".join(t for t in TEACHERS if t in (self.teachers or [])),
                "sample_ids": json.dumps(self.sample_ids),
            }
            if report.stored == "fp8":
                metadata["fp8_block"] = str(self.fp8_block)
            self._write(Path(path), chosen, metadata)
        finally:
            self.close()
        stats = {
            "samples": len(self.sample_ids),
            "tokens": self.tokens,
            "assistant_tokens": self.assistant_tokens,
            "teacher": [t for t in TEACHERS if t in (self.teachers or [])],
            "encoding": report.stored,
        }
        return stats, report

    def _chosen_spools(self, stored: str) -> dict[str, str]:
        """tensor name in the shard -> its spool."""
        chosen = {}
        for spool in self._spools:
            kind, _, name = spool.rpartition("/")
            if kind in ("", stored):
                chosen[name] = spool
        return chosen

    def _write(self, path: Path, chosen: dict[str, str], metadata: dict[str, str]) -> None:
        ordered = sorted(chosen.items())
        tensors = []
        for name, spool in ordered:
            row_shape, dtype = self._row_shapes[spool]
            row_bytes = int(np.prod(row_shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
            tensors.append((name, dtype, [self._spools[spool].tell() // row_bytes, *row_shape]))
        with open(path, "wb") as handle:
            handle.write(safetensors_header(tensors, metadata))
            for _, spool in ordered:
                with open(self._spools[spool].name, "rb") as source:
                    shutil.copyfileobj(source, handle, 16 << 20)

    def close(self) -> None:
        for spool in self._spools.values():
            spool.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_shard(
    samples: list[CaptureSample],
    path: str | Path,
    encoding: str = "bf16",
    fp8_block: int = DEFAULT_FP8_BLOCK,
    fp8_max_rel_error: float | None = None,
) -> dict:
    """Write samples to one shard file; returns counts for the manifest (`encoding`: what is stored)."""
    return write_checked_shard(samples, path, encoding, fp8_block, fp8_max_rel_error)[0]


def write_checked_shard(
    samples: list[CaptureSample],
    path: str | Path,
    encoding: str,
    fp8_block: int = DEFAULT_FP8_BLOCK,
    fp8_max_rel_error: float | None = None,
) -> tuple[dict, EncodingReport]:
    """write_shard, with the encoding report: a shard whose fp8 round-trip error exceeds
    fp8_max_rel_error (None: no bound) in any layer is stored bf16 instead."""
    if not samples:
        raise ShardFormatError("refusing to write an empty shard")
    writer = ShardWriter(encoding, fp8_block, fp8_max_rel_error, spool_dir=Path(path).parent)
    with writer:
        for sample in samples:
            writer.add(sample)
        return writer.finish(path)
