"""Acceptance of the draft shapes a benchmark may serve, simulated on held-out captures with the decoder's own
tree code (pipeline.decoding.reference_decoder.expand_tree and best_nodes).

The per-parent "target within the draft's top-k at every depth" count (MetricCounts.full_correct_at)
over-predicts a tree: EAGLE keeps the `topk` best nodes per DEPTH over all parents, then reranks the whole
tree to `draft tokens - 1` nodes, so the right token is often pruned by a sibling branch. Here the tree is
grown and pruned exactly as the decoder does it:

- at an anchor t of a held-out sample (x_{t+1} the last verified token, as after a verify cycle), the
  drafter's cache holds positions 0..t, each fed the target's aux hidden state and the next token, as the
  decoder extends it after verification;
- the tree is expanded from there (`topk` wide, the deepest `steps` asked for) and pruned to each shape's
  `draft tokens - 1` best nodes of depth <= its `steps` (a smaller tree is the top of a deeper expansion);
- it is walked down the target's greedy continuation: the depth-d node must carry the target's top-1 at
  position t+d (the teacher's argmax), which is what the verify forward accepts.

A depth counts only while the sample still has response tokens there (its loss mask), as the TTT chain
metrics count (pipeline.drafter.ttt): full_acc_d = anchors accepting >= d drafts / anchors with d depths,
tau = 1 + sum_d full_acc_d. A chain is the shape (steps, 1, steps + 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipeline.decoding.reference_decoder import TreeNodes, best_nodes, expand_tree
from pipeline.drafter.model import DraftCache, Eagle3Drafter

Shape = tuple[int, int, int]  # (steps, topk, draft tokens)


@dataclass
class DepthCounts:
    """Per depth d (index d - 1): anchors that accepted at least d drafts, and anchors with d depths."""

    accepted: list[int]
    valid: list[int]

    def full_acc(self) -> list[float]:
        return [a / v if v else 0.0 for a, v in zip(self.accepted, self.valid, strict=True)]

    def tau(self) -> float:
        return 1.0 + sum(self.full_acc())


def anchor_positions(loss_mask: torch.Tensor, count: int) -> list[int]:
    """Up to `count` anchors t, evenly spread over the positions whose next token is a response token
    (loss_mask[t + 1]): the anchors where a verify cycle of the decoder could have ended."""
    candidates = (loss_mask[1:].bool()).nonzero().flatten().tolist()
    if count <= 0 or not candidates:
        return []
    if count >= len(candidates):
        return candidates
    return sorted({candidates[int((i + 0.5) * len(candidates) / count)] for i in range(count)})


def accepted_depth(nodes: TreeNodes, kept: Sequence[int], target_ids: list[int], expected: list[int]) -> int:
    """Drafts the verify forward accepts: walk down the kept nodes whose token is `expected[d - 1]` at
    depth d (`target_ids`: every node's token as a target id)."""
    children: dict[int, list[int]] = {}
    for node in kept:
        children.setdefault(nodes.parents[node], []).append(node)
    parent, depth = -1, 0
    while depth < len(expected):
        child = next((n for n in children.get(parent, []) if target_ids[n] == expected[depth]), None)
        if child is None:
            break
        parent, depth = child, depth + 1
    return depth


@dataclass
class TreeAcceptance:
    """Simulated acceptance of every shape in `shapes`, summed over the samples added."""

    drafter: Eagle3Drafter
    shapes: list[Shape]
    anchors_per_sample: int
    counts: dict[Shape, DepthCounts] = field(default_factory=dict)
    anchors: int = 0

    def __post_init__(self) -> None:
        for steps, topk, tokens in self.shapes:
            if steps < 1 or topk < 1 or tokens < 2:
                raise ValueError(
                    f"a draft shape needs steps >= 1, topk >= 1, draft tokens >= 2: {steps, topk, tokens}"
                )
            self.counts[(steps, topk, tokens)] = DepthCounts([0] * steps, [0] * steps)

    def deepest(self) -> dict[int, int]:
        """The deepest expansion each width needs."""
        depth: dict[int, int] = {}
        for steps, topk, _ in self.shapes:
            depth[topk] = max(depth.get(topk, 0), steps)
        return depth

    def add_sample(
        self, input_ids: torch.Tensor, aux: torch.Tensor, loss_mask: torch.Tensor, expected: torch.Tensor
    ) -> None:
        """One held-out sample: token ids [L], aux hidden states [L, 3H], loss mask [L] and the target's
        top-1 after every position [L] (target ids), simulated at up to anchors_per_sample anchors."""
        self.add_anchors(
            input_ids, aux, loss_mask, expected, anchor_positions(loss_mask, self.anchors_per_sample)
        )

    def add_anchors(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        loss_mask: torch.Tensor,
        expected: torch.Tensor,
        anchors: list[int],
    ) -> None:
        """add_sample at the given anchors (ascending)."""
        if not anchors or not self.shapes:
            return
        cache, cached = DraftCache(), 0
        ids, mask, top1 = input_ids.tolist(), loss_mask.bool().tolist(), expected.tolist()
        for t in anchors:
            h = self.drafter.decode(
                aux[cached : t + 1][None].float(), torch.tensor([ids[cached + 1 : t + 2]]), cached, cache
            )
            cached = t + 1
            self._anchor(cache, h[:, -1:], t, _depths(mask, t), top1)
            self.anchors += 1

    def _anchor(
        self, cache: DraftCache, last_hidden: torch.Tensor, t: int, depths: int, top1: list[int]
    ) -> None:
        for topk, steps in self.deepest().items():
            nodes = expand_tree(self.drafter, cache, last_hidden, t + 1, steps, topk)
            drafted = torch.tensor(nodes.tokens)
            target_ids = (drafted + self.drafter.d2t[drafted]).tolist()
            for shape, counts in self.counts.items():
                if shape[1] != topk:
                    continue
                valid = min(depths, shape[0])
                expected = top1[t + 1 : t + 1 + valid]
                kept = best_nodes(nodes, shape[2] - 1, shape[0])
                accepted = accepted_depth(nodes, kept, target_ids, expected)
                for d in range(valid):
                    counts.valid[d] += 1
                    counts.accepted[d] += d < accepted

    def results(self) -> list[dict]:
        return [
            {
                "steps": steps,
                "topk": topk,
                "draft_tokens": tokens,
                "full_acc": [round(x, 6) for x in counts.full_acc()],
                "tau": round(counts.tau(), 6),
                "anchors": counts.valid[0] if counts.valid else 0,
            }
            for (steps, topk, tokens), counts in self.counts.items()
        ]


def _depths(mask: list[bool], t: int) -> int:
    """Consecutive response positions t+1, t+2, ...: the depths a draft from anchor t can be checked at."""
    depth = 0
    while t + 1 + depth < len(mask) and mask[t + 1 + depth]:
        depth += 1
    return depth
