"""The benchmark: tok/s and acceptance of plain decoding (baseline), n-gram, the incumbent and the candidate,
measured by engines behind one interface.

    settings.py   the `benchmark:` section of a run config, with each engine's own settings
    job.py        BenchJob (what every engine measures on), the protocol of an engine module, run_engine
    figures.py    what more than one engine builds its figures with
    reference.py  the project's reference speculative decoder on this machine; calibration.py is how it
                  chooses its draft setting, decoded.py its decodes as figures
    vllm.py       vLLM engines, one per method (its CPU build here, its GPU build in a benchmark pod)
    sglang.py     SGLang servers, one per method in turn (production)

The engine a run config names (benchmark.engine) is the one the drafter will be served with, and its speed
decides (pipeline.promotion). Beside vLLM the reference decoder can run too (benchmark.reference_beside): it
measures at the serving engine's setting, and the serving engine's acceptance must match its own, counted as
the serving engine counts; its own timing is reported beside, not decisive.

Adding an engine: a module here with `measure(job: BenchJob) -> EngineBench` (pipeline.benchmark.job) and a
row in ENGINES; settings of its own go in a section of BenchmarkConfig (settings.py), beside the others.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    """One benchmark engine: its name in benchmark.engine and in the records, and the module that measures
    with it (imported when it measures, so reading the table loads no engine)."""

    name: str
    module: str
    help: str
    # it drafts every position of its chain in every step, needed or not, and counts every draft accepted
    # (vLLM): the reference decoder beside it counts its own drafts the same way
    drafts_whole_chain: bool = False


ENGINES: tuple[Engine, ...] = (
    Engine("reference", "pipeline.benchmark.reference", "the project's reference speculative decoder, here"),
    Engine("vllm", "pipeline.benchmark.vllm", "vLLM engines, one per method", drafts_whole_chain=True),
    Engine("sglang", "pipeline.benchmark.sglang", "SGLang servers, one per method in turn"),
)
ENGINE_NAMES = tuple(engine.name for engine in ENGINES)


def engine(name: str) -> Engine:
    for entry in ENGINES:
        if entry.name == name:
            return entry
    raise ValueError(f"unknown benchmark engine {name!r}; engines: {', '.join(ENGINE_NAMES)}")
