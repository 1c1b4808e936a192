"""The one retry policy (pipeline.retrying, on tenacity): what is retried, how often, within which deadline,
and the polling of servers until they answer."""

import pytest

from pipeline.retrying import await_health


def test_a_server_that_is_gone_ends_the_wait_for_its_health_at_once():
    checked = []

    def gone() -> None:
        checked.append(True)
        raise RuntimeError("the server exited with code 1")

    with pytest.raises(RuntimeError, match="exited"):
        await_health("http://127.0.0.1:9", timeout_s=30, gone=gone)
    assert checked == [True]  # the first poll found it gone: no second poll, no wait
    assert not await_health("http://127.0.0.1:9", timeout_s=0.3, poll_s=0.1, request_timeout_s=0.1)
