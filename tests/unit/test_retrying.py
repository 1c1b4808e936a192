"""The one retry policy (pipeline.retrying, on tenacity): what is retried, how often, within which deadline,
and polling until ready. A server that is gone: tests/integration/test_retrying.py."""

import time

import pytest

from pipeline.retrying import poll_until, retrying


class Flaky(Exception):
    pass


def failing(times: int, error: type[Exception] = Flaky):
    calls = []

    def call() -> str:
        calls.append(time.monotonic())
        if len(calls) <= times:
            raise error(f"failure {len(calls)}")
        return "done"

    return call, calls


def test_retried_errors_are_retried_with_doubling_pauses_and_noted():
    call, calls = failing(2)
    notes = []
    policy = retrying(
        3, Flaky, first_pause_s=0.05, max_pause_s=1.0, note=lambda e, n, s: notes.append((str(e), n, s))
    )
    assert policy(call) == "done" and len(calls) == 3
    assert notes == [("failure 1", 1, 0.05), ("failure 2", 2, 0.1)]
    assert calls[2] - calls[1] >= 0.1


def test_the_last_error_is_raised_as_it_is_and_other_errors_at_once():
    call, calls = failing(5)
    with pytest.raises(Flaky, match="failure 3"):
        retrying(3, Flaky, first_pause_s=0.0, max_pause_s=0.0)(call)
    assert len(calls) == 3
    call, calls = failing(5, ValueError)
    with pytest.raises(ValueError, match="failure 1"):
        retrying(3, Flaky, first_pause_s=0.0, max_pause_s=0.0)(call)
    assert len(calls) == 1


def test_no_attempt_starts_after_the_deadline_and_pauses_stay_under_the_cap():
    call, calls = failing(100)
    started = time.monotonic()
    with pytest.raises(Flaky):
        retrying(100, Flaky, first_pause_s=0.05, max_pause_s=0.1, jitter=True, deadline=started + 0.6)(call)
    assert time.monotonic() - started < 0.8
    assert all(later - earlier < 0.1 * 1.5 + 0.05 for earlier, later in zip(calls, calls[1:], strict=False))
    # no attempt was scheduled past the deadline; a loaded machine may wake from the last pause a little late
    assert calls[-1] < started + 0.6 + 0.02


def test_polling_ends_when_ready_or_when_the_time_is_up():
    answers = iter([False, False, True])
    assert poll_until(lambda: next(answers), timeout_s=5, poll_s=0.01)
    started = time.monotonic()
    assert not poll_until(lambda: False, timeout_s=0.2, poll_s=0.05)
    assert 0.2 <= time.monotonic() - started < 0.5
