"""What every benchmark engine measures on (BenchJob), the protocol an engine module follows, and the one
place an engine is run."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from pipeline.benchmark_settings import BenchmarkConfig, engine
from pipeline.config import RunConfig
from pipeline.records import EngineBench, EvalRecord


class BenchmarkFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class BenchJob:
    """One benchmark: the held-out prompts (and each one's domain), the drafters by method name
    ("candidate", and "incumbent" when the evaluation compared one), the evaluation the speed model predicts
    from, the aux layers the drafters read, and the target. `serving`: the figures of the serving engine
    this engine measures beside (benchmark.reference_beside); None when this engine's figures decide."""

    config: RunConfig
    run_id: str
    target_dir: Path
    tokenizer: Any
    prompts: list[list[int]]
    domains: list[str]
    drafter_dirs: dict[str, Path]
    evaluation: EvalRecord
    aux_layer_ids: list[int]
    serving: EngineBench | None = None

    @property
    def settings(self) -> BenchmarkConfig:
        return self.config.benchmark

    @property
    def workdir(self) -> Path:
        return self.config.storage.run_workdir(self.run_id)

    @property
    def trust_remote_code(self) -> bool:
        return self.config.target.trust_remote_code

    def beside(self, serving: EngineBench) -> BenchJob:
        """This job for an engine that measures beside the serving engine's `serving` figures."""
        return dataclasses.replace(self, serving=serving)


class EngineModule(Protocol):
    """What a module of pipeline.benchmark.ENGINES defines."""

    def measure(self, job: BenchJob) -> EngineBench:
        """Every method on the job's prompts, greedy (and what else the settings ask for): the figures, with
        `engine` the module's engine name. Outputs that differ from greedy decoding fail (BenchmarkFailed)."""
        ...


def run_engine(name: str, job: BenchJob) -> EngineBench:
    """The engine `name` (a row of pipeline.benchmark.ENGINES) measuring `job`."""
    entry = engine(name)
    module = cast(EngineModule, importlib.import_module(entry.module))
    figures = module.measure(job)
    if figures.engine != name:
        raise TypeError(f"benchmark engine {name} ({entry.module}) returned figures of {figures.engine!r}")
    return figures
