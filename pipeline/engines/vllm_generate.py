"""Generation through a local vLLM worker (`generate.engine: vllm` without `generate.vllm_server`).

One worker (pipeline.engines.vllm: vLLM's own virtualenv, driven over a pipe) serves every batch of a stage
run: it starts when the engine is made and stops on `close()` (the generate stage closes it when the stage
ends, also on errors). Prompts go in as token ids (the pipeline applies the chat template) and vLLM stops at
the target's end-of-sequence token, which it keeps in the output as the HF engine does.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from types import TracebackType

from pipeline.engine_settings import VllmEngineConfig
from pipeline.engines import EngineError, EngineUnavailable, Generation, SamplingParams
from pipeline.engines.vllm import VllmError, VllmGeneration, running_engine

SAMPLING_EPSILON = 1e-6  # temperatures at or below it decode greedily, as the HF engine does


def worker_settings(settings: VllmEngineConfig, teacher_topk: int | None) -> VllmEngineConfig:
    """The worker's settings, with vLLM's max_logprobs (default 20, vllm/config/model.py:282) raised to the
    top-k the teacher keeps, so vLLM does not refuse the request."""
    if not teacher_topk:
        return settings
    extra = dict(settings.extra_engine_args)
    extra["max_logprobs"] = max(int(extra.get("max_logprobs", 20)), teacher_topk)
    return settings.model_copy(update={"extra_engine_args": extra})


def generations(result: VllmGeneration, count: int) -> list[Generation]:
    """The worker's reply as the engine protocol's generations, one per prompt."""
    if len(result.outputs) != count or result.finish_reasons is None or len(result.finish_reasons) != count:
        raise EngineError(f"vLLM answered {len(result.outputs)} outputs for {count} prompts")
    top: list[list[list[list[float]]] | None] = [None] * count
    if result.top_logprobs is not None:
        top = list(result.top_logprobs)
    return [
        Generation([int(t) for t in output], "stop" if reason == "stop" else "length", steps)
        for output, reason, steps in zip(result.outputs, result.finish_reasons, top, strict=True)
    ]


class VllmGenerateEngine:
    """The GenerationEngine protocol over one running vLLM worker; a context manager (or call close())."""

    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        settings: VllmEngineConfig,
        trust_remote_code: bool = False,
        teacher_topk: int | None = None,
    ):
        self._lifetime = ExitStack()
        self.worker = self._lifetime.enter_context(
            running_engine(
                "generate", worker_settings(settings, teacher_topk), model_dir, None, trust_remote_code
            )
        )
        self.version = f"vllm-{self.worker.vllm_version}"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        greedy = params.temperature <= SAMPLING_EPSILON
        try:
            result = self.worker.generate(
                prompts,
                params.max_new_tokens,
                temperature=0.0 if greedy else params.temperature,
                seed=None if greedy else params.seed,
                top_logprobs=params.top_logprobs,
            )
        except VllmError as err:
            if self.worker.process.poll() is not None:  # the worker is gone: no later batch can succeed
                raise EngineUnavailable(str(err)) from err
            raise  # vLLM refused this batch; the engine stays up for the next
        return generations(result, len(prompts))

    def close(self) -> None:
        self._lifetime.close()

    def __enter__(self) -> VllmGenerateEngine:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
