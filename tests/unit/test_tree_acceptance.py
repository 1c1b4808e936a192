"""Draft-tree acceptance's parts: the rerank, the walk, anchor spreading, shapes. On held-out samples of
the tiny target: tests/integration/test_tree_acceptance.py."""

import pytest
import torch

from pipeline.decoding.reference_decoder import (
    TreeNodes,
    best_nodes,
)
from pipeline.decoding.tree_acceptance import TreeAcceptance, accepted_depth, anchor_positions


def small_tree() -> TreeNodes:
    """Depth 1: a (-0.1), b (-0.5); depth 2, the best 2 of all children: a1 (-0.3), a2 (-0.6); b's
    children were dropped at depth 2 although b1 (-0.7 in full) is b's best: per depth, not per parent."""
    nodes = TreeNodes()
    a = nodes.add(-0.1, 10, -1, 1)
    b = nodes.add(-0.5, 20, -1, 1)
    nodes.add(-0.3, 11, a, 2)
    nodes.add(-0.6, 12, a, 2)
    assert b == 1
    return nodes


def test_the_rerank_keeps_the_best_nodes_each_after_its_parent():
    nodes = small_tree()
    assert best_nodes(nodes, 4) == [0, 2, 1, 3]
    assert best_nodes(nodes, 2) == [0, 2]
    assert best_nodes(nodes, 3, max_depth=1) == [0, 1]
    # a child scoring above a parent that was not kept is skipped, never orphaned
    orphan = TreeNodes()
    orphan.add(-2.0, 1, -1, 1)
    orphan.add(-0.5, 2, -1, 1)
    orphan.add(-1.0, 3, 0, 2)
    assert best_nodes(orphan, 2) == [1, 0]


def test_a_walk_accepts_down_the_kept_nodes_that_carry_the_expected_tokens():
    nodes = small_tree()
    targets = list(nodes.tokens)
    assert accepted_depth(nodes, [0, 2, 1, 3], targets, [10, 12]) == 2
    assert accepted_depth(nodes, [0, 2, 1, 3], targets, [20, 21]) == 1
    # pruned to 2 nodes, a2 is gone: the same continuation accepts one draft only
    assert accepted_depth(nodes, [0, 2], targets, [10, 12]) == 1
    assert accepted_depth(nodes, [0, 2], targets, [99]) == 0
    assert accepted_depth(nodes, [0, 2], targets, []) == 0


def test_anchors_spread_over_the_response_positions():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 0])
    assert anchor_positions(mask, 99) == [2, 3, 4, 5, 6, 7]
    assert anchor_positions(mask, 2) == [3, 6]
    assert anchor_positions(mask, 0) == []
    assert anchor_positions(torch.zeros(5, dtype=torch.long), 3) == []


def test_a_shape_must_be_a_draft():
    with pytest.raises(ValueError, match="draft tokens >= 2"):
        TreeAcceptance(None, [(2, 2, 1)], 4)  # type: ignore[arg-type]
