"""The environment a vLLM worker process starts with (pipeline.engines.vllm): its thread counts."""

from __future__ import annotations

from pipeline.engine_settings import VllmEngineConfig
from pipeline.engines.vllm import _worker_env


def test_an_engine_runs_one_openmp_and_one_numba_thread_by_default(monkeypatch):
    """One of each: engines alive at once on a shared machine do not stall each other at OpenMP barriers
    or in numba's pool (vLLM's n-gram proposer, 4 tok/s against 330 beside two busy processes)."""
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    env = _worker_env(VllmEngineConfig())
    assert (env["OMP_NUM_THREADS"], env["NUMBA_NUM_THREADS"]) == ("1", "1")
    assert _worker_env(VllmEngineConfig(cpu_threads=3))["NUMBA_NUM_THREADS"] == "3"
    assert "NUMBA_NUM_THREADS" not in _worker_env(VllmEngineConfig(cpu_threads=None))  # vLLM's own
