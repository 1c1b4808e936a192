"""SGLang over HTTP: generation through /generate, hidden-state capture through its documented options.

Coded to ../shared/reference/sglang-contract.md (SGLang 0.5.23):
- generation: POST /generate {"input_ids", "sampling_params"}
  -> {"output_ids", "meta_info": {"finish_reason"}}
- aux capture: a server started with --enable-return-hidden-states --enable-return-aux-hidden-states
  (and --disable-radix-cache --chunked-prefill-size -1) returns meta_info["hidden_states"][0] = the
  prompt block [P, 3H] of aux states, ascending layer order.
- teacher: top-K log-probs come in the same response (return_logprob, logprob_start_len 0,
  top_logprobs_num K); a post-final-norm last hidden state [P, H] needs a second server started
  with --enable-return-hidden-states only (aux and last-layer states never come in one response).
Facts read from the 0.5.23 wheel: output_ids include the stop token; input_top_logprobs has P
entries, the first null; prompt log-probs are a temperature-1 log-softmax of the raw logits.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import cycle
from threading import Lock
from typing import Any

import numpy as np
import orjson
import torch

from pipeline.config import SGLangClientConfig
from pipeline.engines import (
    DEFAULT_TEACHER,
    RETRYABLE_STATUS,
    Capture,
    EngineError,
    Generation,
    SamplingParams,
    TeacherRequest,
    TransientRequestError,
    pooled_session,
    retried_request,
)
from pipeline.engines.layer_ids import (
    LayerIdsInexpressible,
    ModelFamily,
    captured_layer_outputs,
    draft_config_ids,
)

log = logging.getLogger(__name__)
# The one SGLang version captures and serving run on (layer-id semantics changed between releases);
# docker/sglang.Dockerfile installs exactly this one.
SGLANG_VERSION = "0.5.23"


class SGLangClient:
    """Posts JSON to several servers with bounded concurrency, retries with backoff and a deadline."""

    def __init__(self, settings: SGLangClientConfig, urls: list[str] | None = None):
        self.settings = settings
        self.urls = [u.rstrip("/") for u in (urls or settings.urls)]
        self._next_url = cycle(self.urls)
        self._lock = Lock()
        self.session = pooled_session(len(self.urls), settings.concurrency)

    def _url(self) -> str:
        with self._lock:
            return next(self._next_url)

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        return orjson.loads(self.post_raw(path, payload))

    def post_raw(self, path: str, payload: dict[str, Any]) -> bytes:
        """The response body of a successful POST, retried on timeouts, connection errors, 5xx and
        truncated bodies (with backoff, within the request's deadline); other errors are not retried."""
        body = orjson.dumps(payload)
        attempts = self.settings.retries + 1
        deadline = time.monotonic() + (self.settings.deadline_s or self.settings.timeout_s * attempts)
        return retried_request("SGLang", lambda _: self._post_once(path, body, deadline), attempts, deadline)

    def _post_once(self, path: str, body: bytes, deadline: float) -> bytes:
        import requests

        url = self._url() + path
        try:
            response = self.session.post(
                url,
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=min(self.settings.timeout_s, max(deadline - time.monotonic(), 0.01)),
            )
        except (requests.ConnectionError, requests.Timeout) as err:
            raise TransientRequestError(f"{type(err).__name__} from {url}") from err
        if response.status_code == 200:
            if _complete_json(response.content):
                return response.content
            raise TransientRequestError(f"truncated or invalid JSON from {url}")
        if response.status_code in RETRYABLE_STATUS:
            raise TransientRequestError(f"HTTP {response.status_code} from {url}")
        raise EngineError(
            f"SGLang rejected the request at {url}: HTTP {response.status_code} {_error_message(response)}"
        )

    def get(self, path: str) -> Any:
        return self.get_from(self._url(), path)

    def get_from(self, url: str, path: str) -> Any:
        response = self.session.get(url.rstrip("/") + path, timeout=self.settings.timeout_s)
        response.raise_for_status()
        return orjson.loads(response.content)

    def map(self, path: str, payloads: list[dict[str, Any]], raw: bool = False) -> list[Any]:
        send = self.post_raw if raw else self.post
        with ThreadPoolExecutor(max_workers=self.settings.concurrency) as pool:
            return list(pool.map(lambda p: send(path, p), payloads))


def _complete_json(body: bytes) -> bool:
    """A cheap completeness check for large bodies: a JSON object or list that is closed."""
    stripped = body.strip()
    if len(stripped) < (1 << 20):
        try:
            orjson.loads(stripped)
            return True
        except orjson.JSONDecodeError:
            return False
    return stripped[:1] in (b"{", b"[") and stripped[-1:] in (b"}", b"]")


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
    top = payload["meta_info"].get("output_top_logprobs")
    if top is not None:  # entries are [logprob, token_id, text]; kept as [token_id, logprob]
        top = [[[int(entry[1]), entry[0]] for entry in step] for step in top[: len(output_ids)]]
    return Generation(output_ids, "stop" if kind == "stop" else "length", top)


_CHUNK_BYTES = 8 << 20


def _parse_rows(rows: bytes) -> np.ndarray:
    """b"[a,b],[c,d],..." -> flat float32, a few MB of JSON at a time (bounded transient memory)."""
    parts, begin = [], 0
    while begin < len(rows):
        cut = rows.find(b"],[", begin + _CHUNK_BYTES)
        stop = len(rows) if cut < 0 else cut + 1
        parts.append(np.asarray(orjson.loads(b"[" + rows[begin:stop] + b"]"), dtype=np.float32).ravel())
        begin = stop + 1
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def split_hidden_states(raw: bytes) -> tuple[bytes, np.ndarray | None]:
    """Cut meta_info["hidden_states"] out of a raw response; parse its prompt block to numpy.

    The block is [P][width] JSON floats (~21,504 per token for Kimi-K2.5): it is parsed in slices so a
    request never holds all its numbers as Python floats at once, and the rest of the response (now
    small) is parsed as usual. Returns the response with hidden_states set to null, and the prompt
    block as a flat float32 array (None when the response has no hidden states).
    """
    key = raw.find(b'"hidden_states":')
    if key < 0:
        return raw, None
    start = key + len(b'"hidden_states":')
    while raw[start : start + 1] in (b" ", b"\n"):
        start += 1
    if raw[start : start + 1] != b"[":
        return raw, None
    block_end = raw.find(b"]]", start) + 2  # the prompt block "[[..],..,[..]]" closes with the first "]]"
    if block_end < 2:
        raise EngineError("truncated hidden_states in the SGLang response")
    # decode-step rows, if any, follow as ",[..]" and the list closes with the next "]]"
    value_end = block_end if raw[block_end : block_end + 1] == b"]" else raw.find(b"]]", block_end) + 1
    values = _parse_rows(raw[start + 2 : block_end - 1])
    return raw[:start] + b"null" + raw[value_end + 1 :], values


def prompt_states(values: np.ndarray | None, length: int, width: int) -> torch.Tensor:
    """The prompt block as a [length, width] float32 tensor, refusing blocks with missing rows."""
    if values is None:
        raise EngineError(
            "response has no hidden_states; start the server with --enable-return-hidden-states"
        )
    if values.size != length * width:
        raise EngineError(
            f"hidden state block has {values.size} numbers, expected {length} x {width}: prompt rows "
            "go missing with radix-cache hits or chunked prefill (use --disable-radix-cache "
            "--chunked-prefill-size -1)"
        )
    return torch.from_numpy(values.reshape(length, width))


def parse_topk(meta: dict[str, Any], length: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K teacher rows for every position of a `max_new_tokens: 1` request with logprob_start_len 0.

    input_top_logprobs[i] (i >= 1) is the distribution at position i - 1 predicting token i; entry 0
    is null. The last position's distribution is output_top_logprobs[0]. Entries are
    [logprob, token_id, text] sorted by logprob, from a temperature-1 log-softmax of the raw logits.
    """
    try:
        rows = list(meta["input_top_logprobs"][1:]) + [meta["output_top_logprobs"][0]]
    except (KeyError, IndexError, TypeError) as err:
        raise EngineError(
            "response has no top log-probs; request return_logprob with top_logprobs_num"
        ) from err
    if len(rows) != length or any(row is None or len(row) != k for row in rows):
        raise EngineError(f"top log-probs cover {len(rows)} positions, expected {length} rows of {k}")
    ids = torch.tensor([[int(entry[1]) for entry in row] for row in rows], dtype=torch.long)
    logprobs = torch.tensor(
        [[float("nan") if entry[0] is None else float(entry[0]) for entry in row] for row in rows],
        dtype=torch.float32,
    )
    return ids, logprobs


def capture_server_flag(aux_layer_ids: list[int], family: ModelFamily, num_layers: int) -> str:
    """The launch flag that makes an SGLang capture server capture these layer outputs (project ids)."""
    try:
        ids = draft_config_ids("sglang", family, aux_layer_ids, num_layers)
    except LayerIdsInexpressible as err:
        return f"no --return-aux-hidden-state-layer-ids ({err.why})"
    return "--return-aux-hidden-state-layer-ids " + " ".join(str(k) for k in ids)


def capture_server_problems(
    info: dict[str, Any],
    aux_layer_ids: list[int] | None,
    num_layers: int,
    max_length: int,
    aux_server: bool,
    prompt_logprobs: bool,
    family: ModelFamily = "llama",
) -> list[str]:
    """What in a server's /server_info makes it unfit to capture under this contract.

    Keys are SGLang 0.5.23's resolved server args. The server's --return-aux-hidden-state-layer-ids are
    read the way SGLang reads them for the target's model family (pipeline.engines.layer_ids); with no
    ids an aux server captures the EAGLE3 default layers, the outputs of [1, N//2 - 1, N - 4].
    """
    problems = []
    version = str(info.get("version", ""))
    if version.split("-")[0] != SGLANG_VERSION:
        problems.append(
            f"the server runs SGLang {version or '(unreported)'}; captures are coded to {SGLANG_VERSION}"
        )

    def setting(key):
        if key not in info:
            problems.append(f"{key} is not reported by /server_info, so it cannot be verified")
        return info.get(key)

    if setting("enable_return_hidden_states") is not True and not info.get("enable_return_aux_hidden_states"):
        problems.append("the server was not started with --enable-return-hidden-states")
    wants_aux = setting("enable_return_aux_hidden_states")
    if wants_aux is not None and bool(wants_aux) != aux_server:
        problems.append(
            "an aux-state server needs --enable-return-aux-hidden-states"
            if aux_server
            else "a last-hidden server must not run with --enable-return-aux-hidden-states"
        )
    if aux_server and wants_aux:
        flag_ids = info.get("return_aux_hidden_state_layer_ids") or None
        served = captured_layer_outputs("sglang", family, flag_ids, num_layers)
        if served != list(aux_layer_ids or []):
            problems.append(
                f"the server captures aux layers {served} (--return-aux-hidden-state-layer-ids "
                f"{flag_ids} on a {family}-family target), the contract says {aux_layer_ids}; "
                f"start it with {capture_server_flag(list(aux_layer_ids or []), family, num_layers)}"
            )
    if setting("disable_radix_cache") is not True and not prompt_logprobs:
        problems.append("prompt rows go missing on radix-cache hits: start with --disable-radix-cache")
    chunk = setting("chunked_prefill_size")
    if chunk is not None and chunk != -1 and chunk < max_length:
        problems.append(
            f"chunked_prefill_size {chunk} < capture.max_length {max_length}: use --chunked-prefill-size -1"
        )
    return problems


class SGLangEngine:
    """Generation and capture against SGLang servers."""

    name = "sglang"

    def __init__(self, settings: SGLangClientConfig, hidden_size: int | None = None):
        self.settings = settings
        self.client = SGLangClient(settings)
        self.teacher_client = (
            SGLangClient(settings, settings.last_hidden_urls) if settings.last_hidden_urls else None
        )
        self.hidden_size = hidden_size
        self.version = self._server_version()

    def _server_version(self) -> str:
        return f"sglang-{self._server_info(self.client, self.client.urls[0]).get('version', 'unknown')}"

    @staticmethod
    def _server_info(client: SGLangClient, url: str) -> dict[str, Any]:
        try:
            return client.get_from(url, "/server_info")
        except Exception as err:  # any failure to reach the server is fatal here, with its reason
            raise EngineError(f"cannot reach SGLang at {url}: {err}") from err

    def verify_capture_servers(
        self,
        aux_layer_ids: list[int],
        num_layers: int,
        max_length: int,
        teacher: TeacherRequest,
        *,
        family: ModelFamily,
    ) -> None:
        """Refuse to capture through servers whose settings disagree with the capture contract."""
        checks = [(url, self.client, True) for url in self.client.urls]
        if "last_hidden" in teacher.kinds and self.teacher_client is not None:
            checks += [(url, self.teacher_client, False) for url in self.teacher_client.urls]
        problems = []
        for url, client, aux_server in checks:
            info = self._server_info(client, url)
            prompt_logprobs = aux_server and "topk" in teacher.kinds
            problems += [
                f"{url}: {p}"
                for p in capture_server_problems(
                    info, aux_layer_ids, num_layers, max_length, aux_server, prompt_logprobs, family
                )
            ]
        if problems:
            raise EngineError(
                "SGLang capture servers disagree with the capture contract:\n  " + "\n  ".join(problems)
            )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature}
        extra = (
            {"return_logprob": True, "top_logprobs_num": params.top_logprobs} if params.top_logprobs else {}
        )
        payloads = [{"input_ids": p, "sampling_params": sampling, **extra} for p in prompts]
        return [parse_generation(r) for r in self.client.map("/generate", payloads)]

    def capture(
        self, sequences: list[list[int]], aux_layer_ids: list[int], teacher: TeacherRequest = DEFAULT_TEACHER
    ) -> list[Capture]:
        """Aux states (and top-K log-probs) from the aux-state servers; last hidden from the teacher servers.

        The aux layers are fixed when the aux servers start (--return-aux-hidden-state-layer-ids, SGLang's
        ids, which verify_capture_servers reads with the target family's rule); the capture contract records
        the layer outputs this pipeline asked for, and the parity check verifies them.
        """
        if self.hidden_size is None:
            raise EngineError("SGLang capture needs the target's hidden size")
        teacher_client = self._last_hidden_client(teacher)
        payloads = [self._capture_payload(s, teacher) for s in sequences]
        aux_responses = self.client.map("/generate", payloads, raw=True)
        captures = []
        for raw, sequence in zip(aux_responses, sequences, strict=True):
            rest, values = split_hidden_states(raw)
            capture = Capture(prompt_states(values, len(sequence), 3 * self.hidden_size))
            if "topk" in teacher.kinds:
                capture.topk_ids, capture.topk_logprobs = parse_topk(
                    orjson.loads(rest)["meta_info"], len(sequence), teacher.topk
                )
            captures.append(capture)
        if teacher_client is not None:
            plain = [{**p, "return_logprob": False} for p in payloads]
            for capture, raw, sequence in zip(
                captures, teacher_client.map("/generate", plain, raw=True), sequences, strict=True
            ):
                capture.last_hidden = prompt_states(
                    split_hidden_states(raw)[1], len(sequence), self.hidden_size
                )
        return captures

    def _last_hidden_client(self, teacher: TeacherRequest) -> SGLangClient | None:
        """The servers that return the last hidden state, when the teacher asks for it (else None)."""
        if "last_hidden" not in teacher.kinds:
            return None
        if self.teacher_client is None:
            raise EngineError(
                "a last_hidden teacher needs capture.sglang.last_hidden_urls (servers started "
                "without --enable-return-aux-hidden-states)"
            )
        return self.teacher_client

    @staticmethod
    def _capture_payload(sequence: list[int], teacher: TeacherRequest) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "input_ids": sequence,
            "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        if "topk" in teacher.kinds:
            payload.update({"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": teacher.topk})
        return payload
