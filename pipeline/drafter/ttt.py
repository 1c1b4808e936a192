"""Training-time-test objective and metrics, shared by training and evaluation.

Alignment (step k, anchor t): the draft's input token is x_{t+1+k}; its target is the teacher
distribution at position t+1+k (which predicts x_{t+2+k}); the loss mask is loss_mask[t+1+k], i.e.
indexed by the draft's INPUT token, the position that drafts at serving time.

Positions the draft vocabulary cannot express (the target's top-1 is outside it) carry no loss, as in
SpecForge and EAGLE-3: position_mask = t2d[target top-1] * loss_mask (SpecForge a6b6b02,
specforge/algorithms/eagle3/model.py:488-493; EAGLE eagle/traineagle3/cnets.py `_compute_target_p`).
They stay in every accuracy denominator, where they count as misses: SGLang's verify rejects a draft
token that differs from the target's, and the drafter can never emit a token outside its vocabulary.
SpecForge counts them the same way (its accuracy divides by loss_mask, model.py:161-169). The share of
such positions is reported (inexpressible_fraction), so a low acceptance caused by a small draft
vocabulary shows as such.

Metrics come from summed counts (see MetricCounts), never from averages of per-batch ratios:
  acc_k       = sum(mask_k * c_k) / sum(mask_k)
  full_acc_k  = sum(chain_k * c_0 * ... * c_k) / sum(chain_k), chain_k = mask_0 * ... * mask_k
  cond_acc_k  = full_acc_k / full_acc_{k-1}, cond_acc_0 = acc_0
  tau         = 1 + sum_k full_acc_k   (simulated greedy chain acceptance length, bonus included)
  loss_k      = sum(mask_k * expressible_k * ce_k) / sum(mask_k * expressible_k)
  inexpressible_fraction_k = sum(mask_k * !expressible_k) / sum(mask_k)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def shift_left(x: torch.Tensor, by: int, fill) -> torch.Tensor:
    """x[:, t] <- x[:, t + by], padded with `fill` at the end (dim 1)."""
    if by == 0:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, by]
    return F.pad(x[:, by:], pad, value=fill)


@dataclass
class Teacher:
    """The target's next-token view at every position."""

    argmax: torch.Tensor  # [B, L] full-vocabulary top-1 (target ids)
    probs: torch.Tensor  # [B, L, Vd] target distribution restricted and renormalized to the draft vocabulary
    expressible: torch.Tensor  # [B, L] bool: the top-1 is in the draft vocabulary (else: no loss there)


def teacher_from_last_hidden(
    last_hidden: torch.Tensor, lm_head_weight: torch.Tensor, used_ids: torch.Tensor, chunk: int = 1024
) -> Teacher:
    """Teacher from the post-final-norm last hidden state through the target's lm_head (the full
    distribution); used_ids are the target ids of the draft vocabulary, in draft order."""
    argmaxes, probs = [], []
    weight = lm_head_weight.to(torch.float32)
    for start in range(0, last_hidden.shape[1], chunk):
        logits = last_hidden[:, start : start + chunk].to(torch.float32) @ weight.T
        argmaxes.append(logits.argmax(-1))
        probs.append(torch.softmax(logits[..., used_ids], dim=-1))
    argmax = torch.cat(argmaxes, 1)
    return Teacher(argmax, torch.cat(probs, 1), torch.isin(argmax, used_ids))


def teacher_from_topk(
    topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, draft_index: torch.Tensor, draft_vocab_size: int
) -> Teacher:
    """Teacher from stored top-K log-probs: the top-K mass inside the draft vocabulary, renormalized.

    draft_index[v] is the draft id of target id v, or -1 when v is outside the draft vocabulary.
    A position is expressible when its stored top-1 is in the draft vocabulary; so a position whose
    top-K holds no draft token is never expressible, and its all-zero distribution is never trained on.
    """
    index = draft_index[topk_ids]
    inside = index >= 0
    mass = torch.where(inside, topk_logprobs.float().exp(), torch.zeros((), dtype=torch.float32))
    probs = torch.zeros(*topk_ids.shape[:-1], draft_vocab_size, dtype=torch.float32, device=topk_ids.device)
    probs.scatter_add_(-1, index.clamp(min=0), mass)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)
    return Teacher(topk_ids[..., 0], probs, inside[..., 0])


_COUNT_ROWS = ("loss_sum", "correct", "masked", "full_correct", "chain", "inexpressible")


