"""Capture shards: one safetensors file per shard, samples packed along the token axis.

Tensors (T = total tokens of the shard, N = samples, H = hidden size, K = teacher top-k):
  input_ids        int32 [T]
  loss_mask        uint8 [T]        1 on assistant-generated tokens
  offsets          int64 [N + 1]    sample i owns rows offsets[i]:offsets[i+1]
  aux              [T, 3H]          aux hidden states, ascending layer order; bf16, or
                                    fp8 e4m3 with aux_scale float32 [T, 3 * ceil(H / B)]: one scale per
                                    token per block of B contiguous channels of a layer (the last block
                                    of a layer is shorter when B does not divide H)
  last_hidden      [T, H]           teacher: post-final-norm last hidden state; bf16, or fp8 with
                                    last_hidden_scale float32 [T, ceil(H / B)]            (optional)
  topk_ids         int32 [T, K]     teacher: the target's top-K next-token ids at each position,
  topk_logprobs    fp16  [T, K]     and their log-probabilities (full-vocabulary log-softmax)  (optional)
Header metadata: format, encoding, fp8_block (B; fp8 only), teacher (comma list), sample_ids (JSON list).

Block scales (1x128 by default, as DeepSeek-V3 quantizes activations) keep a massive-activation channel
from setting the scale of every other channel of its layer. Shards of the previous format
(drafter-capture-shard/2: one fp8 scale per token and layer) are still read: their block is the layer.

safetensors is a JSON header plus raw row-major buffers, so any sample's rows are one contiguous
byte range per tensor: a reader needs the header and ranged reads, nothing else (no pickle).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

FORMAT = "drafter-capture-shard/3"
# fp8 with one scale per token and layer: read as one block per layer
PER_LAYER_SCALE_FORMAT = "drafter-capture-shard/2"
DEFAULT_FP8_BLOCK = 128
ENCODINGS = ("bf16", "fp8")
TEACHERS = ("last_hidden", "topk")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_DTYPES = {
    "I32": (np.int32, torch.int32),
    "U8": (np.uint8, torch.uint8),
    "I64": (np.int64, torch.int64),
    "BF16": (np.uint16, torch.bfloat16),
    "F16": (np.float16, torch.float16),
    "F32": (np.float32, torch.float32),
    "F8_E4M3": (np.uint8, torch.float8_e4m3fn),
}


class ShardFormatError(ValueError):
    pass


@dataclass
class CaptureSample:
    sample_id: str
    input_ids: torch.Tensor  # [L] int
    loss_mask: torch.Tensor  # [L] 0/1
    aux: torch.Tensor  # [L, 3H] float
    last_hidden: torch.Tensor | None = None  # [L, H] float
    topk_ids: torch.Tensor | None = None  # [L, K] int
    topk_logprobs: torch.Tensor | None = None  # [L, K] float

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())

    def truncated(self, length: int) -> CaptureSample:
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:length]

        return CaptureSample(
            self.sample_id,
            self.input_ids[:length],
            self.loss_mask[:length],
            self.aux[:length],
            cut(self.last_hidden),
            cut(self.topk_ids),
            cut(self.topk_logprobs),
        )


def _blocked(x: torch.Tensor, groups: int, block: int) -> torch.Tensor:
    """x [T, G*D] -> [T, G, ceil(D/B), B], each layer's channels zero-padded to whole blocks."""
    rows = x.shape[0]
    grouped = x.float().reshape(rows, groups, -1)
    width = grouped.shape[-1]
    padded = torch.nn.functional.pad(grouped, (0, -width % block))
    return padded.reshape(rows, groups, -1, block)


