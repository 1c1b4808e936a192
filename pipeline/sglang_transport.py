"""SGLang over HTTP, the transport half: a client with retries, and aux hidden states parsed out of
/generate responses as they stream in, in worker processes.

An aux-state response carries 3 x hidden floats per prompt token as JSON (about 235 KB per token at
Kimi-K2.5's width, docs/BENCHMARKS.md). Parsing that under one GIL caps a capture client at a few hundred
tokens/s, and holding it whole needs gigabytes per long sample. So capture requests run in worker
processes (CaptureWorkers), each streaming its response body through HiddenStateStream: complete rows are
parsed a few MB at a time (numpy's C parser, not Python floats) and appended to a local float32 file,
while the rest of the response (small) is kept. A worker's memory is bounded by the parse chunk, whatever
the sample's length. This module does not import torch, so the workers start quickly and stay small.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import cycle
from pathlib import Path
from threading import Lock
from typing import Any, TypeVar

import numpy as np
import orjson

from pipeline.engine_requests import (
    RETRYABLE_STATUS,
    EngineError,
    EngineUnavailable,
    TransientRequestError,
    pooled_session,
    post_json,
    retried_request,
)
from pipeline.engine_settings import SGLangClientConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
PARSE_CHUNK_BYTES = 4 << 20  # JSON parsed at a time
_RECEIVE_BYTES = 1 << 20


class TruncatedResponse(Exception):
    """A response body that ended before its JSON did."""


class SGLangClient:
    """Posts JSON to several servers with bounded concurrency, retries with backoff and a deadline."""

    def __init__(self, settings: SGLangClientConfig, urls: list[str] | None = None, first_url: int = 0):
        self.settings = settings
        self.urls = [u.rstrip("/") for u in (urls or settings.urls)]
        start = first_url % len(self.urls)
        self._next_url = cycle(self.urls[start:] + self.urls[:start])
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
        return self.post_streamed(path, payload, _whole_body)

    def post_streamed(self, path: str, payload: dict[str, Any], consume: Callable[[Any], T]) -> T:
        """consume(response) of a successful POST whose body has not been read yet (it may stream it),
        retried as post_raw is; consume raises TransientRequestError for a body that breaks off."""
        body = orjson.dumps(payload)
        attempts = self.settings.retries + 1
        deadline = time.monotonic() + (self.settings.deadline_s or self.settings.timeout_s * attempts)
        return retried_request(
            "SGLang", lambda _: self._post_once(path, body, deadline, consume), attempts, deadline
        )

    def _post_once(self, path: str, body: bytes, deadline: float, consume: Callable[[Any], T]) -> T:
        import requests

        url = self._url() + path
        response = post_json(self.session, url, body, self.settings.timeout_s, deadline, stream=True)
        try:
            with response:
                if response.status_code == 200:
                    return consume(response)
                if response.status_code in RETRYABLE_STATUS:
                    raise TransientRequestError(f"HTTP {response.status_code} from {url}")
                status = f"HTTP {response.status_code} {_error_message(response)}"
                raise EngineError(f"SGLang rejected the request at {url}: {status}")
        except (requests.ConnectionError, requests.Timeout) as err:
            raise TransientRequestError(f"{type(err).__name__} from {url}") from err
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError) as err:
            raise TransientRequestError(f"the response from {url} broke off: {err}") from err
        except TruncatedResponse as err:
            raise TransientRequestError(f"{err} from {url}") from err

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


def _whole_body(response) -> bytes:
    content = response.content
    if not _complete_json(content):
        raise TruncatedResponse("truncated or invalid JSON")
    return content


_NUMBER_BYTES = b"0123456789.eE+-,[] \t\r\n"


def parse_rows(rows: bytes | bytearray) -> np.ndarray:
    """b"[a,b],[c,d],..." -> flat float32 [a, b, c, d, ...]. orjson reads the rows as doubles (the
    float32 or bf16 values SGLang wrote, exactly) at about 2.5x numpy's text parser. JSON's null (what
    SGLang's orjson writes for NaN) reads as NaN, so the sample is refused as non-finite downstream;
    anything else that is not a number (strings, true/false, nested or ragged rows) is an error."""
    if rows.translate(None, _NUMBER_BYTES).replace(b"null", b""):
        raise EngineError(f"hidden states that are not JSON numbers: {rows[:80]!r}...")
    if not rows.strip():
        return np.zeros(0, dtype=np.float32)
    try:
        return np.array(orjson.loads(b"[" + rows + b"]"), dtype=np.float32).ravel()
    except ValueError as err:  # orjson.JSONDecodeError is one; ragged rows are numpy's
        raise EngineError(f"hidden states that are not rows of JSON numbers: {rows[:80]!r}...") from err


HIDDEN_STATES_KEY = b'"hidden_states":'


class HiddenStateStream:
    """A /generate response body fed in pieces: the prompt block of meta_info["hidden_states"] (rows
    [P][width], first in the list; decode-step rows may follow) goes to `sink` as float32 arrays, a
    chunk of complete rows at a time; the rest of the body is kept, with hidden_states null.

    Assumes orjson's compact output (no spaces inside the rows), as SGLang writes its responses."""

    def __init__(self, sink: Callable[[np.ndarray], None], chunk_bytes: int = PARSE_CHUNK_BYTES):
        self.sink, self.chunk_bytes = sink, chunk_bytes
        self.state = "head"  # head -> rows -> after_block (-> decode_rows) -> tail
        self.pending = bytearray()  # appended to in place: pieces may be small
        self.kept: list[bytes | bytearray] = []
        self.values = 0
        self.received = 0
        self.found = False  # a prompt block "[[" was seen
        self.searched = 0  # how much of pending is known to hold no "]]" (in the rows)

    def feed(self, piece: bytes) -> None:
        self.received += len(piece)
        self.pending += piece
        while self._advance():
            pass

    def finish(self) -> tuple[bytes, int | None]:
        """The rest of the response and how many floats went to the sink (None: no hidden states)."""
        if self.state not in ("head", "tail"):
            raise TruncatedResponse("truncated hidden_states")
        return b"".join(self.kept) + self.pending, self.values if self.found else None

    def _advance(self) -> bool:
        """One step of the state machine; False when it needs more bytes."""
        return getattr(self, f"_in_{self.state}")()

    def _in_head(self) -> bool:
        key = self.pending.find(HIDDEN_STATES_KEY)
        if key < 0:
            keep = max(len(self.pending) - len(HIDDEN_STATES_KEY), 0)
            self.kept.append(self.pending[:keep])
            self.pending = self.pending[keep:]
            return False
        start = key + len(HIDDEN_STATES_KEY)
        while self.pending[start : start + 1] in (b" ", b"\n"):
            start += 1
        if len(self.pending) < start + 2:
            return False
        if self.pending[start : start + 2] != b"[[":  # null, or no prompt block: nothing to cut out
            self.kept.append(self.pending[:start])
            self.pending = self.pending[start:]
            self.state = "tail"
            return True
        self.kept.append(self.pending[:start] + b"null")
        self.pending = self.pending[start + 2 :]
        self.state, self.found = "rows", True
        return True

    def _in_rows(self) -> bool:
        # only the bytes not searched before (and the one before them): the block's rows arrive a piece
        # at a time, and searching the whole of pending again for each piece would read it many times
        end = self.pending.find(b"]]", max(self.searched - 1, 0))
        if end >= 0:  # the prompt block "[[..],..,[..]]" closes with the first "]]"
            self._parse(self.pending[: end + 1])
            self.pending = self.pending[end + 2 :]
            self.state, self.searched = "after_block", 0
            return True
        if len(self.pending) >= self.chunk_bytes:
            cut = self.pending.rfind(b"],[")
            if cut >= 0:
                self._parse(self.pending[: cut + 1])
                self.pending = self.pending[cut + 2 :]
        self.searched = len(self.pending)
        return False

    def _in_after_block(self) -> bool:
        if not self.pending:
            return False
        # "]": the list held only the prompt block; ",": decode-step rows "[..]" follow the block
        self.state = "tail" if self.pending[:1] == b"]" else "decode_rows"
        self.pending = self.pending[1:]
        return True

    def _in_decode_rows(self) -> bool:
        end = self.pending.find(b"]]")  # the last decode row and the list close together
        if end < 0:
            self.pending = self.pending[-1:]
            return False
        self.pending = self.pending[end + 2 :]
        self.state = "tail"
        return True

    def _in_tail(self) -> bool:
        return False

    def _parse(self, rows: bytes | bytearray) -> None:
        values = parse_rows(rows)
        self.values += values.size
        self.sink(values)


def split_hidden_states(raw: bytes) -> tuple[bytes, np.ndarray | None]:
    """Cut meta_info["hidden_states"] out of a whole response; parse its prompt block to numpy.

    Returns the response with hidden_states set to null, and the prompt block as a flat float32 array
    (None when the response has no hidden states)."""
    parts: list[np.ndarray] = []
    stream = HiddenStateStream(parts.append)
    stream.feed(raw)
    rest, count = stream.finish()
    if count is None:
        return rest, None
    return rest, np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class SpilledResponse:
    """What a capture worker hands back: the response without its hidden states, how many floats of the
    prompt block it wrote to the spill file (None: the response had none), the body's size, and the
    worker process's peak resident memory so far."""

    rest: bytes
    values: int | None
    received_bytes: int
    worker_peak_rss_mib: float = 0.0


def spill_response(response, spill_path: str) -> SpilledResponse:
    """Stream a response's body, writing its prompt block's floats to spill_path (raw float32)."""
    with open(spill_path, "wb") as spill:
        stream = HiddenStateStream(lambda values: values.tofile(spill))
        for piece in response.iter_content(_RECEIVE_BYTES):
            stream.feed(piece)
        rest, values = stream.finish()
    if not _complete_json(rest):
        raise TruncatedResponse("truncated or invalid JSON")
    return SpilledResponse(rest, values, stream.received)


def capture_request(
    clients: dict[tuple[str, ...], SGLangClient],
    settings: SGLangClientConfig,
    urls: list[str],
    payload: dict[str, Any],
    spill_path: str,
) -> SpilledResponse:
    """One capture request, its hidden states streamed to spill_path (what a worker process runs)."""
    client = clients.get(tuple(urls))
    if client is None:  # each worker starts its round robin at a server of its own
        client = clients[tuple(urls)] = SGLangClient(settings, urls, first_url=os.getpid())
    reply = client.post_streamed("/generate", payload, lambda r: spill_response(r, spill_path))
    return dataclasses.replace(reply, worker_peak_rss_mib=peak_rss_mib())


def peak_rss_mib() -> float:
    """This process's resident-memory high-water mark: VmHWM on Linux (ru_maxrss would carry over the
    RSS of the parent this worker was forked from before exec), else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# A worker process speaks JSON lines: the settings first, then one request per line ({"urls", "payload",
# "spill"}) answered by one line ({"values", "received_bytes", "worker_peak_rss_mib"} or {"error", "kind"});
# the response without its hidden states goes to the spill path + ".rest". Workers are plain subprocesses
# (`python -m pipeline.sglang_transport`), not multiprocessing's: a parent that is itself a script, as
# Airflow's pod tasks are, would be re-run by a spawned child.
_ERROR_KINDS = {"unavailable": EngineUnavailable, "engine": EngineError}


def worker_main() -> None:
    protocol = sys.stdout
    sys.stdout = sys.stderr  # whatever a library prints must not mix with the protocol's lines
    settings = SGLangClientConfig.model_validate_json(sys.stdin.readline())
    clients: dict[tuple[str, ...], SGLangClient] = {}
    for line in sys.stdin:
        request = orjson.loads(line)
        answer: dict[str, Any] = {"spill": request["spill"]}
        try:
            reply = capture_request(clients, settings, request["urls"], request["payload"], request["spill"])
            Path(request["spill"] + ".rest").write_bytes(reply.rest)
            answer.update({k: v for k, v in dataclasses.asdict(reply).items() if k != "rest"})
        except EngineUnavailable as err:
            answer.update(error=str(err), kind="unavailable")
        except EngineError as err:
            answer.update(error=str(err), kind="engine")
        except Exception as err:  # anything else ends up in the capture stage's error, with its type
            answer.update(error=f"{type(err).__name__}: {err}", kind="engine")
        protocol.write(orjson.dumps(answer).decode() + "\n")
        protocol.flush()


class _Worker:
    def __init__(self, settings: SGLangClientConfig):
        self.settings = settings
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.sglang_transport"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._send(settings.model_dump_json())

    def _send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def ask(self, urls: list[str], payload: dict[str, Any], spill_path: str) -> SpilledResponse:
        """The worker's answer to one request; EngineError when the worker broke (it is then unusable)."""
        try:
            self._send(orjson.dumps({"urls": urls, "payload": payload, "spill": spill_path}).decode())
            assert self.process.stdout is not None
            line = self.process.stdout.readline()
        except OSError as err:
            raise WorkerBroke(f"a capture worker stopped answering: {err}") from err
        if not line:
            raise WorkerBroke(f"a capture worker exited (code {self.process.poll()}) during a request")
        answer = orjson.loads(line)
        if answer.pop("spill", None) != spill_path:
            raise WorkerBroke(f"a capture worker answered another request than {spill_path}")
        if "error" in answer:
            raise _ERROR_KINDS[answer["kind"]](answer["error"])
        rest_path = Path(spill_path + ".rest")
        rest = rest_path.read_bytes()
        rest_path.unlink()
        return SpilledResponse(rest, **answer)

    def close(self) -> None:
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class WorkerBroke(EngineError):
    """A capture worker process that died or answered out of turn: it is replaced."""


class CaptureWorkers:
    """Worker processes that each post one capture request at a time and stream its response to a spill
    file: `processes` requests in flight, their parsing on as many cores. A worker that breaks is replaced."""

    def __init__(self, settings: SGLangClientConfig, processes: int):
        self.settings = settings
        self.lock = threading.Lock()
        self.workers: list[_Worker] = []
        try:
            for _ in range(processes):
                self.workers.append(_Worker(settings))
        except BaseException:
            self.close()
            raise
        self.idle: queue.Queue[_Worker] = queue.Queue()
        for worker in self.workers:
            self.idle.put(worker)

    def capture(
        self, urls: list[str], payloads: list[dict[str, Any]], spill_paths: list[str]
    ) -> list[SpilledResponse]:
        with ThreadPoolExecutor(max_workers=len(self.workers)) as pool:
            return list(pool.map(lambda job: self._one(urls, *job), zip(payloads, spill_paths, strict=True)))

    def _one(self, urls: list[str], payload: dict[str, Any], spill_path: str) -> SpilledResponse:
        worker = self.idle.get()
        try:
            return worker.ask(urls, payload, spill_path)
        except WorkerBroke:
            worker.process.kill()
            worker.close()
            worker = self._replacement(worker)
            raise
        finally:
            self.idle.put(worker)

    def _replacement(self, broken: _Worker) -> _Worker:
        fresh = _Worker(self.settings)
        with self.lock:
            self.workers[self.workers.index(broken)] = fresh
        return fresh

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


if __name__ == "__main__":
    worker_main()
