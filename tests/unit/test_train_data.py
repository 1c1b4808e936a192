"""Streaming training data's per-rank plans. The shard cache and prefetch against a store:
tests/integration/test_train_data.py."""

from pipeline.training.stream import (
    ShardRef,
    epoch_plan,
    sequential_plan,
)


def refs(counts):
    return [ShardRef(f"k{i}", f"{i:064x}", 100, n) for i, n in enumerate(counts)]


def test_epoch_plans_are_deterministic_disjoint_and_equal_per_rank():
    shards = refs([7, 3, 9, 5])
    plans = [epoch_plan(shards, seed=1, epoch=0, rank=r, world=2, micro_batch=3) for r in range(2)]
    assert plans[0] == epoch_plan(shards, seed=1, epoch=0, rank=0, world=2, micro_batch=3)
    assert len(plans[0]) == len(plans[1]) == 12 // 3  # 24 samples -> 12 per rank -> 4 batches of 3
    taken = [ref for plan in plans for batch in plan for ref in batch]
    assert len(taken) == len(set(taken)) == 24
    assert all(ref.index < shards[ref.shard].samples for ref in taken)
    assert epoch_plan(shards, seed=1, epoch=1, rank=0, world=2, micro_batch=3) != plans[0]
    assert epoch_plan(shards, seed=2, epoch=0, rank=0, world=2, micro_batch=3) != plans[0]
    assert sum(len(b) for b in sequential_plan(shards, 5)) == 24
