"""What every engine's HTTP client shares, without the engines' heavy imports (torch): the errors engines
raise, retries with backoff within a deadline, and pooled sessions. Light enough for the worker processes
that parse SGLang's capture responses (pipeline.sglang_transport)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

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


def post_json(session, url: str, body: bytes, timeout_s: float, deadline: float, stream: bool = False):
    """session.post of a JSON body, its timeout cut to what is left of the request's deadline; a timeout or
    a dropped connection is a TransientRequestError (retried by retried_request)."""
    import requests

    try:
        return session.post(
            url,
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=min(timeout_s, max(deadline - time.monotonic(), 0.01)),
            stream=stream,
        )
    except (requests.ConnectionError, requests.Timeout) as err:
        raise TransientRequestError(f"{type(err).__name__} from {url}") from err
