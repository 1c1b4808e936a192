"""The in-process capture runner on SGLang's own ModelRunner: one process per tensor-parallel rank.

RUN ON A CPU ONLY, one rank, on a Llama target: tests/system/test_sglang_real.py runs it against real SGLang
0.5.23 on the CPU (`make sglang-venv`, with `platform_args` the CPU's ServerArgs) and finds its aux states,
last hidden state and top-K teacher equal to transformers' and to the capture server's over HTTP. Not run:
tensor parallelism over GPUs, and an MLA (Kimi-K2.5) target, which SGLang's CPU path does not load
(docs/BENCHMARKS.md, issue 56). This module is coded to SGLang 0.5.23's source, following the way SGLang
itself drives a ModelRunner without a server in its one-batch benchmark (sglang/benchmark/one_batch.py;
paths below are relative to the sglang package):

- per rank: publish the server args for this rank (`runtime_context.publish`, one_batch.py:691-698), the
  process-global kernel configs (one_batch.py:119-128), `bootstrap.init_parallel_runtime` and
  `init_layer_runtime` (one_batch.py:333-342; the runner does not start torch.distributed itself,
  srt/model_executor/model_runner.py:1261-1268), then `ModelRunner(model_config, mem_fraction_static, gpu_id,
  nccl_port, server_args)` (model_runner.py:344-358), its memory pool, attention backends and graph runners
  (one_batch.py:356-372);
- the aux layers: `model.set_eagle3_layers_to_capture(ids)` with SGLang's ids, as a draft config carries them
  (srt/models/llama.py:929-941, srt/models/deepseek_v2.py:3458-3473; Kimi-K2.5's wrapper delegates to its
  language model, srt/models/kimi_k25.py:928-939);
- a batch: one `Req` per sequence and `ScheduleBatch.init_new` -> `prepare_for_extend` -> `ForwardBatch.
  init_new` -> `ModelRunner.forward`, as one_batch.py:497-533 extends, with the forward batch's
  `capture_hidden_mode` FULL. The aux states of every token come back packed [T, 3H] in
  `LogitsProcessorOutput.hidden_states` and the post-norm last hidden state in `last_hidden_states`
  (srt/layers/logits_processor.py:226-235, 866-871, 906-918);
- the top-K teacher: a full-vocabulary log-softmax of the logits the model's own logits processor computes
  from `last_hidden_states` (`_get_logits`, logits_processor.py:953; it gathers the vocabulary-parallel
  LM head across ranks), a chunk of tokens at a time.

Every rank runs the same batches (InProcessEngine checks that); rank 0's tensors are the ones stored.

SpecForge's offline capture (sgl-project/SpecForge a6b6b02, specforge/offline_capture/sglang_backend/) drives
a ModelRunner the same way and was read for the design; it pins SGLang 0.5.14, whose ModelRunner constructor,
parallel-state helpers and ForwardBatch.init_new signature 0.5.23 changed, so nothing of it is reused.
"""

from __future__ import annotations

import logging
import os
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pipeline.engines import Capture, EngineError, TeacherRequest
from pipeline.engines.sglang import SGLANG_VERSION
from pipeline.processes import free_port

log = logging.getLogger(__name__)
DIST_PORT_ENV = "DRAFTER_CAPTURE_DIST_PORT"  # the port every rank's SGLang process group meets on
LOGITS_CHUNK = 1024  # tokens whose full-vocabulary logits are computed at a time


