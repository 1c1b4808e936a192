"""Draft-tree acceptance simulated on held-out samples with the decoder's own tree code."""

import pytest
import torch

from pipeline.decoding.reference_decoder import (
    EagleProposer,
    TargetRunner,
    greedy_decode,
)
from pipeline.decoding.tree_acceptance import TreeAcceptance
from tests.builders import AUX, random_drafter


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
