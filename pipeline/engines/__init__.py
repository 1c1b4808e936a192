"""Generation and capture engines behind one interface.

- `hf`: transformers on CPU or GPU; the embedded default.
- `sglang`: an SGLang server over HTTP (see reference/sglang-contract.md).
- `vllm` (generation only): a vLLM worker of vLLM's own virtualenv (pipeline.engines.vllm_generate), or vLLM's
  OpenAI-compatible servers over HTTP (pipeline.engines.vllm_openai).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from pipeline.retrying import retrying

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineError(RuntimeError):
    """An engine that could not produce what was asked (server down, bad response, ...)."""


class EngineUnavailable(EngineError):
    """The servers stayed unreachable, overloaded or broken through every retry: the stage stops (what
    it finished is kept) instead of counting the conversations in flight as failed."""


class TransientRequestError(Exception):
    """A request failure worth retrying (timeout, dropped connection, 408/429/5xx, cut-off body)."""


def retried_request(engine: str, attempt: Callable[[int], T], attempts: int, deadline: float) -> T:
    """attempt(i) for i = 0, 1, ...: retried with backoff on TransientRequestError, within `attempts` and the
    monotonic `deadline`; EngineUnavailable (naming the engine, the tries and the last error) after that."""
    tried = 0

    def once() -> T:
        nonlocal tried
        tried += 1
        return attempt(tried - 1)

    def note(error: BaseException, retry: int, pause: float) -> None:
        log.warning("%s request failed (%s); retry %d in %.1fs", engine, error, retry, pause)

    try:
        return retrying(
            attempts,
            TransientRequestError,
            first_pause_s=0.5,
            max_pause_s=30.0,
            jitter=True,
            deadline=deadline,
            note=note,
        )(once)
    except TransientRequestError as err:
        cut_short = "; the request's deadline passed" if tried < attempts else ""
        raise EngineUnavailable(f"{engine} request failed after {tried} attempts: {err}{cut_short}") from err


# what a server answers while it is loading, overloaded or restarting: worth another try
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def pooled_session(servers: int, concurrency: int):
    """A requests.Session for a client of `servers` servers: a connection pool per server, holding up to
    max(4, concurrency) connections each."""
    import requests

    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=servers, pool_maxsize=max(4, concurrency))
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


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
