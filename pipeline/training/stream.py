"""Training data streamed from capture shards in the object store.

- Each epoch's plan is a pure function of (dataset manifest, seed, epoch): the shard order is shuffled,
  the samples inside each shard are shuffled, and the resulting sequence is cut into one contiguous
  block per rank (equal lengths; the remainder is dropped), then into micro-batches. Every rank computes
  every rank's plan without talking to the others, and a resumed run recomputes the same plan and
  skips the batches it already took.
- Shards are fetched on demand into a content-addressed local cache (sha256-verified), the next ones
  are prefetched in the background while the current one is consumed, and the cache is kept under a
  byte budget by evicting the least recently used shards.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.data.capture_shards import CaptureSample, ShardReader
from pipeline.drafter.vocab import count_assistant_tokens

if TYPE_CHECKING:
    from pipeline.records import DatasetShard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardRef:
    key: str
    sha256: str
    bytes: int
    samples: int

    @classmethod
    def from_manifest(cls, entry: DatasetShard) -> ShardRef:
        return cls(entry.key, entry.sha256, entry.bytes, entry.samples)


@dataclass(frozen=True)
class SampleRef:
    shard: int  # index into the dataset's shard list
    index: int  # sample index inside the shard


def _generator(*parts: int | str) -> torch.Generator:
    seed = int(hashlib.sha256(repr(parts).encode()).hexdigest()[:15], 16)
    return torch.Generator().manual_seed(seed)


def epoch_plan(
    shards: list[ShardRef], seed: int, epoch: int, rank: int, world: int, micro_batch: int
) -> list[list[SampleRef]]:
    """This rank's micro-batches for one epoch (every rank gets the same number)."""
    order = torch.randperm(len(shards), generator=_generator(seed, epoch)).tolist()
    sequence = []
    for shard in order:
        inside = torch.randperm(
            shards[shard].samples, generator=_generator(seed, epoch, shards[shard].sha256)
        )
        sequence += [SampleRef(shard, int(i)) for i in inside]
    per_rank = len(sequence) // world
    mine = sequence[rank * per_rank : (rank + 1) * per_rank]
    usable = len(mine) // micro_batch * micro_batch
    return [mine[i : i + micro_batch] for i in range(0, usable, micro_batch)]


class ShardCache:
    """Local, verified copies of shards under `directory`, at most `max_bytes` of them (LRU)."""

    def __init__(self, store, directory: Path, max_bytes: int):
        self.store, self.directory, self.max_bytes = store, Path(directory), max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.recent: OrderedDict[str, int] = OrderedDict()
        self.pinned: set[str] = set()

    def path_of(self, shard: ShardRef) -> Path:
        return self.directory / f"{shard.sha256}.safetensors"

    def fetch(self, shard: ShardRef) -> Path:
        """The shard's local path, downloading (and verifying) it first when needed."""
        path = self.path_of(shard)
        if not path.exists():
            self.store.get_file_verified(shard.key, path, shard.sha256)
        with self.lock:
            self.recent[shard.sha256] = shard.bytes
            self.recent.move_to_end(shard.sha256)
            self._evict()
        return path

    def pin(self, shard: ShardRef, pinned: bool) -> None:
        with self.lock:
            (self.pinned.add if pinned else self.pinned.discard)(shard.sha256)

    def _evict(self) -> None:
        total = sum(self.recent.values())
        for sha in list(self.recent):
            if total <= self.max_bytes:
                break
            if sha in self.pinned:
                continue
            total -= self.recent.pop(sha)
            (self.directory / f"{sha}.safetensors").unlink(missing_ok=True)


class StreamingShards:
    """Samples of a shard list, fetched through a ShardCache with background prefetch."""

    def __init__(self, shards: list[ShardRef], cache: ShardCache, max_length: int, prefetch: int = 2):
        self.shards, self.cache, self.max_length, self.prefetch = shards, cache, max_length, prefetch
        self.pool = ThreadPoolExecutor(max_workers=max(1, prefetch), thread_name_prefix="shard-prefetch")
        self.pending: dict[int, Future] = {}
        self.readers: dict[int, ShardReader] = {}

    def _request(self, shard: int) -> None:
        if shard not in self.pending and shard not in self.readers:
            self.pending[shard] = self.pool.submit(self.cache.fetch, self.shards[shard])

    def _reader(self, shard: int) -> ShardReader:
        if shard not in self.readers:
            self._request(shard)
            path = self.pending.pop(shard).result()
            self.cache.pin(self.shards[shard], True)
            try:
                self.readers[shard] = ShardReader.from_file(path)
            except FileNotFoundError:  # evicted by another rank sharing the cache directory: fetch again
                self.readers[shard] = ShardReader.from_file(self.cache.fetch(self.shards[shard]))
        return self.readers[shard]

    def _release_all_but(self, keep: set[int]) -> None:
        for shard in [s for s in self.readers if s not in keep]:
            self.readers.pop(shard).close()
            self.cache.pin(self.shards[shard], False)

    def batches(self, plan: list[list[SampleRef]], start: int = 0) -> Iterator[list[CaptureSample]]:
        """The plan's micro-batches from `start` on, prefetching the shards coming next."""
        upcoming = [ref.shard for batch in plan[start:] for ref in batch]
        order = list(dict.fromkeys(upcoming))
        for index in range(start, len(plan)):
            batch = plan[index]
            current = {ref.shard for ref in batch}
            position = order.index(batch[-1].shard)
            for shard in order[position + 1 : position + 1 + self.prefetch]:
                self._request(shard)
            self._release_all_but(current)
            yield [self._reader(ref.shard).sample(ref.index).truncated(self.max_length) for ref in batch]
        self._release_all_but(set())

    def teachers(self) -> set[str]:
        """Teacher signals of the first shard (all shards of a dataset share one contract)."""
        reader = ShardReader.from_file(self.cache.fetch(self.shards[0]))
        try:
            return set(reader.teachers)
        finally:
            reader.close()

    def close(self) -> None:
        self._release_all_but(set())
        self.pool.shutdown(wait=True)


def sequential_plan(
    shards: list[ShardRef], micro_batch: int, only: Sequence[int] | None = None
) -> list[list[SampleRef]]:
    """Every sample once, in storage order (evaluation); with `only`, of those shards (by index) alone."""
    indices = range(len(shards)) if only is None else only
    refs = [SampleRef(s, i) for s in indices for i in range(shards[s].samples)]
    return [refs[i : i + micro_batch] for i in range(0, len(refs), micro_batch)]


def assistant_token_counts(store, shards: list[ShardRef], vocab_size: int) -> torch.Tensor:
    """Token frequencies over assistant tokens, read with ranged requests (no hidden states fetched)."""
    from pipeline.data.capture_shards import store_range_reader

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for shard in shards:
        ids, mask = ShardReader(store_range_reader(store, shard.key)).tokens_and_masks()
        count_assistant_tokens(counts, ids, mask)
    return counts


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
            out["last_hidden"][row, :n] = _batch_teacher(s, "last_hidden", s.last_hidden).to(dtype)
        if "topk_ids" in out:
            out["topk_ids"][row, :n] = _batch_teacher(s, "topk_ids", s.topk_ids)
            out["topk_logprobs"][row, :n] = _batch_teacher(s, "topk_logprobs", s.topk_logprobs).float()
    return out


def _batch_teacher(sample: CaptureSample, name: str, value: torch.Tensor | None) -> torch.Tensor:
    """A teacher tensor the batch's first sample has, so every sample of the batch must have it."""
    if value is None:
        raise ValueError(f"sample {sample.sample_id} has no {name}, unlike the first sample of its batch")
    return value
