"""SGLang over HTTP: generation through /generate, hidden-state capture through its documented options.

Coded to ../shared/reference/sglang-contract.md (SGLang 0.5.23):
- generation: POST /generate {"input_ids", "sampling_params"} -> {"output_ids", "meta_info": {"finish_reason"}}
- aux capture: a server started with --enable-return-hidden-states --enable-return-aux-hidden-states
  (and --disable-radix-cache --chunked-prefill-size -1) returns meta_info["hidden_states"][0] = the
  prompt block [P, 3H] of aux states, ascending layer order.
- teacher: a server started with --enable-return-hidden-states only returns the post-final-norm last
  hidden state [P, H] the same way (aux and last-layer states never come in one response).
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import cycle
from threading import Lock
from typing import Any

import numpy as np
import orjson
import torch

from pipeline.config import SGLangClientConfig
from pipeline.engines import Capture, EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class SGLangClient:
    """Posts JSON to several servers with bounded concurrency, retries with backoff and a deadline."""

    def __init__(self, settings: SGLangClientConfig, urls: list[str] | None = None):
        import requests

        self.settings = settings
        self.urls = [u.rstrip("/") for u in (urls or settings.urls)]
        self._next_url = cycle(self.urls)
        self._lock = Lock()
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=len(self.urls),
                                                pool_maxsize=max(4, settings.concurrency))
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def _url(self) -> str:
        with self._lock:
            return next(self._next_url)

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        import requests

        body = orjson.dumps(payload)
        last_error = "no attempt made"
        for attempt in range(self.settings.retries + 1):
            url = self._url() + path
            try:
                response = self.session.post(url, data=body, headers={"Content-Type": "application/json"},
                                             timeout=self.settings.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as err:
                last_error = f"{type(err).__name__} from {url}"
            else:
                if response.status_code == 200:
                    try:
                        return orjson.loads(response.content)
                    except orjson.JSONDecodeError:
                        last_error = f"truncated or invalid JSON from {url}"
                elif response.status_code in RETRYABLE_STATUS:
                    last_error = f"HTTP {response.status_code} from {url}"
                else:
                    raise EngineError(f"SGLang rejected the request at {url}: HTTP {response.status_code} "
                                      f"{_error_message(response)}")
            if attempt < self.settings.retries:
                delay = min(30.0, 0.5 * 2 ** attempt) * (0.5 + random.random())
                log.warning("SGLang request failed (%s); retry %d in %.1fs", last_error, attempt + 1, delay)
                time.sleep(delay)
        raise EngineError(f"SGLang request failed after {self.settings.retries + 1} attempts: {last_error}")

    def get(self, path: str) -> Any:
        response = self.session.get(self._url() + path, timeout=self.settings.timeout_s)
        response.raise_for_status()
        return orjson.loads(response.content)

    def map(self, path: str, payloads: list[dict[str, Any]]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=self.settings.concurrency) as pool:
            return list(pool.map(lambda p: self.post(path, p), payloads))


def _error_message(response) -> str:
    try:
        return str(orjson.loads(response.content).get("error", {}).get("message", ""))[:300]
    except (orjson.JSONDecodeError, AttributeError):
        return response.text[:300]


def parse_generation(payload: dict[str, Any]) -> Generation:
    try:
        output_ids = [int(t) for t in payload["output_ids"]]
        finish = payload["meta_info"]["finish_reason"]
    except (KeyError, TypeError, ValueError) as err:
        raise EngineError(f"unexpected /generate response: missing {err}") from err
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        raise EngineError(f"SGLang aborted the request: {finish}")
    matched = finish.get("matched") if isinstance(finish, dict) else None
    if kind == "stop" and isinstance(matched, int) and (not output_ids or output_ids[-1] != matched):
        # the stop token the target produced is part of what the drafter must learn to predict
        output_ids.append(matched)
    return Generation(output_ids, "stop" if kind == "stop" else "length")


def parse_prompt_states(payload: dict[str, Any], length: int, width: int) -> torch.Tensor:
    """The prompt block of meta_info["hidden_states"] as a [length, width] float32 tensor."""
    try:
        block = payload["meta_info"]["hidden_states"][0]
    except (KeyError, IndexError, TypeError) as err:
        raise EngineError("response has no hidden_states; start the server with --enable-return-hidden-states") from err
    array = np.asarray(block, dtype=np.float32)
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.shape != (length, width):
        raise EngineError(f"hidden state block has shape {array.shape}, expected {(length, width)}: prompt rows "
                          "go missing with radix-cache hits or chunked prefill (use --disable-radix-cache "
                          "--chunked-prefill-size -1)")
    return torch.from_numpy(array)


class SGLangEngine:
    """Generation and capture against SGLang servers."""

    name = "sglang"

    def __init__(self, settings: SGLangClientConfig, hidden_size: int | None = None):
        self.settings = settings
        self.client = SGLangClient(settings)
        self.teacher_client = SGLangClient(settings, settings.last_hidden_urls) if settings.last_hidden_urls else None
        self.hidden_size = hidden_size
        self.version = self._server_version()

    def _server_version(self) -> str:
        try:
            info = self.client.get("/server_info")
        except Exception as err:  # any failure to reach the server is fatal here, with its reason
            raise EngineError(f"cannot reach SGLang at {self.client.urls[0]}: {err}") from err
        return f"sglang-{info.get('version', 'unknown')}"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature}
        payloads = [{"input_ids": p, "sampling_params": sampling} for p in prompts]
        return [parse_generation(r) for r in self.client.map("/generate", payloads)]

    def capture(self, sequences: list[list[int]], aux_layer_ids: list[int]) -> list[Capture]:
        if self.teacher_client is None or self.hidden_size is None:
            raise EngineError("SGLang capture needs capture.sglang.last_hidden_urls (a server without aux states) "
                              "for the teacher signal, and the target's hidden size")
        payloads = [{"input_ids": s, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                     "return_hidden_states": True} for s in sequences]
        aux = self.client.map("/generate", payloads)
        last = self.teacher_client.map("/generate", payloads)
        return [Capture(parse_prompt_states(a, len(s), 3 * self.hidden_size),
                        parse_prompt_states(t, len(s), self.hidden_size))
                for a, t, s in zip(aux, last, sequences)]
