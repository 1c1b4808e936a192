"""The one retry policy for what the pipeline's clients do not retry by themselves, on tenacity.

botocore's standard retries cover S3 requests (pipeline.storage); this covers the rest: SGLang requests
(timeouts, dropped connections, 5xx, truncated bodies), S3 bodies cut off mid-read and verified reads that
meet a stale copy, and servers polled until their /health answers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from tenacity import RetryCallState, Retrying, retry_if_exception_type, retry_if_result


def retrying(
    attempts: int,
    retry_on: type[BaseException] | tuple[type[BaseException], ...],
    *,
    first_pause_s: float,
    max_pause_s: float,
    jitter: bool = False,
    deadline: float | None = None,
    note: Callable[[BaseException, int, float], object] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Retrying:
    """Call with `retrying(...)(function, *args)`: up to `attempts` calls while `function` raises one of
    `retry_on`; any other error, and the last one once attempts or time run out, is raised as it is.

    The pause doubles from `first_pause_s` up to `max_pause_s`, never reaches past `deadline` (a `clock()`
    value, time.monotonic's by default; no attempt is scheduled after it, though a pause may overshoot by the
    OS's timer slack) and, with `jitter`, is scaled by 0.5 to 1.5 so that clients failing together do not
    retry together. `note(error, retry_number, pause_s)` runs before each pause (for the log line); the
    pauses are `sleep`'s."""

    def pause(state: RetryCallState) -> float:
        seconds = min(max_pause_s, first_pause_s * 2 ** (state.attempt_number - 1))
        if deadline is not None:
            seconds = min(seconds, max(0.0, deadline - clock()))
        return seconds * (0.5 + random.random()) if jitter else seconds

    def stop(state: RetryCallState) -> bool:
        if state.attempt_number >= attempts:
            return True
        return deadline is not None and clock() + (state.upcoming_sleep or 0.0) >= deadline

    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        if note is not None and error is not None:
            note(error, state.attempt_number, state.upcoming_sleep)

    return Retrying(
        retry=retry_if_exception_type(retry_on),
        stop=stop,
        wait=pause,
        before_sleep=before_sleep,
        reraise=True,
        sleep=sleep,
    )


def poll_until(
    ready: Callable[[], bool],
    timeout_s: float,
    poll_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Call `ready()` every `poll_s` until it is true (True) or `timeout_s` has passed on `clock` (False).
    An error `ready()` raises ends the wait at once."""
    deadline = clock() + timeout_s
    poller = Retrying(
        retry=retry_if_result(lambda done: not done),
        stop=lambda state: clock() >= deadline,
        wait=lambda state: min(poll_s, max(0.0, deadline - clock())),
        retry_error_callback=lambda state: False,
        sleep=sleep,
    )
    return bool(poller(ready))


# SGLang 0.5.23 answers /health after a one-token generation through its scheduler: never in under a
# second, 503 after its SGLANG_HEALTH_CHECK_TIMEOUT of 20 s (srt/entrypoints/http_server.py:218, 778-799)
HEALTH_ANSWER_TIMEOUT_S = 30.0


def answers_health(url: str, timeout_s: float = HEALTH_ANSWER_TIMEOUT_S) -> bool:
    """Whether GET <url>/health answers 200 now; no answer (refused, timed out) is a no."""
    import requests

    try:
        return requests.get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


def await_health(
    url: str,
    timeout_s: float,
    gone: Callable[[], object] = lambda: None,
    poll_s: float = 1.0,
    request_timeout_s: float = HEALTH_ANSWER_TIMEOUT_S,
) -> bool:
    """Poll <url>/health until it answers 200 (True) or `timeout_s` has passed (False). `gone()` runs
    before each poll and raises when the server will never answer (its process exited)."""

    def healthy() -> bool:
        gone()
        return answers_health(url, request_timeout_s)

    return poll_until(healthy, timeout_s, poll_s)
