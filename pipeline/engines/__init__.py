"""Generation and capture engines behind one interface.

- `hf`: transformers on CPU or GPU; the embedded default.
- `sglang`: an SGLang server over HTTP (see reference/sglang-contract.md).
- `vllm` (generation only): a vLLM worker of vLLM's own virtualenv (pipeline.engines.vllm_generate), or vLLM's
  OpenAI-compatible servers over HTTP (pipeline.engines.vllm_openai).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline.data.spilled_rows import Rows, SpilledRows, loaded

# the engines' errors and request retries live where worker processes can import them without torch
from pipeline.engine_requests import RETRYABLE_STATUS as RETRYABLE_STATUS
from pipeline.engine_requests import EngineError as EngineError
from pipeline.engine_requests import EngineUnavailable as EngineUnavailable
from pipeline.engine_requests import TransientRequestError as TransientRequestError
from pipeline.engine_requests import pooled_session as pooled_session
from pipeline.engine_requests import retried_request as retried_request


def engine_servers(section) -> int:
    """How many servers a stage's (generate or capture config section) engine spreads over; the
    in-process engine counts as one."""
    if section.engine == "sglang" and section.sglang:
        return len(section.sglang.urls)
    server = getattr(section, "vllm_server", None)  # generation only
    return len(server.urls) if section.engine == "vllm" and server else 1


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
    """One sequence's capture. Hidden states come as tensors, or (from engines whose samples may not fit
    in memory) as SpilledRows: local files the capture stage reads a chunk at a time and then discards."""

    aux: Rows  # [L, 3H], ascending layer order
    last_hidden: Rows | None = None  # [L, H], post final norm
    topk_ids: torch.Tensor | None = None  # [L, K]: the target's top-K next tokens after each position
    topk_logprobs: torch.Tensor | None = None  # [L, K]: their full-vocabulary log-probabilities

    def materialized(self) -> Capture:
        """This capture with its hidden states in memory (spill files read and removed): for checks on a
        few short samples, never for a stage's bulk."""
        return Capture(
            loaded(self.aux),
            None if self.last_hidden is None else loaded(self.last_hidden),
            self.topk_ids,
            self.topk_logprobs,
        )

    def discard(self) -> None:
        """Remove the spill files this capture holds (nothing for tensors)."""
        for rows in (self.aux, self.last_hidden):
            if isinstance(rows, SpilledRows):
                rows.discard()


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
