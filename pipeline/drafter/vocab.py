"""The pruned draft vocabulary and its SGLang mapping tensors.

d2t[i] is an OFFSET: target_id = i + d2t[i]. t2d[v] is True when target id v is in the draft vocab.
The vocabulary is the draft_vocab_size most frequent target ids among assistant tokens (loss_mask
== 1) of the training data, ties broken by lower id, sorted ascending; lowest unused ids pad it
when the data has fewer distinct tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VocabMapping:
    used_ids: torch.Tensor  # [Vd] ascending target ids
    d2t: torch.Tensor  # [Vd] int64 offsets
    t2d: torch.Tensor  # [V] bool

    @property
    def draft_vocab_size(self) -> int:
        return int(self.used_ids.numel())


def count_assistant_tokens(counts: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """Add the assistant-token frequencies of one sample (or batch) into counts [V], in place."""
    selected = input_ids[loss_mask.bool()].long()
    counts += torch.bincount(selected, minlength=counts.numel())[: counts.numel()]


def build_mapping(counts: torch.Tensor, draft_vocab_size: int) -> VocabMapping:
    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft vocab {draft_vocab_size} exceeds target vocab {vocab_size}")
    ids = torch.arange(vocab_size)
    # stable sort by count descending keeps ties in ascending id order
    order = torch.argsort(-counts.to(torch.int64), stable=True)
    used = torch.sort(ids[order[:draft_vocab_size]]).values
    return mapping_from_used_ids(used, vocab_size)


def mapping_from_used_ids(used_ids: torch.Tensor, vocab_size: int) -> VocabMapping:
    used_ids = used_ids.to(torch.long)
    d2t = used_ids - torch.arange(used_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used_ids] = True
    return VocabMapping(used_ids, d2t, t2d)


def mapping_from_d2t(d2t: torch.Tensor, vocab_size: int) -> VocabMapping:
    """The mapping stored in an SGLang drafter, e.g. for a warm start that must reuse it."""
    used = torch.arange(d2t.numel()) + d2t.to(torch.long)
    if (used < 0).any() or (used >= vocab_size).any() or used.unique().numel() != used.numel():
        raise ValueError("d2t does not map draft ids to distinct target ids inside the vocabulary")
    return mapping_from_used_ids(used, vocab_size)
