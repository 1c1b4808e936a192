"""The training objective: the drafter wrapped with the frozen teacher pieces, and the choice of teacher
signal. Training (pipeline.training.worker) and evaluation (pipeline.stages.evaluate) use the same one."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.drafter.model import Eagle3Drafter
from pipeline.drafter.ttt import Teacher, teacher_from_last_hidden, teacher_from_topk, ttt_loss_and_counts


class DraftObjective(nn.Module):
    """Wraps the drafter with the frozen teacher pieces; forward returns (loss, metric counts).

    The teacher comes from the post-norm last hidden state through the target's lm_head, or from
    stored top-K log-probs, whichever `teacher` names.
    """

    def __init__(
        self,
        drafter: Eagle3Drafter,
        lm_head_weight: torch.Tensor | None,
        teacher: str,
        ttt_steps: int,
        decay: float,
        chunk: int,
        topk_levels: tuple[int, ...] = (),
    ):
        super().__init__()
        self.drafter = drafter
        if teacher == "last_hidden" and lm_head_weight is None:
            raise ValueError("a last_hidden teacher needs the target's lm_head")
        self.teacher = teacher
        if lm_head_weight is not None and teacher == "last_hidden":
            self.register_buffer("teacher_lm_head", lm_head_weight.detach().clone(), persistent=False)
        used_ids = torch.arange(drafter.arch.draft_vocab_size) + drafter.d2t
        draft_index = torch.full((drafter.arch.vocab_size,), -1, dtype=torch.long)
        draft_index[used_ids] = torch.arange(drafter.arch.draft_vocab_size)
        self.register_buffer("used_ids", used_ids, persistent=False)
        self.register_buffer("draft_index", draft_index, persistent=False)
        self.ttt_steps, self.decay, self.chunk, self.topk_levels = ttt_steps, decay, chunk, topk_levels

    def teacher_of(self, last_hidden=None, topk_ids=None, topk_logprobs=None) -> Teacher:
        """The target's next-token view at every position of a batch (collate's tensors)."""
        if self.teacher == "last_hidden":
            return teacher_from_last_hidden(
                last_hidden, self._buffer("teacher_lm_head"), self._buffer("used_ids")
            )
        return teacher_from_topk(
            topk_ids, topk_logprobs, self._buffer("draft_index"), self.drafter.arch.draft_vocab_size
        )

    def _buffer(self, name: str) -> torch.Tensor:
        return self.get_buffer(name)

    def forward(self, input_ids, loss_mask, aux, last_hidden=None, topk_ids=None, topk_logprobs=None):
        return self.with_teacher(
            self.teacher_of(last_hidden, topk_ids, topk_logprobs), input_ids, loss_mask, aux
        )

    def with_teacher(self, teacher: Teacher, input_ids, loss_mask, aux):
        """forward, with the teacher already computed (teacher_of)."""
        h_outs = self.drafter.ttt_forward(aux, input_ids, self.ttt_steps, self.chunk)
        return ttt_loss_and_counts(
            h_outs,
            self.drafter.logits,
            input_ids,
            loss_mask,
            teacher,
            self.drafter.d2t,
            self.decay,
            self.topk_levels,
        )


def choose_teacher(requested: str, available: set[str]) -> str:
    """The teacher signal to train on: the requested one, or (auto) last_hidden when stored, else top-k."""
    if requested != "auto":
        if requested not in available:
            raise ValueError(
                f"train.teacher {requested!r} is not in every capture shard (they carry {sorted(available)})"
            )
        return requested
    for kind in ("last_hidden", "topk"):
        if kind in available:
            return kind
    raise ValueError("the capture shards carry no common teacher signal")
