"""Speedup model: from evaluated acceptance and measured step costs, predict tokens/s of speculative
decoding for each (steps, topk, draft tokens) setting and rank them.

Per verify cycle the decoder spends `steps` drafter forwards (the first on the root, the rest on the
tree's frontier of width topk), one target forward over the root plus the draft tokens, and one drafter
forward extending its cache with the accepted tokens; it gains tau tokens. A chain's tau is
    tau(steps) = 1 + sum_{j < steps} full_acc_j          (the TTT counts over every held-out anchor)
and a tree's is its shape's simulated acceptance on held-out anchors (EvalRecord.shapes,
pipeline.decoding.tree_acceptance: EAGLE's best-topk-per-depth expansion and rerank to draft tokens).

The forwards are not the whole cycle: building and pruning the tree, its attention mask, finding the
accepted path, keeping the cache rows and the per-cycle Python cost the decoder spends besides. That
bookkeeping is fitted (Overhead) from the calibration's measured seconds per cycle, per timed setting, so
the predictions it gives for the timed settings are in-sample.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from pipeline.records import DraftSetting, EvalRecord


@dataclass(frozen=True)
class StepCosts:
    """Seconds per forward, measured on the serving engine."""

    target_step: float  # plain decoding: one target forward for one token
    verify_chain: dict[int, float]  # target forward over n tokens (root + n - 1 chained drafts)
    verify_tree: dict[int, float]  # the same with a tree attention mask
    draft: dict[int, float]  # drafter forward for a frontier of width topk

    def verify(self, topk: int) -> dict[int, float]:
        return self.verify_chain if topk == 1 else self.verify_tree

    def cycle(self, steps: int, topk: int, draft_tokens: int) -> float:
        return (
            self.draft[1] + (steps - 1) * self.draft[topk] + self.verify(topk)[draft_tokens] + self.draft[1]
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            key: (
                {str(k): round(v, 6) for k, v in value.items()}
                if isinstance(value, dict)
                else round(value, 6)
            )
            for key, value in asdict(self).items()
        }


def predicted_tau(
    evaluation: EvalRecord, steps: int, topk: int, draft_tokens: int | None = None
) -> float | None:
    """Tokens per verify cycle: a chain's from the TTT counts (steps beyond the evaluation's count as
    rejected: a lower bound), a tree's from its simulated shape (None when the evaluation did not simulate
    it)."""
    if topk == 1:
        return 1.0 + sum(evaluation.full_acc[:steps])
    if draft_tokens is None:
        raise ValueError("a draft tree's acceptance depends on its draft tokens: pass draft_tokens")
    shape = evaluation.shape(steps, topk, draft_tokens)
    return shape.tau if shape is not None else None


def candidate_settings(
    max_steps: int, widths: tuple[int, ...], max_draft_tokens: int
) -> list[tuple[int, int, int]]:
    """(steps, topk, draft tokens): a chain has steps + 1 tokens; a tree verifies its whole frontier."""
    settings = []
    for topk in widths:
        for steps in range(1, max_steps + 1):
            tokens = steps + 1 if topk == 1 else min(max_draft_tokens, 1 + topk * steps)
            settings.append((steps, topk, tokens))
    return settings


@dataclass(frozen=True)
class Overhead:
    """Seconds a decode spends per verify cycle besides its forwards, fitted from calibration:
    per_cycle + per_tree_cycle (a tree's) + per_draft_token * draft tokens; and per plain decoding step
    besides its target forward (per_plain_step)."""

    per_cycle: float = 0.0
    per_tree_cycle: float = 0.0
    per_draft_token: float = 0.0
    per_plain_step: float = 0.0

    def cycle(self, topk: int, draft_tokens: int) -> float:
        return (
            self.per_cycle + (self.per_tree_cycle if topk > 1 else 0.0) + self.per_draft_token * draft_tokens
        )

    def as_dict(self) -> dict[str, float]:
        return {key: round(value, 7) for key, value in asdict(self).items()}


@dataclass(frozen=True)
class CycleTiming:
    """A timed setting's measured seconds per verify cycle (all its decodes' seconds over their cycles)."""

    topk: int
    draft_tokens: int
    forwards: float  # the forwards' seconds per cycle, from StepCosts
    measured: float


def fit_overhead(timings: list[CycleTiming], plain_forward: float, plain_measured: float) -> Overhead:
    """Least squares of measured minus forward seconds per cycle on [1, tree, draft tokens] (the
    minimum-norm solution when fewer settings were timed than that); plain decoding's overhead per step is
    its measured seconds per token minus its target forward. A term may come out negative: the forwards were
    timed apart from decoding (a cache crop after each, a warm cache), so they are a model too."""
    per_plain = plain_measured - plain_forward
    if not timings:
        return Overhead(per_plain_step=per_plain)
    design = torch.tensor(
        [[1.0, float(t.topk > 1), float(t.draft_tokens)] for t in timings], dtype=torch.float64
    )
    residual = torch.tensor([[t.measured - t.forwards] for t in timings], dtype=torch.float64)
    solution = torch.linalg.pinv(design) @ residual
    per_cycle, per_tree, per_token = solution.flatten().tolist()
    return Overhead(per_cycle, per_tree, per_token, per_plain)


def predicted_speedup(
    tau: float, costs: StepCosts, overhead: Overhead, steps: int, topk: int, draft_tokens: int
) -> float:
    """tokens/s of the setting over plain decoding's, both with their bookkeeping."""
    cycle = costs.cycle(steps, topk, draft_tokens) + overhead.cycle(topk, draft_tokens)
    return tau * (costs.target_step + overhead.per_plain_step) / cycle


def rank_settings(
    evaluation: EvalRecord,
    costs: StepCosts,
    settings: list[tuple[int, int, int]],
    overhead: Overhead | None = None,
) -> list[DraftSetting]:
    """Every setting the evaluation and the measured costs allow, best predicted speed first."""
    bookkeeping = overhead or Overhead()
    ranked = []
    for steps, topk, tokens in settings:
        tau = predicted_tau(evaluation, steps, topk, tokens)
        if tau is None or tokens not in costs.verify(topk) or topk not in costs.draft:
            continue
        cycle = costs.cycle(steps, topk, tokens) + bookkeeping.cycle(topk, tokens)
        speedup = predicted_speedup(tau, costs, bookkeeping, steps, topk, tokens)
        ranked.append(
            DraftSetting(
                steps=steps,
                topk=topk,
                draft_tokens=tokens,
                tau=round(tau, 4),
                tok_s=round(tau / cycle, 2),
                speedup=round(speedup, 4),
            )
        )
    return sorted(ranked, key=lambda s: -s.tok_s)
