"""In-process capture: the target runs in the capture process itself and its hidden states go straight from
the forward into capture shards, as tensors. No float passes through JSON, a pickle or a Python list.

Over SGLang's HTTP API each server's own JSON path caps capture at a few hundred tokens/s at Kimi-K2.5's
width (docs/BENCHMARKS.md), far below what its GPUs prefill. SpecForge's offline capture instead drives
SGLang's model runner in its own processes; this engine does the same behind the capture engine interface:

- a PrefillRunner holds the target (one tensor-parallel rank of it) and, for a batch of sequences, runs one
  prefill forward that captures the aux layers SGLang's ids name (as SGLang sets them on the model for an
  EAGLE-3 draft) and the teacher;
- InProcessEngine is the CaptureEngine the capture stage uses. With tensor parallelism every rank runs
  the same capture loop over the same batches (checked batch by batch); rank 0 alone stores shards
  (pipeline.stages.capture).

Runners: `sglang` (pipeline.engines.sglang_runner, SGLang's ModelRunner; coded to SGLang 0.5.23's source, run
one rank on a CPU against real SGLang on the tiny Llama target only: tests/system/test_sglang_real.py) and
`local`, the same small interface over a transformers forward, which the other tests run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import torch

from pipeline.engines import Capture, EngineError, TeacherRequest
from pipeline.engines.layer_ids import ModelFamily, captured_layer_outputs, draft_config_ids


class PrefillRunner(Protocol):
    """The target loaded in this process, capturing the aux layers it was started with on a prefill."""

    name: str
    version: str

    def prefill(self, sequences: list[list[int]], teacher: TeacherRequest) -> list[Capture]:
        """One capture per sequence: aux states [L, 3H] (the layers named at start, ascending), and the
        teacher signals asked for, as CPU tensors."""
        ...

    def close(self) -> None: ...


class LocalPrefillRunner:
    """The PrefillRunner interface over a transformers forward (the tiny target in tests): it captures what
    SGLang captures for the same ids on the target's model family (pipeline.engines.layer_ids)."""

    name = "local"

    def __init__(
        self,
        model_dir: Path,
        sglang_layer_ids: list[int],
        family: ModelFamily,
        trust_remote_code: bool,
        owns_group: bool = False,
    ):
        from pipeline.engines.hf import HFEngine

        self.owns_group = owns_group  # it started the job's process group, and ends it
        self.engine = HFEngine(model_dir, trust_remote_code=trust_remote_code)
        self.version = f"{self.engine.version}-local-runner"
        self.layer_outputs = captured_layer_outputs(
            "sglang", family, sglang_layer_ids, self.engine.num_layers
        )

    def prefill(self, sequences: list[list[int]], teacher: TeacherRequest) -> list[Capture]:
        return self.engine.capture(sequences, self.layer_outputs, teacher)

    def close(self) -> None:
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def batch_fingerprint(sequences: list[list[int]]) -> int:
    """63 bits identifying a batch of sequences, to check that every rank captures the same one."""
    digest = hashlib.blake2b(repr(sequences).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class InProcessEngine:
    """A CaptureEngine over a PrefillRunner. It captures the layer outputs it was opened for (the capture
    contract's) and refuses others: the runner's layers are fixed when the target loads."""

    name = "inprocess"

    def __init__(
        self,
        runner: PrefillRunner,
        aux_layer_ids: list[int],
        rank: int = 0,
        world_size: int = 1,
    ):
        self.runner, self.aux_layer_ids = runner, list(aux_layer_ids)
        self.rank, self.world_size = rank, world_size
        self.version = f"{runner.name}:{runner.version}"

    @property
    def stores_shards(self) -> bool:
        """Whether this process writes what is captured: rank 0 of a tensor-parallel job, or the only one."""
        return self.rank == 0

    def capture(
        self, sequences: list[list[int]], aux_layer_ids: list[int], teacher: TeacherRequest
    ) -> list[Capture]:
        if list(aux_layer_ids) != self.aux_layer_ids:
            raise EngineError(
                f"the in-process engine was started for aux layers {self.aux_layer_ids}, not {aux_layer_ids}"
            )
        if self.world_size > 1:
            self._require_same_batch(sequences)
        return self.runner.prefill(sequences, teacher)

    def _require_same_batch(self, sequences: list[list[int]]) -> None:
        """Tensor-parallel ranks must run the same forward: compare the batch's fingerprint across ranks."""
        import torch.distributed as dist

        mine = batch_fingerprint(sequences)
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # SGLang's ranks meet over NCCL
        seen = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if int(seen[0]) != mine or -int(seen[1]) != mine:
            raise EngineError(f"rank {self.rank} would capture a different batch than another rank")

    def close(self) -> None:
        self.runner.close()


def sglang_layer_ids(aux_layer_ids: list[int], family: ModelFamily, num_layers: int) -> list[int]:
    """The ids a runner is started with (SGLang's, as a draft config carries them) for these layer outputs."""
    return draft_config_ids("sglang", family, aux_layer_ids, num_layers)


# Set in the processes of a tensor-parallel capture job: they are its ranks, and launch nothing themselves.
RANK_ENV = "DRAFTER_CAPTURE_RANK"


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the job's size under torchrun (0 and 1 outside a job)."""
    import os

    if os.environ.get(RANK_ENV) != "1":
        return 0, 1
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def needs_rank_job(settings) -> bool:
    """Whether capture must start a job of tensor-parallel ranks (it is not one of them already)."""
    import os

    return (
        settings.engine == "inprocess" and settings.inprocess.tp_size > 1 and os.environ.get(RANK_ENV) != "1"
    )


def open_runner(settings, target, aux_layer_ids: list[int], trust_remote_code: bool) -> InProcessEngine:
    """The in-process engine of capture settings (capture.inprocess) for this rank of its job."""
    from pipeline.engines.layer_ids import model_family_of

    rank, world = rank_and_world()
    family = model_family_of(target.model_dir)
    ids = sglang_layer_ids(aux_layer_ids, family, target.num_layers)
    runner: PrefillRunner
    if settings.runner == "local":
        import torch.distributed as dist

        starts_group = world > 1 and not dist.is_initialized()
        if starts_group:
            dist.init_process_group("gloo")
        runner = LocalPrefillRunner(target.model_dir, ids, family, trust_remote_code, owns_group=starts_group)
    else:
        from pipeline.engines.sglang_runner import SGLangPrefillRunner

        runner = SGLangPrefillRunner(target.model_dir, ids, settings, rank, world, trust_remote_code)
    return InProcessEngine(runner, aux_layer_ids, rank, world)


def launch_rank_job(
    tp_size: int, rank_args: list[str], config_data: dict, stop_grace_s: float = 30.0
) -> None:
    """Run `drafter capture-rank <rank_args>` as `tp_size` ranks under torchrun on this node and wait for
    all of them; EngineError naming the exit code when one fails (the others are then stopped)."""
    import os
    import sys
    import tempfile

    import yaml

    from pipeline.processes import start_process_group, stop_process_group

    with tempfile.TemporaryDirectory(prefix="capture-ranks-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        config_path.write_text(yaml.safe_dump(config_data))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
        command += [str(tp_size), "--module", "pipeline.cli", "capture-rank", "--config", str(config_path)]
        command += rank_args
        from pipeline.engines.sglang_runner import DIST_PORT_ENV
        from pipeline.processes import free_port

        environment = {**os.environ, RANK_ENV: "1", "PYTHONUNBUFFERED": "1", DIST_PORT_ENV: str(free_port())}
        job = start_process_group(command, environment)
        try:
            assert job.stdout is not None
            for line in job.stdout:
                print(f"[capture ranks] {line}", end="", flush=True)
            code = job.wait()
        finally:
            stop_process_group(job, stop_grace_s)
    if code != 0:
        raise EngineError(f"the in-process capture job of {tp_size} ranks failed with exit code {code}")
