"""Speedup model: from evaluated acceptance and measured step costs, predict tokens/s of speculative
decoding for each (steps, topk, draft tokens) setting and pick the best.

Per verify cycle the decoder spends `steps` drafter forwards (the first on the root, the rest on the
tree's frontier of width topk), one target forward over the root plus the draft tokens, and one drafter
forward extending its cache with the accepted tokens; it gains tau tokens, where
    tau(steps, topk) = 1 + sum_{j < steps} full_acc@topk_j
(full_acc@1 is full_acc: the chain). A tree prunes to `draft tokens - 1` nodes, so the prediction is
an upper bound when that budget is smaller than topk * steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pipeline.records import AcceptanceMetrics, DraftSetting


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


def acceptance_levels(evaluation: AcceptanceMetrics, topk: int) -> list[float]:
    if topk == 1:
        return evaluation.full_acc
    return evaluation.full_acc_at.get(str(topk), [])


def predicted_tau(evaluation: AcceptanceMetrics, steps: int, topk: int) -> float:
    return 1.0 + sum(acceptance_levels(evaluation, topk)[:steps])


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


def rank_settings(
    evaluation: AcceptanceMetrics, costs: StepCosts, settings: list[tuple[int, int, int]]
) -> list[DraftSetting]:
    """Every setting the evaluation and the measured costs allow, best predicted speed first."""
    ranked = []
    for steps, topk, tokens in settings:
        levels = acceptance_levels(evaluation, topk)
        if len(levels) < steps or tokens not in costs.verify(topk) or topk not in costs.draft:
            continue
        tau = predicted_tau(evaluation, steps, topk)
        tok_s = tau / costs.cycle(steps, topk, tokens)
        ranked.append(
            DraftSetting(
                steps=steps,
                topk=topk,
                draft_tokens=tokens,
                tau=round(tau, 4),
                tok_s=round(tok_s, 2),
                speedup=round(tok_s * costs.target_step, 4),
            )
        )
    return sorted(ranked, key=lambda s: -s.tok_s)
