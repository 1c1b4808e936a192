"""Draft-tree acceptance simulated on held-out samples with the decoder's own tree code."""

import pytest
import torch

from pipeline.decoding.reference_decoder import (
    EagleProposer,
    TargetRunner,
    TreeNodes,
    best_nodes,
    greedy_decode,
)
from pipeline.decoding.tree_acceptance import TreeAcceptance, accepted_depth, anchor_positions
from tests.test_spec_decode import AUX, random_drafter


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


@pytest.fixture(scope="module")
def sample(tiny_model, tiny_tokenizer):
    """A prompt and the tiny target's greedy answer, its aux hidden states and top-1 after each position."""
    from pipeline.data.conversations import prompt_ids
    from pipeline.engines.tiny_target import corpus_turns

    turn = corpus_turns(heldout=True)[7]
    prompt = prompt_ids(tiny_tokenizer, [{"role": "user", "content": turn.prompt}])
    with torch.inference_mode():
        answer = greedy_decode(TargetRunner(tiny_model, None), prompt, 24, None).tokens
        runner = TargetRunner(tiny_model, AUX)
        runner.reset()
        top1, aux = runner.forward(prompt + answer)
    mask = torch.tensor([0] * len(prompt) + [1] * len(answer))
    # scaled down: a random drafter's output then depends on the tokens it is fed, not on aux states alone,
    # so a tree grown from misaligned tokens differs from the decoder's
    return torch.tensor(prompt + answer), aux * 0.01, mask, top1, len(prompt)


@pytest.mark.parametrize("steps, topk, draft_tokens", [(3, 2, 6), (4, 4, 12), (3, 1, 4)])
def test_the_simulated_tree_is_the_decoders_tree_and_is_accepted_as_far_as_it_matches(
    tiny_target_dir, sample, steps, topk, draft_tokens
):
    """At an anchor the simulation grows the tree the decoder's proposer grows from the same verified
    tokens, and accepts exactly the depths whose node carries the expected token."""
    ids, aux, mask, _, prompt_len = sample
    drafter = random_drafter(tiny_target_dir, seed=3)
    t = prompt_len + 5
    with torch.inference_mode():
        proposer = EagleProposer(drafter)
        proposer.start(ids[: t + 2].tolist(), aux[: t + 1])
        tree = proposer.propose_tree(ids[: t + 2].tolist(), steps, topk, draft_tokens - 1)
    for node in range(len(tree.tokens)):  # every node's path in the decoder's (pruned) tree, as target tokens
        path: list[int] = []
        while node != -1:
            path.insert(0, tree.tokens[node])
            node = tree.parents[node]
        for wrong_at in range(len(path) + 1):  # the path, wrong from wrong_at on
            expected = torch.full((len(ids),), -1, dtype=torch.long)
            expected[t + 1 : t + 1 + wrong_at] = torch.tensor(path[:wrong_at], dtype=torch.long)
            simulated = TreeAcceptance(drafter, [(steps, topk, draft_tokens)], anchors_per_sample=1)
            with torch.inference_mode():
                simulated.add_anchors(ids, aux, mask, expected, [t])
            counts = simulated.counts[(steps, topk, draft_tokens)]
            assert counts.valid == [1] * steps
            assert counts.accepted == [1] * wrong_at + [0] * (steps - wrong_at)


def test_depths_past_the_response_are_not_counted(tiny_target_dir, sample):
    ids, aux, mask, top1, _ = sample
    drafter = random_drafter(tiny_target_dir, seed=3)
    simulated = TreeAcceptance(drafter, [(4, 2, 8), (2, 1, 3)], anchors_per_sample=1)
    last = len(ids) - 3  # two response tokens follow: depths 1 and 2 only
    with torch.inference_mode():
        simulated.add_anchors(ids, aux, mask, top1, [last])
    assert simulated.counts[(4, 2, 8)].valid == [1, 1, 0, 0]
    assert simulated.counts[(2, 1, 3)].valid == [1, 1]
    assert simulated.anchors == 1
    result = simulated.results()
    assert [(r["steps"], r["topk"], r["draft_tokens"], r["anchors"]) for r in result] == [
        (4, 2, 8, 1),
        (2, 1, 3, 1),
    ]


def test_a_shape_must_be_a_draft():
    with pytest.raises(ValueError, match="draft tokens >= 2"):
        TreeAcceptance(None, [(2, 2, 1)], 4)  # type: ignore[arg-type]
