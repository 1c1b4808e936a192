"""The engines' own settings, shared by the stages that use them: SGLang servers reached over HTTP
(generate, capture), a vLLM engine in vLLM's own virtualenv (generate, benchmark) and vLLM's
OpenAI-compatible servers (generate)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator

from pipeline.config_base import SERVER_CREDENTIALS, Strict, http_url


class SGLangClientConfig(Strict):
    urls: list[str] = Field(min_length=1, description="server base URLs (for capture: aux-state servers)")
    deadline_s: float | None = Field(
        None, gt=0, description="per request, all retries included (default: timeout_s x (retries + 1))"
    )
    last_hidden_urls: list[str] | None = Field(
        None, description="capture only: servers returning the last hidden state"
    )
    concurrency: PositiveInt = Field(
        8,
        description="requests in flight; capture posts each from a worker process of its own, which parses "
        "the response's hidden states as it streams in (pipeline.sglang_transport)",
    )
    timeout_s: float = Field(600.0, gt=0)
    retries: int = Field(3, ge=0)

    @field_validator("urls", "last_hidden_urls")
    @classmethod
    def _urls_without_credentials(cls, urls: list[str] | None) -> list[str] | None:
        return urls if urls is None else [http_url(u, "an SGLang URL", SERVER_CREDENTIALS) for u in urls]


class VllmEngineConfig(Strict):
    """One vLLM engine (pipeline.engines.vllm), run by the Python of vLLM's own virtualenv. The defaults
    suit vLLM's CPU build on a small machine; on GPUs raise gpu_memory_utilization and drop
    cpu_kv_cache_gib."""

    python: str = Field(
        ".venv-vllm/bin/python",
        description="Python of vLLM's virtualenv (`make vllm-venv`); relative: from the working directory",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    max_model_len: PositiveInt | None = Field(None, description="default: the target's context length")
    tensor_parallel_size: PositiveInt = 1
    gpu_memory_utilization: float = Field(
        0.15, gt=0, le=1, description="on vLLM's CPU build: the fraction of host memory it may reserve"
    )
    cpu_kv_cache_gib: PositiveInt | None = Field(
        1, description="vLLM's CPU build: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE); None on GPUs"
    )
    enforce_eager: bool = True
    engine_core_in_process: bool = Field(
        True,
        description="vLLM's engine core in the worker's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0; with "
        "one device the model runs there too): one process per engine instead of three, so it loads in about "
        "half the time on a small CPU machine",
    )
    cpu_threads: PositiveInt | None = Field(
        1,
        description="vLLM's CPU build: OpenMP and numba threads per engine (OMP_NUM_THREADS, "
        "NUMBA_NUM_THREADS). One keeps engines alive at once, on a machine other work shares, from stalling "
        "each other at OpenMP barriers and in numba's thread pool (vLLM's n-gram proposer); None: vLLM's",
    )
    seed: int = 0
    startup_timeout_s: float = Field(900.0, gt=0)
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="more vllm.LLM keyword arguments (the project's own win)"
    )


class VllmServerClientConfig(Strict):
    """vLLM's OpenAI-compatible servers (`vllm serve`), reached over HTTP (pipeline.engines.vllm_openai)."""

    urls: list[str] = Field(min_length=1, description="server base URLs, e.g. http://host:8000")
    model: str | None = Field(None, description="the served model name (default: the first of /v1/models)")
    deadline_s: float | None = Field(
        None, gt=0, description="per request, all retries included (default: timeout_s x (retries + 1))"
    )
    concurrency: PositiveInt = 8
    timeout_s: float = Field(600.0, gt=0)
    retries: int = Field(3, ge=0)

    @field_validator("urls")
    @classmethod
    def _urls_without_credentials(cls, urls: list[str]) -> list[str]:
        return [http_url(url, "a vLLM server URL", SERVER_CREDENTIALS) for url in urls]