def quantize_fp8(
    x: torch.Tensor, groups: int, block: int = DEFAULT_FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per row per block of `block` channels of each group (layer).

    x [T, G*D] -> (fp8 [T, G*D], scale float32 [T, G*ceil(D/block)]); a block of D or more is one
    scale per row and group."""
    if block < 1:
        raise ShardFormatError(f"fp8 block size must be >= 1, got {block}")
    rows, width = x.shape[0], x.shape[1] // groups
    blocks = _blocked(x, groups, block)
    scale = blocks.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    unpadded = quantized.reshape(rows, groups, -1)[..., :width]
    return unpadded.reshape(rows, -1), scale.reshape(rows, -1)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, groups: int, block: int) -> torch.Tensor:
    """The inverse of quantize_fp8 with the same groups and block."""
    rows, width = q.shape[0], q.shape[1] // groups
    blocks = _blocked(q.float(), groups, block)
    if scale.shape != (rows, groups * blocks.shape[2]):
        raise ShardFormatError(
            f"fp8 scales of shape {tuple(scale.shape)} do not fit {groups} groups of {width} channels "
            f"in blocks of {block}"
        )
    values = blocks * scale.float().reshape(rows, groups, -1)[..., None]
    return values.reshape(rows, groups, -1)[..., :width].reshape(rows, -1)


def fp8_rel_error(x: torch.Tensor, restored: torch.Tensor, groups: int) -> list[float]:
    """Per group (layer): the RMS over channels of ||x_c - restored_c|| / ||x_c||, norms over tokens.

    Normalized per channel, so that a massive-activation channel (stored almost exactly) cannot hide
    the precision every other channel lost; e4m3 rounding alone gives about 0.02-0.03."""
    rows = x.shape[0]
    original = x.float().reshape(rows, groups, -1)
    error = (restored.float().reshape(rows, groups, -1) - original).norm(dim=0)
    per_channel = error / original.norm(dim=0).clamp(min=1e-30)
    return [float(v) for v in per_channel.pow(2).mean(-1).sqrt()]


@dataclass(frozen=True)
class EncodingReport:
    """How a shard's hidden states were stored, and what fp8 would have cost them."""

    requested: str
    stored: str
    fp8_block: int | None  # the block fp8 was measured (and, when stored, written) with
    # measured fp8 round-trip error (fp8_rel_error) per tensor: "aux" (one per layer), "last_hidden"
    fp8_rel_error: dict[str, list[float]]
    max_rel_error: float | None

    @property
    def fell_back(self) -> bool:
        return self.requested != self.stored

    @property
    def worst(self) -> float:
        return max((e for errors in self.fp8_rel_error.values() for e in errors), default=0.0)

    def as_dict(self) -> dict[str, object]:
        return {
            "requested": self.requested,
            "stored": self.stored,
            "fp8_block": self.fp8_block,
            "fp8_rel_error": {k: [round(e, 5) for e in v] for k, v in self.fp8_rel_error.items()},
            "max_rel_error": self.max_rel_error,
            "fell_back": self.fell_back,
        }


_SAFETENSORS_DTYPES = {
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int64: "I64",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
}


def safetensors_header(tensors: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str]) -> bytes:
    """The length-prefixed header of a safetensors file holding these tensors (name, dtype, shape) in the
    order given, buffers back to back: sorted header keys, padded to 8 bytes."""
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, dtype, shape in tensors:
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file with a byte-for-byte deterministic layout (sorted names, sorted header keys).

    The same samples always give the same bytes, hence the same sha256: shard identities (and the
    data order derived from them) do not change from one capture run to the next.
    """
    ordered = sorted(tensors.items())
    with open(path, "wb") as handle:
        handle.write(safetensors_header([(n, t.dtype, list(t.shape)) for n, t in ordered], metadata))
        for _, tensor in ordered:
            handle.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())


class ShardReader:
    """Random access to one shard through a byte-range function (local file or object store)."""

    def __init__(self, read_range: Callable[[int, int], bytes]):
        self._read = read_range
        self._handle: BinaryIO | None = None  # the open file of a reader made by from_file
        (header_len,) = struct.unpack("<Q", self._read(0, 8))
        if header_len > 100 * 1024 * 1024:
            raise ShardFormatError("shard header is implausibly large")
        header = json.loads(self._read(8, 8 + header_len))
        self.metadata = header.pop("__metadata__", {}) or {}
        if self.metadata.get("format") not in (FORMAT, PER_LAYER_SCALE_FORMAT):
            raise ShardFormatError(
                f"not a capture shard of format {FORMAT} or {PER_LAYER_SCALE_FORMAT} "
                f"(found {self.metadata.get('format')!r})"
            )
        self.entries = header
        self.data_start = 8 + header_len
        self.encoding = self.metadata["encoding"]
        # None: one fp8 scale per token and layer (format /2), i.e. one block as wide as the layer
        self.fp8_block: int | None = int(self.metadata["fp8_block"]) if "fp8_block" in self.metadata else None
        if self.encoding == "fp8" and self.fp8_block is None and self.metadata["format"] == FORMAT:
            raise ShardFormatError(f"fp8 shard of format {FORMAT} without its fp8_block")
        self.teachers = [t for t in self.metadata.get("teacher", "").split(",") if t]
        self.sample_ids: list[str] = json.loads(self.metadata["sample_ids"])
        self.offsets = self._rows("offsets", 0, None)
        if self.offsets.numel() != len(self.sample_ids) + 1:
            raise ShardFormatError("offsets and sample ids disagree")

    @classmethod
    def from_file(cls, path: str | Path) -> ShardReader:
        handle = open(path, "rb")

        def read(start: int, end: int) -> bytes:
            handle.seek(start)
            return handle.read(end - start)

        reader = cls(read)
        reader._handle = handle
        return reader

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _rows(self, name: str, row_start: int, row_end: int | None) -> torch.Tensor:
        entry = self.entries.get(name)
        if entry is None:
            raise ShardFormatError(f"shard has no tensor {name!r}")
        np_dtype, torch_dtype = _DTYPES[entry["dtype"]]
        shape = entry["shape"]
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(np_dtype).itemsize
        begin, end = entry["data_offsets"]
        row_end = shape[0] if row_end is None else row_end
        start = self.data_start + begin + row_start * row_bytes
        stop = self.data_start + begin + row_end * row_bytes
        if stop > self.data_start + end:
            raise ShardFormatError(f"rows {row_start}:{row_end} out of range for {name}")
        array = np.frombuffer(self._read(start, stop), dtype=np_dtype).reshape(
            [row_end - row_start] + shape[1:]
        )
        tensor = torch.from_numpy(array.copy())
        return tensor.view(torch_dtype) if tensor.dtype != torch_dtype else tensor

    def decoded_rows(self, name: str, groups: int, start: int, end: int) -> torch.Tensor:
        """Rows start:end (shard token positions) of a hidden-state tensor ("aux": 3 groups, "last_hidden":
        1) as float32, whatever their encoding; only those rows are read."""
        values = self._rows(name, start, end)
        if self.encoding != "fp8":
            return values.float()
        block = self.fp8_block or values.shape[1] // groups
        return dequantize_fp8(values, self._rows(f"{name}_scale", start, end), groups, block)

    def sample(self, index: int) -> CaptureSample:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        has_topk = "topk" in self.teachers
        return CaptureSample(
            sample_id=self.sample_ids[index],
            input_ids=self._rows("input_ids", start, end).to(torch.long),
            loss_mask=self._rows("loss_mask", start, end),
            aux=self.decoded_rows("aux", 3, start, end),
            last_hidden=self.decoded_rows("last_hidden", 1, start, end)
            if "last_hidden" in self.teachers
            else None,
            topk_ids=self._rows("topk_ids", start, end).to(torch.long) if has_topk else None,
            topk_logprobs=self._rows("topk_logprobs", start, end).float() if has_topk else None,
        )

    def tokens_and_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All input ids and loss masks of the shard (cheap: no hidden states are read)."""
        return self._rows("input_ids", 0, None).to(torch.long), self._rows("loss_mask", 0, None)


def store_range_reader(store, key: str) -> Callable[[int, int], bytes]:
    return lambda start, end: store.get_bytes(key, start, end)
