"""The one retry policy (pipeline.retrying, on tenacity): what is retried, how often, within which deadline,
and polling until ready, on a clock that moves only when the policy sleeps (no test here waits or times
anything). A server that is gone: tests/integration/test_retrying.py."""

import random

import pytest

from pipeline.retrying import poll_until, retrying


class Clock:
    """time.monotonic and time.sleep for the policy: sleeping moves the clock, nothing else does."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


class Flaky(Exception):
    pass


def failing(times: int, clock: Clock, error: type[Exception] = Flaky):
    calls = []

    def call() -> str:
        calls.append(clock())
        if len(calls) <= times:
            raise error(f"failure {len(calls)}")
        return "done"

    return call, calls


def test_retried_errors_are_retried_with_doubling_pauses_and_noted():
    clock = Clock()
    call, calls = failing(2, clock)
    notes = []
    policy = retrying(
        3,
        Flaky,
        first_pause_s=0.05,
        max_pause_s=1.0,
        note=lambda e, n, s: notes.append((str(e), n, s)),
        clock=clock,
        sleep=clock.sleep,
    )
    assert policy(call) == "done" and len(calls) == 3
    assert notes == [("failure 1", 1, 0.05), ("failure 2", 2, 0.1)]
    assert clock.pauses == [0.05, 0.1] and calls[2] - calls[1] == pytest.approx(0.1)


def test_the_last_error_is_raised_as_it_is_and_other_errors_at_once():
    clock = Clock()
    call, calls = failing(5, clock)
    with pytest.raises(Flaky, match="failure 3"):
        retrying(3, Flaky, first_pause_s=0.0, max_pause_s=0.0, clock=clock, sleep=clock.sleep)(call)
    assert len(calls) == 3
    call, calls = failing(5, clock, ValueError)
    with pytest.raises(ValueError, match="failure 1"):
        retrying(3, Flaky, first_pause_s=0.0, max_pause_s=0.0, clock=clock, sleep=clock.sleep)(call)
    assert len(calls) == 1


def test_no_attempt_starts_after_the_deadline_and_pauses_stay_under_the_cap():
    random.seed(3)  # the jitter's draws
    clock = Clock()
    call, calls = failing(100, clock)
    deadline = clock() + 0.6
    policy = retrying(
        100,
        Flaky,
        first_pause_s=0.05,
        max_pause_s=0.1,
        jitter=True,
        deadline=deadline,
        clock=clock,
        sleep=clock.sleep,
    )
    with pytest.raises(Flaky):
        policy(call)
    assert len(calls) > 4  # several retries fit before the deadline
    assert all(pause <= 0.1 * 1.5 for pause in clock.pauses)  # the cap, scaled by the jitter at most
    assert calls[-1] < deadline  # no attempt was scheduled past it


def test_polling_ends_when_ready_or_when_the_time_is_up():
    clock = Clock()
    answers = iter([False, False, True])
    assert poll_until(lambda: next(answers), timeout_s=5, poll_s=0.01, clock=clock, sleep=clock.sleep)
    assert clock.pauses == [0.01, 0.01]
    started = clock()
    assert not poll_until(lambda: False, timeout_s=0.2, poll_s=0.05, clock=clock, sleep=clock.sleep)
    assert clock() - started == pytest.approx(0.2)