@dataclass
class MetricCounts:
    """Correct/denominator counts per TTT step, summed over batches and ranks before dividing.

    full_correct_at[k][j]: chain anchors whose target token was within the draft's top-k at every step
    0..j (what a draft tree of width k can accept); kept only for the levels asked for (evaluation).
    inexpressible[k]: masked positions of step k whose target top-1 is outside the draft vocabulary
    (no loss; counted as misses).
    """

    steps: int
    loss_sum: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    masked: list[float] = field(default_factory=list)
    full_correct: list[float] = field(default_factory=list)
    chain: list[float] = field(default_factory=list)
    inexpressible: list[float] = field(default_factory=list)
    full_correct_at: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        for name in _COUNT_ROWS:
            if not getattr(self, name):
                setattr(self, name, [0.0] * self.steps)

    @classmethod
    def empty(cls, steps: int, topk_levels: tuple[int, ...] = ()) -> MetricCounts:
        return cls(steps, full_correct_at={k: [0.0] * steps for k in topk_levels})

    def as_tensor(self) -> torch.Tensor:
        rows = [getattr(self, name) for name in _COUNT_ROWS] + [
            self.full_correct_at[k] for k in sorted(self.full_correct_at)
        ]
        return torch.tensor(rows, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, topk_levels: tuple[int, ...] = ()) -> MetricCounts:
        rows = tensor.tolist()
        counts = dict(zip(_COUNT_ROWS, rows[: len(_COUNT_ROWS)], strict=True))
        at_rows = rows[len(_COUNT_ROWS) :]
        return cls(
            len(rows[0]), **counts, full_correct_at=dict(zip(sorted(topk_levels), at_rows, strict=True))
        )

    def add(self, other: MetricCounts) -> None:
        for name in _COUNT_ROWS:
            ours, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, [a + b for a, b in zip(ours, theirs, strict=True)])
        for k, values in other.full_correct_at.items():
            mine = self.full_correct_at.setdefault(k, [0.0] * self.steps)
            self.full_correct_at[k] = [a + b for a, b in zip(mine, values, strict=True)]

    def summary(self) -> dict:
        acc = [c / m if m else 0.0 for c, m in zip(self.correct, self.masked, strict=True)]
        full = [c / m if m else 0.0 for c, m in zip(self.full_correct, self.chain, strict=True)]
        cond = [acc[0]] + [full[k] / full[k - 1] if full[k - 1] else 0.0 for k in range(1, self.steps)]
        trained = [m - x for m, x in zip(self.masked, self.inexpressible, strict=True)]
        loss = [s / m if m else 0.0 for s, m in zip(self.loss_sum, trained, strict=True)]
        inexpressible = [x / m if m else 0.0 for x, m in zip(self.inexpressible, self.masked, strict=True)]
        summary = {
            "loss": [round(x, 6) for x in loss],
            "acc": [round(x, 6) for x in acc],
            "full_acc": [round(x, 6) for x in full],
            "cond_acc": [round(x, 6) for x in cond],
            "tau_simulated": round(1.0 + sum(full), 6),
            "masked_tokens": [int(m) for m in self.masked],
            "chain_anchors": [int(m) for m in self.chain],
            "inexpressible_fraction": [round(x, 6) for x in inexpressible],
        }
        if self.full_correct_at:
            summary["full_acc_at"] = {
                str(k): [round(c / m, 6) if m else 0.0 for c, m in zip(values, self.chain, strict=True)]
                for k, values in sorted(self.full_correct_at.items())
            }
        return summary


def ttt_loss_and_counts(
    h_outs: list[torch.Tensor],
    logits_fn,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    teacher: Teacher,
    d2t: torch.Tensor,
    decay: float,
    topk_levels: tuple[int, ...] = (),
) -> tuple[torch.Tensor, MetricCounts]:
    """Weighted soft cross-entropy over the TTT steps and the counts behind every metric.

    The loss of step k covers the masked positions whose target top-1 the draft vocabulary can
    express; the accuracy counts cover every masked position (see the module docstring)."""
    steps = len(h_outs)
    counts = MetricCounts.empty(steps, topk_levels)
    within_all = {k: torch.ones_like(loss_mask, dtype=torch.bool) for k in topk_levels}
    total = h_outs[0].new_zeros((), dtype=torch.float32)
    chain = torch.ones_like(loss_mask, dtype=torch.bool)
    all_correct = torch.ones_like(loss_mask, dtype=torch.bool)
    for k, h_out in enumerate(h_outs):
        mask = shift_left(loss_mask, 1 + k, 0).bool()
        target_p = shift_left(teacher.probs, 1 + k, 0.0)
        target_top1 = shift_left(teacher.argmax, 1 + k, -1)
        trained = mask & shift_left(teacher.expressible, 1 + k, False)
        draft_logp = torch.log_softmax(logits_fn(h_out).float(), dim=-1)
        per_token = -(target_p * draft_logp).sum(-1)
        denominator = mask.sum()
        step_loss = (per_token * trained).sum() / trained.sum().clamp(min=1)
        total = total + (decay**k) * step_loss
        draft_top1 = draft_logp.argmax(-1)
        correct = (draft_top1 + d2t[draft_top1]) == target_top1
        chain = chain & mask
        all_correct = all_correct & correct
        counts.loss_sum[k] = float((per_token.detach() * trained).sum())
        counts.inexpressible[k] = float((mask & ~trained).sum())
        counts.correct[k] = float((correct & mask).sum())
        counts.masked[k] = float(denominator)
        counts.full_correct[k] = float((all_correct & chain).sum())
        counts.chain[k] = float(chain.sum())
        for width in topk_levels:
            top = draft_logp.topk(width, dim=-1).indices
            within_all[width] &= ((top + d2t[top]) == target_top1[..., None]).any(-1)
            counts.full_correct_at[width][k] = float((within_all[width] & chain).sum())
    return total, counts
