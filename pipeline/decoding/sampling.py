"""Sampling at temperature > 0, and verifying drafts by it the way SGLang does.

The target's distribution at a position is softmax(logits / temperature), then renormalised to its top-k
tokens and to its top-p nucleus (SGLang's order: python/sglang/srt/speculative/eagle_utils.py, the verify
step's sampling_softmax, top_k_renorm_prob, top_p_renorm_prob).

SGLang verifies EAGLE drafts "target only" (sgl-kernel's TreeSpeculativeSamplingTargetOnly, with the
drafter's probabilities left at zero and both thresholds at 1): at each level of the draft tree, one
uniform coin is drawn and the level's siblings are tried in order, accumulating their target
probabilities; the first sibling whose running sum reaches the coin is accepted and the walk goes down to
its children. Where no sibling is accepted, the next token is drawn from the target's distribution with
the tried siblings' mass removed, renormalised; past the last accepted draft with no children left, from
the target's full distribution. A chain is a tree with one sibling per level.

Every token that comes out is thereby a draw from the target's own distribution: the coin picks a sibling
with exactly its target probability, and the residual draw covers the rest of the vocabulary in
proportion. tests/unit/test_sampling.py checks that statistically, and that a verifier accepting greedily does
not pass the same check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the target samples: temperature > 0, top_p in (0, 1], top_k (0: all tokens)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"sampling needs a temperature > 0, got {self.temperature} (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def target_distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities [..., V] from logits [..., V]: temperature, then top-k, then top-p, each renormalised.
    The nucleus keeps the most probable tokens up to the first whose running sum reaches top_p."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_k and sampling.top_k < probs.shape[-1]:
        kth = probs.topk(sampling.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    if sampling.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # the mass of the more probable tokens
        ordered = torch.where(before < sampling.top_p, ordered, torch.zeros_like(ordered))
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a distribution [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def _coin(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator))


def verify_level(
    siblings: list[int], probs: torch.Tensor, generator: torch.Generator
) -> tuple[int | None, int | None]:
    """One level of SGLang's target-only verification: (index of the accepted sibling, None), or (None,
    the token drawn instead from `probs` without the siblings' mass)."""
    coin = _coin(generator)
    accumulated = 0.0
    for index, token in enumerate(siblings):
        accumulated += float(probs[token])
        if coin <= accumulated:
            return index, None
    residual = probs.clone()
    residual[siblings] = 0.0
    total = float(residual.sum())
    if total <= 0.0:  # the siblings held all the mass (rounding): take the most probable of them
        return int(torch.stack([probs[t] for t in siblings]).argmax()), None
    return None, draw(residual / total, generator)


def verify_chain(drafts: list[int], probs: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """Drafts d_1..d_K against the target's distributions [K + 1, V] (row i: after d_1..d_i): how many
    are accepted, and the token that follows them (the correction, or the bonus after all K)."""
    for index, token in enumerate(drafts):
        accepted, instead = verify_level([token], probs[index], generator)
        if accepted is None:
            assert instead is not None
            return index, instead
    return len(drafts), draw(probs[len(drafts)], generator)


def verify_tree(
    tokens: list[int], parents: list[int], probs: torch.Tensor, generator: torch.Generator
) -> tuple[list[int], int]:
    """A draft tree (node tokens and parents, -1 for the root's children, in verify order) against the
    target's distributions [1 + nodes, V] (row 0: after the root, row n + 1: after node n): the accepted
    path of nodes, root to leaf, and the token that follows it."""
    path: list[int] = []
    parent = -1
    while True:
        children = [node for node, p in enumerate(parents) if p == parent]
        row = probs[parent + 1]
        if not children:
            return path, draw(row, generator)
        accepted, instead = verify_level([tokens[node] for node in children], row, generator)
        if accepted is None:
            assert instead is not None
            return path, instead
        parent = children[accepted]
        path.append(parent)


def chi_square_p_value(observed: list[int], expected_probs: list[float]) -> float:
    """Pearson's chi-square goodness-of-fit test: the probability of a statistic at least this large if
    `observed` counts were drawn from `expected_probs` (cells of zero probability must stay empty)."""
    total = sum(observed)
    statistic, cells = 0.0, 0
    for count, prob in zip(observed, expected_probs, strict=True):
        if prob == 0.0:
            if count:
                return 0.0
            continue
        expected = total * prob
        statistic += (count - expected) ** 2 / expected
        cells += 1
    degrees = cells - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2.0), torch.tensor(statistic / 2.0)))
