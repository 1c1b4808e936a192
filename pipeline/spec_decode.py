"""A small reference speculative decoder over a transformers target (batch size 1, greedy).

It exists to measure, on a CPU, what SGLang measures on GPUs: tokens per second and acceptance
length of plain greedy decoding, n-gram (prompt-lookup) speculation and an EAGLE-3 drafter, all on
the same target forward code. Every method verifies drafts in ONE target forward over the KV cache
and keeps only tokens equal to the target's own greedy choice, so outputs equal plain greedy decoding.

Acceptance length counts the bonus token: per verify cycle, accepted drafts + 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeline.drafter_model import DraftCache, Eagle3Drafter


@dataclass
class DecodeResult:
    tokens: list[int]
    seconds: float
    verify_forwards: int = 0
    cycle_tokens: int = 0  # tokens produced by verify cycles, before truncation at the end
    accepted_histogram: list[int] = field(default_factory=list)  # cycles that accepted 0..K drafts

    @property
    def acceptance_length(self) -> float:
        return self.cycle_tokens / self.verify_forwards if self.verify_forwards else 0.0


class TargetRunner:
    """The target with a KV cache; returns greedy next tokens and (optionally) aux hidden states."""

    def __init__(self, model, aux_layer_ids: list[int] | None):
        from transformers import DynamicCache

        self.model = model
        self._cache_cls = DynamicCache
        self.hidden_indices = [k + 1 for k in aux_layer_ids] if aux_layer_ids else None
        self.cache = None

    @property
    def length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def reset(self) -> None:
        self.cache = self._cache_cls(config=self.model.config)

    def forward(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy next token after each given position [T], and aux states [T, 3H] when wanted."""
        ids = torch.tensor([token_ids], dtype=torch.long)
        kwargs = {"output_hidden_states": self.hidden_indices} if self.hidden_indices else {}
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=0, **kwargs)
        next_tokens = out.logits[0].argmax(-1)
        aux = None
        if self.hidden_indices:
            aux = torch.cat([out.hidden_states[i][0] for i in self.hidden_indices], dim=-1)
        return next_tokens, aux

    def crop(self, length: int) -> None:
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)


class Proposer(Protocol):
    def start(self, context: list[int], aux: torch.Tensor | None) -> None: ...

    def propose(self, context: list[int], steps: int) -> list[int]: ...

    def accept(self, context: list[int], accepted_count: int, aux: torch.Tensor | None) -> None: ...


class NgramProposer:
    """Prompt-lookup drafting: continue the latest earlier occurrence of the context's suffix."""

    needs_aux = False

    def __init__(self, max_match: int = 4, min_match: int = 1):
        self.max_match, self.min_match = max_match, min_match

    def start(self, context, aux) -> None:
        pass

    def propose(self, context: list[int], steps: int) -> list[int]:
        for size in range(min(self.max_match, len(context) - 1), self.min_match - 1, -1):
            suffix = context[-size:]
            for start in range(len(context) - size - 1, -1, -1):
                if context[start:start + size] == suffix:
                    follow = context[start + size:start + size + steps]
                    if follow:
                        return follow
        return []

    def accept(self, context, accepted_count, aux) -> None:
        pass


class EagleProposer:
    """Chain drafting with an EAGLE-3 drafter on its own KV cache."""

    needs_aux = True

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.cache = DraftCache()
        self.next_draft: int | None = None
        self.last_hidden: torch.Tensor | None = None

    def _extend(self, aux: torch.Tensor, next_tokens: list[int], start: int) -> None:
        h_out = self.drafter.decode(aux[None], torch.tensor([next_tokens]), start, self.cache)
        self.last_hidden = h_out[:, -1:]
        self.next_draft = self._top1(self.last_hidden)

    def _top1(self, h_out: torch.Tensor) -> int:
        draft_id = self.drafter.logits(h_out)[0, -1].argmax()
        return int(self.drafter.draft_to_target(draft_id))

    def start(self, context: list[int], aux: torch.Tensor | None) -> None:
        """After prefill: aux rows 0..n-1 pair with tokens 1..n (the last one is the first output)."""
        assert aux is not None
        self.cache = DraftCache()
        self._extend(aux, context[1:], 0)

    def propose(self, context: list[int], steps: int) -> list[int]:
        drafts = [self.next_draft]
        hidden = self.last_hidden
        position = len(context) - 1
        for _ in range(steps - 1):
            hidden = self.drafter.decode(hidden, torch.tensor([[drafts[-1]]]), position, self.cache)
            drafts.append(self._top1(hidden))
            position += 1
        return drafts

    def accept(self, context: list[int], accepted_count: int, aux: torch.Tensor | None) -> None:
        """context already holds the accepted drafts and the bonus token; aux covers the verified positions."""
        assert aux is not None
        new = accepted_count + 1
        start = len(context) - 1 - new
        self.cache.crop(start)
        self._extend(aux[:new], context[start + 1:], start)


def greedy_decode(target: TargetRunner, prompt: list[int], max_new_tokens: int, eos_id: int | None) -> DecodeResult:
    started = time.perf_counter()
    target.reset()
    next_tokens, _ = target.forward(prompt)
    tokens = [int(next_tokens[-1])]
    while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
        next_tokens, _ = target.forward(tokens[-1:])
        tokens.append(int(next_tokens[-1]))
    return DecodeResult(tokens, time.perf_counter() - started)


def speculative_decode(target: TargetRunner, proposer, prompt: list[int], max_new_tokens: int,
                       eos_id: int | None, steps: int) -> DecodeResult:
    started = time.perf_counter()
    target.reset()
    next_tokens, aux = target.forward(prompt)
    context = list(prompt) + [int(next_tokens[-1])]
    proposer.start(context, aux)
    result = DecodeResult([], 0.0, accepted_histogram=[0] * (steps + 1))
    produced = 1
    while produced < max_new_tokens and context[-1] != eos_id:
        drafts = proposer.propose(context, min(steps, max_new_tokens - produced))
        verified, aux = target.forward([context[-1]] + drafts)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == int(verified[accepted]):
            accepted += 1
        new_tokens = drafts[:accepted] + [int(verified[accepted])]
        target.crop(len(context) + accepted)
        context.extend(new_tokens)
        result.verify_forwards += 1
        result.cycle_tokens += len(new_tokens)
        result.accepted_histogram[accepted] += 1
        produced += len(new_tokens)
        if eos_id in new_tokens or produced >= max_new_tokens:
            break
        proposer.accept(context, accepted, aux)
    output = context[len(prompt):]
    if eos_id in output:
        output = output[:output.index(eos_id) + 1]
    result.tokens = output[:max_new_tokens]
    result.seconds = time.perf_counter() - started
    return result
