"""Generation and capture engines behind one interface.

- `hf`: transformers on CPU or GPU; the embedded default.
- `sglang`: an SGLang server over HTTP (see reference/sglang-contract.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class EngineError(RuntimeError):
    """An engine that could not produce what was asked (server down, bad response, ...)."""


class EngineUnavailable(EngineError):
    """The servers stayed unreachable, overloaded or broken through every retry: the stage stops (what
    it finished is kept) instead of counting the conversations in flight as failed."""


def engine_servers(section) -> int:
    """How many servers a stage's (generate or capture config section) engine spreads over; the
    in-process engine counts as one."""
    return len(section.sglang.urls) if section.engine == "sglang" and section.sglang else 1


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    top_logprobs: int = 0  # > 0: also return the top-k log-probs behind every generated token


@dataclass
class Generation:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    # per generated token, the top-k [token id, log-prob] of the distribution it was drawn from
    top_logprobs: list[list[list[float]]] | None = None


@dataclass(frozen=True)
class TeacherRequest:
    """Which teacher signals a capture must return: post-norm last hidden and/or top-k log-probs."""

    kinds: tuple[str, ...] = ("last_hidden",)
    topk: int = 20


DEFAULT_TEACHER = TeacherRequest()  # the engines' default (frozen, so one shared instance is safe)


@dataclass
class Capture:
    aux: torch.Tensor  # [L, 3H], ascending layer order
    last_hidden: torch.Tensor | None = None  # [L, H], post final norm
    topk_ids: torch.Tensor | None = None  # [L, K]: the target's top-K next tokens after each position
    topk_logprobs: torch.Tensor | None = None  # [L, K]: their full-vocabulary log-probabilities


class GenerationEngine(Protocol):
    name: str
    version: str

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...


class CaptureEngine(Protocol):
    name: str
    version: str

    def capture(
        self, sequences: list[list[int]], aux_layer_ids: list[int], teacher: TeacherRequest
    ) -> list[Capture]: ...
