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
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from pipeline.credentials import without_credentials
from pipeline.data.spilled_rows import SpilledRows
from pipeline.engine_settings import SGLangClientConfig
from pipeline.engines import (
    DEFAULT_TEACHER,
    Capture,
    EngineError,
    Generation,
    SamplingParams,
    TeacherRequest,
)
from pipeline.engines.layer_ids import (
    LayerIdsInexpressible,
    ModelFamily,
    captured_layer_outputs,
    draft_config_ids,
)
from pipeline.sglang_transport import CaptureWorkers, SGLangClient, SpilledResponse

log = logging.getLogger(__name__)
# The one SGLang version captures and serving run on (layer-id semantics changed between releases);
# docker/sglang.Dockerfile installs exactly this one.
SGLANG_VERSION = "0.5.23"


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


def _missing_rows(values: int | None, length: int, width: int) -> str | None:
    if values is None:
        return "response has no hidden_states; start the server with --enable-return-hidden-states"
    if values != length * width:
        return (
            f"hidden state block has {values} numbers, expected {length} x {width}: prompt rows "
            "go missing with radix-cache hits or chunked prefill (use --disable-radix-cache "
            "--chunked-prefill-size -1)"
        )
    return None


def prompt_states(values: np.ndarray | None, length: int, width: int) -> torch.Tensor:
    """The prompt block as a [length, width] float32 tensor, refusing blocks with missing rows."""
    if problem := _missing_rows(None if values is None else values.size, length, width):
        raise EngineError(problem)
    assert values is not None
    return torch.from_numpy(values.reshape(length, width))


def spilled_states(reply: SpilledResponse, spill_path: Path, length: int, width: int) -> SpilledRows:
    """The prompt block a capture worker wrote to spill_path; one with missing rows is refused and removed."""
    if problem := _missing_rows(reply.values, length, width):
        spill_path.unlink(missing_ok=True)
        raise EngineError(problem)
    return SpilledRows(spill_path, length, width)


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

    def __init__(
        self, settings: SGLangClientConfig, hidden_size: int | None = None, spill_dir: Path | None = None
    ):
        self.settings = settings
        self.client = SGLangClient(settings)
        self.teacher_client = (
            SGLangClient(settings, settings.last_hidden_urls) if settings.last_hidden_urls else None
        )
        self.hidden_size = hidden_size
        self.spill_dir = Path(spill_dir or tempfile.gettempdir())
        self._workers: CaptureWorkers | None = None
        self.received_bytes = 0  # response bodies of capture requests, hidden states included
        self.worker_peak_rss_mib = 0.0  # the largest capture worker's peak resident memory
        self.version = self._server_version()

    def close(self) -> None:
        """Stop the capture worker processes, if any were started."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def _server_version(self) -> str:
        return f"sglang-{self._server_info(self.client, self.client.urls[0]).get('version', 'unknown')}"

    @staticmethod
    def _server_info(client: SGLangClient, url: str) -> dict[str, Any]:
        try:
            return client.get_from(url, "/server_info")
        except Exception as err:  # any failure to reach the server is fatal here, with its reason
            raise EngineError(without_credentials(f"cannot reach SGLang at {url}: {err}")) from err

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

        Each request runs in a capture worker process that streams its response's hidden states to a spill
        file (pipeline.sglang_transport), so the states come back as SpilledRows, which the caller reads
        a chunk at a time and discards. The aux layers are fixed when the aux servers start
        (--return-aux-hidden-state-layer-ids, SGLang's ids, which verify_capture_servers reads with the
        target family's rule); the capture contract records the layer outputs this pipeline asked for, and
        the parity check verifies them.
        """
        if self.hidden_size is None:
            raise EngineError("SGLang capture needs the target's hidden size")
        teacher_client = self._last_hidden_client(teacher)
        payloads = [self._capture_payload(s, teacher) for s in sequences]
        captures: list[Capture] = []
        spilled: list[Path] = []  # every spill file of this call, removed if the call fails
        try:
            replies = self._spilled(self.client, payloads, spilled)
            for reply, path, sequence in replies:
                capture = Capture(spilled_states(reply, path, len(sequence), 3 * self.hidden_size))
                captures.append(capture)
                if "topk" in teacher.kinds:
                    capture.topk_ids, capture.topk_logprobs = parse_topk(
                        orjson.loads(reply.rest)["meta_info"], len(sequence), teacher.topk
                    )
            if teacher_client is not None:
                plain = [{**p, "return_logprob": False} for p in payloads]
                for capture, (reply, path, sequence) in zip(
                    captures, self._spilled(teacher_client, plain, spilled), strict=True
                ):
                    capture.last_hidden = spilled_states(reply, path, len(sequence), self.hidden_size)
        except BaseException:
            for path in spilled:
                path.unlink(missing_ok=True)
                Path(f"{path}.rest").unlink(missing_ok=True)
            raise
        return captures

    def _spilled(
        self, client: SGLangClient, payloads: list[dict[str, Any]], spilled: list[Path]
    ) -> list[tuple[SpilledResponse, Path, list[int]]]:
        """Post every payload through the capture workers; each reply with its spill file and sequence.
        The spill files are added to `spilled` before any is written."""
        if self._workers is None:
            self._workers = CaptureWorkers(self.settings, self.settings.concurrency)
        paths = [self.spill_dir / f"sglang-capture-{uuid.uuid4().hex}.f32" for _ in payloads]
        spilled += paths
        replies = self._workers.capture(client.urls, payloads, [str(p) for p in paths])
        self.received_bytes += sum(r.received_bytes for r in replies)
        self.worker_peak_rss_mib = max([self.worker_peak_rss_mib, *(r.worker_peak_rss_mib for r in replies)])
        return [(r, p, payload["input_ids"]) for r, p, payload in zip(replies, paths, payloads, strict=True)]

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
