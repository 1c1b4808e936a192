"""Streaming training data: deterministic per-rank plans, a verified LRU shard cache, prefetch."""

import pytest
import torch

from pipeline.data.capture_shards import CaptureSample
from pipeline.data.shard_writer import write_shard
from pipeline.training.stream import (
    SampleRef,
    ShardCache,
    ShardRef,
    StreamingShards,
    epoch_plan,
)


def write_shards(store, tmp_path, count=3, samples=4):
    entries = []
    for shard in range(count):
        items = [
            CaptureSample(
                f"s{shard}-{i}",
                torch.arange(5) + i,
                torch.ones(5, dtype=torch.uint8),
                torch.randn(5, 12),
                None,
                torch.zeros(5, 2, dtype=torch.long),
                torch.zeros(5, 2) - 1,
            )
            for i in range(samples)
        ]
        path = tmp_path / f"shard{shard}.safetensors"
        write_shard(items, path, "fp8")
        info = store.put_file(f"caps/shard{shard}.safetensors", path)
        entries.append(ShardRef(info.key, info.sha256, info.bytes, samples))
    return entries


def test_cache_verifies_downloads_and_evicts_least_recently_used(store, tmp_path):
    shards = write_shards(store, tmp_path)
    cache = ShardCache(store, tmp_path / "cache", max_bytes=int(shards[0].bytes * 2.5))
    for shard in shards:
        cache.fetch(shard)
    kept = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert kept == sorted(f"{s.sha256}.safetensors" for s in shards[1:])  # shard 0 was the oldest
    cache.pin(shards[1], True)
    cache.fetch(shards[0])
    assert (tmp_path / "cache" / f"{shards[1].sha256}.safetensors").exists()  # pinned: in use
    corrupt = ShardRef(shards[0].key, "0" * 64, shards[0].bytes, 4)
    with pytest.raises(Exception, match="checksum mismatch"):
        cache.fetch(corrupt)


def test_streaming_batches_follow_the_plan_and_resume_mid_epoch(store, tmp_path):
    shards = write_shards(store, tmp_path)
    stream = StreamingShards(shards, ShardCache(store, tmp_path / "cache", 1 << 30), max_length=3, prefetch=2)
    plan = epoch_plan(shards, seed=0, epoch=0, rank=0, world=1, micro_batch=2)
    full = [[s.sample_id for s in batch] for batch in stream.batches(plan)]
    expected = [[f"s{ref.shard}-{ref.index}" for ref in batch] for batch in plan]
    assert full == expected and len(full) == 6
    resumed = [[s.sample_id for s in batch] for batch in stream.batches(plan, start=4)]
    assert resumed == full[4:]
    first = next(iter(stream.batches(plan)))[0]
    assert first.length == 3 and first.aux.shape == (3, 12)  # truncated to max_length
    stream.close()
    assert isinstance(plan[0][0], SampleRef)
