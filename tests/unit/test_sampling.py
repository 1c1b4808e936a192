"""Speculative decoding at temperature > 0 (pipeline.decoding.sampling): SGLang's target-only verification
of chains and trees gives outputs distributed as the target's own sampling, whatever the drafts.

The check is statistical, on a target small enough to know exactly: a first-order Markov chain over six
tokens (each token's logits are a fixed row), sampled at temperature 0.8 with top_p 0.9 and top_k 5, so
the truncations matter. Many short generations are drawn through the real decoder loop with a proposer
that drafts from another chain (often wrong), and their three-token outputs are compared with the exact
distribution by Pearson's chi-square test at significance ALPHA: the test fails, wrongly, once in
1/ALPHA runs of a correct verifier. A verifier that accepts a draft when it is the target's most
probable token (greedy acceptance at temperature > 0) must fail the same check.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pipeline.decoding import reference_decoder, sampling
from pipeline.decoding.reference_decoder import (
    DraftTree,
    greedy_decode,
    speculative_decode,
    tree_speculative_decode,
)
from pipeline.decoding.sampling import Sampling, chi_square_p_value, target_distribution

VOCAB = 6
NEW_TOKENS = 3
DRAWS = 4000
ALPHA = 1e-3
SAMPLING = Sampling(temperature=0.8, top_p=0.9, top_k=5)
PROMPT = [0]


def _table(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


TARGET_LOGITS = _table(1)
DRAFT_LOGITS = _table(2)


class MarkovTarget:
    """The TargetRunner interface over a Markov chain: the logits after a token are its row."""

    def __init__(self):
        self.tokens: list[int] = []
        self.pending: list[int] = []
        self.last_logits: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def forward(self, token_ids: list[int]):
        self.tokens += token_ids
        self.last_logits = TARGET_LOGITS[token_ids]
        return self.last_logits.argmax(-1), None

    def forward_tree(self, tree: DraftTree, root: int):
        self.pending = [root] + tree.tokens
        self.last_logits = TARGET_LOGITS[self.pending]
        return self.last_logits.argmax(-1), None

    def keep(self, prefix: int, rows: list[int]) -> None:
        self.tokens = self.tokens[:prefix] + [self.pending[row] for row in rows]

    def crop(self, length: int) -> None:
        self.tokens = self.tokens[:length]

    def distributions(self, how: Sampling) -> torch.Tensor:
        assert self.last_logits is not None
        return target_distribution(self.last_logits, how)


class MarkovDrafter:
    """Drafts the other chain's greedy continuation, or a tree of its top-k at each level."""

    needs_aux = False

    def start(self, context, aux) -> None:
        pass

    def accept(self, context, accepted_count, aux) -> None:
        pass

    def propose(self, context: list[int], steps: int) -> list[int]:
        drafts = [context[-1]]
        for _ in range(steps):
            drafts.append(int(DRAFT_LOGITS[drafts[-1]].argmax()))
        return drafts[1:]

    def propose_tree(self, context: list[int], steps: int, topk: int, budget: int) -> DraftTree:
        tree = DraftTree()
        frontier = [(-1, context[-1])]
        for depth in range(1, steps + 1):
            grown = []
            for parent, token in frontier:
                for child in DRAFT_LOGITS[token].topk(topk).indices.tolist():
                    if len(tree.tokens) < budget:
                        tree.tokens.append(child)
                        tree.parents.append(parent)
                        tree.depths.append(depth)
                        grown.append((len(tree.tokens) - 1, child))
            frontier = grown
        return tree


def exact_distribution() -> dict[tuple[int, ...], float]:
    """P(the first NEW_TOKENS tokens) under the target's own sampling."""
    step = target_distribution(TARGET_LOGITS, SAMPLING)
    exact = {}
    for sequence in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        prob, last = 1.0, PROMPT[-1]
        for token in sequence:
            prob *= float(step[last, token])
            last = token
        exact[sequence] = prob
    return exact


def p_value(decode) -> float:
    """Goodness of fit of DRAWS generations by `decode(generator)` to the exact distribution."""
    generator = torch.Generator().manual_seed(20261202)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(DRAWS):
        tokens = tuple(decode(generator).tokens[:NEW_TOKENS])
        counts[tokens] = counts.get(tokens, 0) + 1
    exact = exact_distribution()
    assert set(counts) <= {s for s, p in exact.items() if p > 0}, "a token outside top-k/top-p came out"
    # cells expected fewer than 5 times are pooled, as Pearson's approximation wants
    small = [s for s, p in exact.items() if p * DRAWS < 5]
    cells = [s for s in exact if s not in small]
    observed = [counts.get(s, 0) for s in cells] + [sum(counts.get(s, 0) for s in small)]
    expected = [exact[s] for s in cells] + [sum(exact[s] for s in small)]
    return chi_square_p_value(observed, expected)


def chain(generator):
    return speculative_decode(
        MarkovTarget(), MarkovDrafter(), PROMPT, NEW_TOKENS, None, 2, SAMPLING, generator
    )


def tree(generator):
    return tree_speculative_decode(
        MarkovTarget(), MarkovDrafter(), PROMPT, NEW_TOKENS, None, 2, 2, 5, SAMPLING, generator
    )


def plain(generator):
    return greedy_decode(MarkovTarget(), PROMPT, NEW_TOKENS, None, SAMPLING, generator)


@pytest.mark.parametrize("decode", [plain, chain, tree], ids=["plain", "chain", "tree"])
def test_sampled_outputs_are_distributed_as_the_targets_own_sampling(decode):
    assert p_value(decode) > ALPHA


def _accepting_greedily(drafts, probs, generator):
    """Wrong on purpose: a draft is accepted when it is the target's most probable token."""
    for index, token in enumerate(drafts):
        if token != int(probs[index].argmax()):
            return index, sampling.draw(probs[index], generator)
    return len(drafts), sampling.draw(probs[len(drafts)], generator)


def test_a_verifier_accepting_greedily_fails_the_same_check(monkeypatch):
    monkeypatch.setattr(reference_decoder.sampled, "verify_chain", _accepting_greedily)
    assert p_value(chain) < ALPHA


def test_the_drafts_are_often_wrong_and_often_accepted():
    """The check means something only if verification both accepts and rejects drafts."""
    generator = torch.Generator().manual_seed(7)
    histogram = [0, 0, 0]
    for _ in range(300):
        result = chain(generator)
        histogram = [a + b for a, b in zip(histogram, result.accepted_histogram, strict=True)]
    assert histogram[0] > 30 and histogram[1] + histogram[2] > 30, histogram


def test_the_nucleus_and_top_k_are_renormalised():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = target_distribution(logits, Sampling(temperature=1.0, top_p=0.8))
    full = torch.softmax(logits, -1)[0]
    # the nucleus: the most probable tokens up to the first whose running sum reaches top_p, renormalised
    assert float(full[0]) < 0.8 <= float(full[0] + full[1])
    assert torch.allclose(probs[0], torch.cat([full[:2] / full[:2].sum(), torch.zeros(2)]))
    assert target_distribution(logits, Sampling(temperature=1.0, top_k=1))[0].tolist() == [1.0, 0, 0, 0]
    top3 = target_distribution(logits, Sampling(temperature=2.0, top_k=3))[0]
    warm = torch.softmax(logits[0] / 2.0, -1)
    assert torch.allclose(top3, torch.cat([warm[:3] / warm[:3].sum(), torch.zeros(1)]))
    with pytest.raises(ValueError, match="temperature > 0"):
        Sampling(temperature=0.0)