class SGLangPrefillRunner:
    name = "sglang"

    def __init__(
        self,
        model_dir: Path,
        sglang_layer_ids: list[int],
        settings,
        rank: int,
        world_size: int,
        trust_remote_code: bool,
        platform_args: dict[str, Any] | None = None,
    ):
        """`platform_args`: ServerArgs for a platform other than SGLang's default (CUDA GPUs), e.g. the
        CPU flags a test on a machine without GPUs runs it with; production passes none."""
        try:
            import sglang
        except ImportError as err:
            raise EngineError(
                "capture.inprocess.runner 'sglang' needs SGLang "
                f"{SGLANG_VERSION} in this image (docker/sglang.Dockerfile) and GPUs"
            ) from err
        if sglang.__version__.split("+")[0] != SGLANG_VERSION:
            raise EngineError(f"this runner is coded to SGLang {SGLANG_VERSION}, found {sglang.__version__}")
        self.version = f"sglang-{sglang.__version__}-model-runner"
        self.rank, self.world_size = rank, world_size
        self.max_prefill_tokens = settings.max_prefill_tokens
        server_args = _server_args(
            model_dir, settings, world_size, trust_remote_code, sglang_layer_ids, platform_args or {}
        )
        self.runner = _load_model_runner(server_args, model_dir, settings, rank, world_size)
        self.runner.model.set_eagle3_layers_to_capture(list(sglang_layer_ids))

    def prefill(self, sequences: list[list[int]], teacher: TeacherRequest) -> list[Capture]:
        captures: list[Capture] = []
        for group in _token_bounded(sequences, self.max_prefill_tokens):
            captures += self._extend(group, teacher)
        return captures

    @torch.no_grad()
    def _extend(self, sequences: list[list[int]], teacher: TeacherRequest) -> list[Capture]:
        from sglang.srt.layers.logits_processor import LogitsMetadata
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

        batch = _schedule_batch(sequences, self.runner)
        try:
            forward_batch = ForwardBatch.init_new(batch, self.runner, return_hidden_states_before_norm=False)
            forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
            output = self.runner.forward(forward_batch).logits_output
            aux, last = output.hidden_states, output.last_hidden_states
            total = sum(len(s) for s in sequences)
            if aux is None or aux.shape[0] != total or last is None or last.shape[0] != total:
                shapes = [None if t is None else tuple(t.shape) for t in (aux, last)]
                raise EngineError(
                    f"SGLang returned aux and last hidden states of {shapes} for {total} tokens"
                )
            topk = None
            if "topk" in teacher.kinds:  # every rank takes part: the LM head is split over them
                topk = self._topk(last, LogitsMetadata.from_forward_batch(forward_batch), teacher.topk)
            if self.rank != 0:  # rank 0 alone stores: the others keep nothing on the host
                return [Capture(torch.empty(0, 0)) for _ in sequences]
            return self._split(sequences, aux, last if "last_hidden" in teacher.kinds else None, topk)
        finally:
            _free_pools(self.runner)

    def _topk(self, last: torch.Tensor, metadata, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the full-vocabulary log-softmax at every token, a chunk of tokens at a time."""
        model = self.runner.model
        values, indices = [], []
        for start in range(0, last.shape[0], LOGITS_CHUNK):
            hidden = last[start : start + LOGITS_CHUNK]
            logits = model.logits_processor._get_logits(
                hidden, model.lm_head, metadata, use_logits_buffer=False
            )
            top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
            values.append(top.values.cpu())
            indices.append(top.indices.cpu())
        return torch.cat(indices), torch.cat(values)

    @staticmethod
    def _split(
        sequences: list[list[int]],
        aux: torch.Tensor,
        last: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> list[Capture]:
        captures, start = [], 0
        for sequence in sequences:
            rows = slice(start, start + len(sequence))
            captures.append(  # in the model's dtype (bf16): the shard writer encodes a chunk at a time
                Capture(
                    aux[rows].cpu(),
                    None if last is None else last[rows].cpu(),
                    None if topk is None else topk[0][rows],
                    None if topk is None else topk[1][rows],
                )
            )
            start += len(sequence)
        return captures

    def close(self) -> None:
        from sglang.srt.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()


def _token_bounded(sequences: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive groups of sequences of at most max_tokens tokens each (a longer sequence alone)."""
    groups: list[list[list[int]]] = [[]]
    tokens = 0
    for sequence in sequences:
        if groups[-1] and tokens + len(sequence) > max_tokens:
            groups.append([])
            tokens = 0
        groups[-1].append(sequence)
        tokens += len(sequence)
    return [group for group in groups if group]


def _server_args(
    model_dir: Path,
    settings,
    world_size: int,
    trust_remote_code: bool,
    sglang_layer_ids: list[int],
    platform_args: dict[str, Any],
):
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=str(model_dir),
        tp_size=world_size,
        mem_fraction_static=settings.mem_fraction_static,
        trust_remote_code=trust_remote_code,
        disable_radix_cache=True,  # every prompt row is computed, none taken from a cached prefix
        chunked_prefill_size=-1,
        enable_return_hidden_states=True,
        # aux-state capture, as the capture servers are started: without it the logits processor keeps
        # no last hidden state (logits_processor.py:505, :906-918; found running it, docs/BENCHMARKS.md).
        # EAGLE3 names the capture convention; the hook resets the algorithm to none
        # (arg_groups/validation_hook.py:697-747), so no draft model is loaded
        enable_return_aux_hidden_states=True,
        speculative_algorithm="EAGLE3",
        return_aux_hidden_state_layer_ids=list(sglang_layer_ids),
        **platform_args,
    )
    server_args.resolve_once()  # one_batch.py:1043
    return server_args


