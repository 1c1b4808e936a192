"""Capture shards: one safetensors file per shard, samples packed along the token axis.

Tensors (T = total tokens of the shard, N = samples):
  input_ids   int32 [T]
  loss_mask   uint8 [T]      1 on assistant-generated tokens
  aux         bf16  [T, 3H]  aux hidden states, ascending layer order
  last_hidden bf16  [T, H]   post-final-norm last hidden state (teacher)
  offsets     int64 [N + 1]  sample i owns rows offsets[i]:offsets[i+1]
Header metadata: format, encoding, sample_ids (JSON list).

safetensors is a JSON header plus raw row-major buffers, so any sample's rows are one contiguous
byte range per tensor: a reader needs the header and ranged reads, nothing else (no pickle).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

FORMAT = "drafter-capture-shard/1"
TOKEN_TENSORS = ("input_ids", "loss_mask", "aux", "last_hidden")
_DTYPES = {"I32": (np.int32, torch.int32), "U8": (np.uint8, torch.uint8), "I64": (np.int64, torch.int64),
           "BF16": (np.uint16, torch.bfloat16), "F32": (np.float32, torch.float32)}


class ShardFormatError(ValueError):
    pass


@dataclass
class CaptureSample:
    sample_id: str
    input_ids: torch.Tensor  # [L] int
    loss_mask: torch.Tensor  # [L] 0/1
    aux: torch.Tensor  # [L, 3H]
    last_hidden: torch.Tensor  # [L, H]

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())


def write_shard(samples: list[CaptureSample], path: str | Path, encoding: str = "bf16") -> dict:
    """Write samples to one shard file; returns counts for the manifest."""
    from safetensors.torch import save_file

    if encoding != "bf16":
        raise ShardFormatError(f"unsupported aux encoding {encoding!r}")
    if not samples:
        raise ShardFormatError("refusing to write an empty shard")
    lengths = [s.length for s in samples]
    offsets = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int64)
    tensors = {
        "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in samples]),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples]),
        "aux": torch.cat([s.aux.to(torch.bfloat16) for s in samples]),
        "last_hidden": torch.cat([s.last_hidden.to(torch.bfloat16) for s in samples]),
        "offsets": offsets,
    }
    metadata = {"format": FORMAT, "encoding": encoding, "sample_ids": json.dumps([s.sample_id for s in samples])}
    save_file(tensors, str(path), metadata=metadata)
    return {"samples": len(samples), "tokens": int(offsets[-1]),
            "assistant_tokens": int(tensors["loss_mask"].sum())}


class ShardReader:
    """Random access to one shard through a byte-range function (local file or object store)."""

    def __init__(self, read_range: Callable[[int, int], bytes]):
        self._read = read_range
        (header_len,) = struct.unpack("<Q", self._read(0, 8))
        if header_len > 100 * 1024 * 1024:
            raise ShardFormatError("shard header is implausibly large")
        header = json.loads(self._read(8, 8 + header_len))
        self.metadata = header.pop("__metadata__", {})
        if self.metadata.get("format") != FORMAT:
            raise ShardFormatError(f"not a capture shard (format {self.metadata.get('format')!r})")
        self.entries = header
        self.data_start = 8 + header_len
        self.sample_ids: list[str] = json.loads(self.metadata["sample_ids"])
        self.offsets = self._tensor("offsets", 0, None)
        if self.offsets.numel() != len(self.sample_ids) + 1:
            raise ShardFormatError("offsets and sample ids disagree")

    @classmethod
    def from_file(cls, path: str | Path) -> "ShardReader":
        handle = open(path, "rb")

        def read(start: int, end: int) -> bytes:
            handle.seek(start)
            return handle.read(end - start)

        reader = cls(read)
        reader._handle = handle
        return reader

    def close(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _tensor(self, name: str, row_start: int, row_end: int | None) -> torch.Tensor:
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
        array = np.frombuffer(self._read(start, stop), dtype=np_dtype).reshape([row_end - row_start] + shape[1:])
        tensor = torch.from_numpy(array.copy())
        return tensor.view(torch_dtype) if torch_dtype == torch.bfloat16 else tensor

    def sample(self, index: int) -> CaptureSample:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return CaptureSample(
            sample_id=self.sample_ids[index],
            input_ids=self._tensor("input_ids", start, end).to(torch.long),
            loss_mask=self._tensor("loss_mask", start, end),
            aux=self._tensor("aux", start, end),
            last_hidden=self._tensor("last_hidden", start, end),
        )

    def tokens_and_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All input ids and loss masks of the shard (cheap: no hidden states are read)."""
        return self._tensor("input_ids", 0, None).to(torch.long), self._tensor("loss_mask", 0, None)


def store_range_reader(store, key: str) -> Callable[[int, int], bytes]:
    return lambda start, end: store.get_bytes(key, start, end)
