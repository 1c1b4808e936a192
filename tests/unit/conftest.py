"""The unit tier: no subprocess, no server, no socket and no model training, so a module runs in seconds
anywhere. Each of them is refused here with where the test belongs instead."""

from __future__ import annotations

import socket
import subprocess

import pytest
import urllib3  # noqa: F401  imported before the limits below: its import probes IPv6 by binding a socket

from pipeline.engines import tiny_target

ELSEWHERE = "it belongs in tests/integration (or tests/system)"


class UnitTierViolation(BaseException):
    """Not an Exception, so code under test that turns errors into its own cannot hide it."""


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise UnitTierViolation(f"a unit test {what}: {ELSEWHERE}")

    return refused


@pytest.fixture(autouse=True)
def unit_tier_limits(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("started a subprocess"))
    monkeypatch.setattr(socket.socket, "connect", _refuse("opened a connection"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse("opened a connection"))
    monkeypatch.setattr(socket.socket, "bind", _refuse("started a server"))
    monkeypatch.setattr(tiny_target, "ensure_tiny_target", _refuse("built a tiny target"))


def _refused_fixture(name: str, what: str):
    def refused():
        raise UnitTierViolation(f"a unit test asked for {name}, {what}: {ELSEWHERE}")

    return pytest.fixture(scope="session", name=name)(refused)


# the fixtures of tests/conftest.py that train the tiny target or start a server, refused in this tier
tiny_target_dir = _refused_fixture("tiny_target_dir", "the tiny target, trained on first use")
kimi_target_dir = _refused_fixture("kimi_target_dir", "the tiny Kimi target, trained on first use")
tiny_tokenizer = _refused_fixture("tiny_tokenizer", "the tiny target's, trained on first use")
tiny_model = _refused_fixture("tiny_model", "the tiny target, trained on first use")
s3_endpoint = _refused_fixture("s3_endpoint", "moto's S3 server")
mlflow_server = _refused_fixture("mlflow_server", "MLflow's tracking server")
alert_sinks = _refused_fixture("alert_sinks", "the alert sink servers")
vllm_python = _refused_fixture("vllm_python", "vLLM's engine")