def _load_model_runner(server_args, model_dir: Path, settings, rank: int, world_size: int):
    """This rank's ModelRunner, loaded as one_batch.py's load_model does (see the module docstring)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_device, get_model, publish, spawn_world_rank

    _set_envs_and_config(server_args)  # one_batch.py:1046
    gpu_id = int(os.environ.get("LOCAL_RANK", rank))
    if server_args.device == "cuda":
        torch.cuda.set_device(gpu_id)
    ranks = SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=rank, pp_rank=0), gpu_id=gpu_id)
    publish(server_args, role="scheduler", ranks=ranks)
    initialize_moe_config()
    initialize_fp8_gemm_config()
    initialize_bf16_gemm_config()
    initialize_fp4_gemm_config()
    port = int(os.environ.get(DIST_PORT_ENV) or free_port())  # the job's launcher sets it for every rank
    model_config = ModelConfig.from_server_args(server_args)
    bootstrap.init_parallel_runtime(server_args=server_args, device=get_device().device, dist_port=port)
    bootstrap.init_layer_runtime(model_config=model_config)
    runner = ModelRunner(
        model_config=model_config,
        mem_fraction_static=settings.mem_fraction_static,
        gpu_id=gpu_id,
        nccl_port=port,
        server_args=server_args,
    )
    overlapped = get_model().is_startup_weight_load_overlap  # one_batch.py:356-372, in this order
    if overlapped:
        runner.start_startup_weight_load()
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    # sets the eager and prefill-graph runners ModelRunner.forward reads (model_runner.py:1170-1201,
    # :2038): without it the first forward raises AttributeError (found running it, docs/BENCHMARKS.md)
    runner.init_cuda_graphs()
    if overlapped:
        runner.finalize_startup_weight_load()
    log.info("rank %d of %d: SGLang's model runner loaded %s", rank, world_size, model_dir)
    return runner


class _NoPrefixCache(SimpleNamespace):
    """The tree cache a ScheduleBatch wants, caching nothing (as one_batch.py:470-484 does)."""

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return True

    def evict(self, params: Any) -> None:
        pass

    def maybe_hand_to_session(self, req: Any) -> None:
        pass


def _schedule_batch(sequences: list[list[int]], runner):
    """A prefill batch of these sequences, prepared as one_batch.py:497-519 prepares one."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    reqs = []
    for index, sequence in enumerate(sequences):
        req = Req(
            rid=str(index),
            origin_input_text="",
            origin_input_ids=array("q", sequence),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.extend_end = len(sequence)
        reqs.append(req)
    cache = _NoPrefixCache(
        page_size=get_schedule().page_size,
        device=runner.device,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
    )
    batch = ScheduleBatch.init_new(
        reqs=reqs,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        tree_cache=cache,
        model_config=runner.model_config,
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    batch.prepare_for_extend()
    if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
        batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
        batch.prefill_input_ids_cpu = None
    return batch


def _free_pools(runner) -> None:
    """Release every request slot and KV page the batch took: nothing is kept between batches."""
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
