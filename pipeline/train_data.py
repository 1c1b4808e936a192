"""Training data from local capture shards: deterministic shuffle by seed, sharding per rank, padding."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.capture_shard import CaptureSample, ShardReader
from pipeline.vocab import count_assistant_tokens


@dataclass(frozen=True)
class SampleRef:
    shard: int
    index: int
    length: int


class CaptureDataset:
    """All samples of a list of shard files, addressable by a flat index."""

    def __init__(self, paths: list[str | Path], max_length: int):
        self.readers = [ShardReader.from_file(p) for p in paths]
        self.max_length = max_length
        self.refs = [
            SampleRef(s, i, min(max_length, int(reader.offsets[i + 1] - reader.offsets[i])))
            for s, reader in enumerate(self.readers) for i in range(len(reader))
        ]

    def __len__(self) -> int:
        return len(self.refs)

    def sample(self, position: int) -> CaptureSample:
        ref = self.refs[position]
        return self.readers[ref.shard].sample(ref.index).truncated(ref.length)

    def teachers(self) -> set[str]:
        """Teacher signals present in every shard."""
        return set.intersection(*(set(reader.teachers) for reader in self.readers))

    def assistant_token_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for reader in self.readers:
            ids, mask = reader.tokens_and_masks()
            count_assistant_tokens(counts, ids, mask)
        return counts

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def rank_batches(order: list[int], rank: int, world: int, micro_batch: int) -> list[list[int]]:
    """This rank's micro-batches; every rank gets the same number (the tail that cannot be split evenly is dropped)."""
    per_rank = len(order) // world
    mine = order[rank * per_rank:(rank + 1) * per_rank]
    usable = (len(mine) // micro_batch) * micro_batch if len(mine) >= micro_batch else len(mine)
    return [mine[i:i + micro_batch] for i in range(0, usable, micro_batch)]


def collate(samples: list[CaptureSample], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Right-padded batch; padding is masked out (loss_mask 0) and its teacher carries no mass."""
    width = max(s.length for s in samples)
    batch = len(samples)
    first = samples[0]
    out = {
        "input_ids": torch.zeros(batch, width, dtype=torch.long),
        "loss_mask": torch.zeros(batch, width, dtype=torch.long),
        "aux": torch.zeros(batch, width, first.aux.shape[-1], dtype=dtype),
    }
    if first.last_hidden is not None:
        out["last_hidden"] = torch.zeros(batch, width, first.last_hidden.shape[-1], dtype=dtype)
    if first.topk_ids is not None:
        k = first.topk_ids.shape[-1]
        out["topk_ids"] = torch.zeros(batch, width, k, dtype=torch.long)
        out["topk_logprobs"] = torch.full((batch, width, k), -1e4, dtype=torch.float32)
    for row, s in enumerate(samples):
        n = s.length
        out["input_ids"][row, :n] = s.input_ids
        out["loss_mask"][row, :n] = s.loss_mask.long()
        out["aux"][row, :n] = s.aux.to(dtype)
        if "last_hidden" in out:
            out["last_hidden"][row, :n] = s.last_hidden.to(dtype)
        if "topk_ids" in out:
            out["topk_ids"][row, :n] = s.topk_ids
            out["topk_logprobs"][row, :n] = s.topk_logprobs.float()
    return out
