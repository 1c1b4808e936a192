"""The stand-in's modelled device clock (SGLANG_STANDIN_DEVICE_CLOCK): a request takes at least its
forwards' modelled time, whatever this machine's load, and a setting it cannot read stops it."""

import pytest

from harness.sglang_standin import DEVICE_CLOCK_ENV, DeviceClock


class FakeTime:
    def __init__(self, at: float):
        self.at, self.slept = at, []

    def now(self) -> float:
        return self.at

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.at += seconds


def test_the_setting_is_read_in_milliseconds():
    clock = DeviceClock.from_environment({DEVICE_CLOCK_ENV: "forward_ms=20, draft_ms=2.5"})
    assert clock is not None and (clock.forward_s, clock.draft_s) == (0.02, 0.0025)
    assert DeviceClock.from_environment({}) is None
    assert DeviceClock.from_environment({DEVICE_CLOCK_ENV: ""}) is None


@pytest.mark.parametrize(
    "value",
    [
        "forward_ms=20",
        "forward_ms=20,draft_ms=x",
        "forward_ms=0,draft_ms=1",
        "forward_ms=20,draft_ms=-1",
        "forward_ms=20,draft_ms=1,forward_ms=3",
        "forward=20,draft_ms=1",
        "20,1",
    ],
)
def test_a_setting_it_cannot_read_stops_the_server(value):
    with pytest.raises(SystemExit, match=DEVICE_CLOCK_ENV):
        DeviceClock.from_environment({DEVICE_CLOCK_ENV: value})


def test_a_request_is_held_to_its_forwards_modelled_time():
    fake = FakeTime(100.0)
    clock = DeviceClock(0.02, 0.004, now=fake.now, sleep=fake.sleep)
    fake.at = 100.05  # the CPU took 50 ms
    clock.hold(100.0, target_forwards=9, draft_steps=24)  # 180 ms + 96 ms modelled
    assert fake.at == pytest.approx(100.276) and len(fake.slept) == 1


def test_a_request_the_cpu_made_slower_than_modelled_is_not_held():
    fake = FakeTime(101.0)
    clock = DeviceClock(0.02, 0.0, now=fake.now, sleep=fake.sleep)
    clock.hold(100.0, target_forwards=10, draft_steps=0)
    assert fake.slept == []
