"""Generation against vLLM's OpenAI-compatible servers (`vllm serve`): `generate.engine: vllm` with
`generate.vllm_server`, the production path.

Coded to vLLM 0.32.0 (vllm/entrypoints/openai/completion/):
- POST /v1/completions takes the prompt as token ids (`prompt: list[int]`, protocol.py:52-58), so the chat
  template the pipeline applied is what the target sees; `return_token_ids: true` puts the completion's
  token ids in `choices[0].token_ids` (protocol.py:171, serving.py:591-593), including the stop token
  vLLM finished on (vllm/v1/core/sched/utils.py:104-112 appends it before checking).
- Every sampling parameter is sent: a field left out takes the server's default, which is the target's
  generation_config.json (protocol.py:351-359), not the engine's plain greedy or temperature sampling.
- Top log-probs: `logprobs: k` with `return_tokens_as_token_ids: true` gives, per generated token, a dict
  "token_id:<id>" -> log-prob of the top k plus the sampled token (serving.py:697-728; the key format is
  vllm/entrypoints/generate/base/serving.py:326-327); they come from the raw logits (ModelConfig
  logprobs_mode "raw_logprobs", vllm/config/model.py:287). The server refuses k above its --max-logprobs
  (default 20, vllm/config/model.py:282).
Requests are spread over the servers with bounded concurrency and retried on timeouts, dropped
connections, 408/429/5xx and cut-off bodies (pipeline.retrying), within a per-request deadline.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import cycle
from threading import Lock
from typing import Any

import orjson

from pipeline.credentials import without_credentials
from pipeline.engine_requests import post_json
from pipeline.engine_settings import VllmServerClientConfig
from pipeline.engines import (
    RETRYABLE_STATUS,
    EngineError,
    EngineUnavailable,
    Generation,
    SamplingParams,
    TransientRequestError,
    pooled_session,
    retried_request,
)

log = logging.getLogger(__name__)

TOKEN_ID_PREFIX = "token_id:"
SAMPLING_EPSILON = 1e-6  # temperatures at or below it decode greedily, as the HF engine does


class OpenAIClient:
    """JSON over HTTP to several OpenAI-compatible servers: bounded concurrency, retries, a deadline."""

    def __init__(self, settings: VllmServerClientConfig):
        self.settings = settings
        self.urls = [u.rstrip("/") for u in settings.urls]
        self._next_start = cycle(range(len(self.urls)))
        self._lock = Lock()
        self.session = pooled_session(len(self.urls), settings.concurrency)

    def _first_server(self) -> int:
        with self._lock:
            return next(self._next_start)

    def get(self, path: str) -> Any:
        """GET from the first server that answers (all serve the same model); none answering is fatal."""
        reasons = []
        for base in self.urls:
            try:
                response = self.session.get(base + path, timeout=self.settings.timeout_s)
                response.raise_for_status()
                return orjson.loads(response.content)
            except Exception as err:  # any failure: try the next server, and report them all
                reasons.append(f"{base}{path}: {err}")
        raise EngineUnavailable(
            without_credentials("cannot reach any vLLM server:\n  " + "\n  ".join(reasons))
        )

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        """The parsed body of a successful POST, retried on transient failures within the deadline; requests
        start on the servers in turn, and each retry goes to the next server."""
        body = orjson.dumps(payload)
        attempts = self.settings.retries + 1
        deadline = time.monotonic() + (self.settings.deadline_s or self.settings.timeout_s * attempts)
        first = self._first_server()

        def attempt(tried: int) -> Any:
            return self._post_once(self.urls[(first + tried) % len(self.urls)] + path, body, deadline)

        return retried_request("vLLM", attempt, attempts, deadline)

    def _post_once(self, url: str, body: bytes, deadline: float) -> Any:
        response = post_json(self.session, url, body, self.settings.timeout_s, deadline)
        if response.status_code in RETRYABLE_STATUS:
            raise TransientRequestError(f"HTTP {response.status_code} from {url}")
        if response.status_code != 200:
            raise EngineError(
                f"vLLM rejected the request at {url}: HTTP {response.status_code} {_error_message(response)}"
            )
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError as err:
            raise TransientRequestError(f"cut-off or invalid JSON from {url}") from err

    def map(self, path: str, payloads: list[dict[str, Any]]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=self.settings.concurrency) as pool:
            return list(pool.map(lambda payload: self.post(path, payload), payloads))


def _error_message(response) -> str:
    """vLLM's ErrorResponse message (vllm/entrypoints/serve/engine/protocol.py:79-87), else the body."""
    try:
        return str(orjson.loads(response.content)["error"]["message"])[:300]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return response.text[:300]


def completion_request(model: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """A /v1/completions body for one token-id prompt, every sampling setting explicit."""
    greedy = params.temperature <= SAMPLING_EPSILON
    request: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": params.max_new_tokens,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "return_token_ids": True,
    }
    if not greedy:
        request["seed"] = params.seed
    if params.top_logprobs:
        request.update({"logprobs": params.top_logprobs, "return_tokens_as_token_ids": True})
    return request


def _token_id(key: str) -> int:
    if not key.startswith(TOKEN_ID_PREFIX):
        raise EngineError(
            f"top log-prob key {key!r} is not a token id: the server ignored return_tokens_as_token_ids"
        )
    return int(key[len(TOKEN_ID_PREFIX) :])


def parse_top_logprobs(logprobs: dict[str, Any] | None, steps: int, k: int) -> list[list[list[float]]]:
    """Per generated token, its top-k [token id, log-prob], best first (the sampled token, which vLLM adds
    to every step, is dropped when it ranks below k)."""
    rows = (logprobs or {}).get("top_logprobs")
    if rows is None or len(rows) != steps or any(row is None or len(row) < k for row in rows):
        raise EngineError(f"the response's top log-probs do not cover its {steps} tokens with {k} each")
    return [
        [[_token_id(key), value] for key, value in sorted(row.items(), key=lambda item: -item[1])[:k]]
        for row in rows
    ]


def parse_completion(body: dict[str, Any], top_logprobs: int) -> Generation:
    """One /v1/completions response as a Generation."""
    try:
        choice = body["choices"][0]
        finish = choice["finish_reason"]
        token_ids = choice["token_ids"]
    except (KeyError, IndexError, TypeError) as err:
        raise EngineError(f"unexpected /v1/completions response: missing {err}") from err
    if token_ids is None:
        raise EngineError(
            "the response has no token_ids: the server ignored return_token_ids (vLLM < 0.10.2?)"
        )
    if finish not in ("stop", "length"):
        raise EngineError(f"vLLM did not finish the completion: finish_reason {finish!r}")
    output_ids = [int(t) for t in token_ids]
    top = parse_top_logprobs(choice.get("logprobs"), len(output_ids), top_logprobs) if top_logprobs else None
    return Generation(output_ids, finish, top)


class VllmServerEngine:
    """The GenerationEngine protocol over vLLM's OpenAI-compatible servers."""

    name = "vllm"

    def __init__(self, settings: VllmServerClientConfig):
        self.client = OpenAIClient(settings)
        self.model = settings.model or self._served_model()
        self.version = f"vllm-{self.client.get('/version').get('version', 'unknown')}"

    def _served_model(self) -> str:
        models = self.client.get("/v1/models").get("data") or []
        if not models:
            raise EngineError(f"vLLM at {self.client.urls} serves no model (/v1/models is empty)")
        return str(models[0]["id"])

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        payloads = [completion_request(self.model, prompt, params) for prompt in prompts]
        return [
            parse_completion(body, params.top_logprobs)
            for body in self.client.map("/v1/completions", payloads)
        ]
