"""vLLM as a benchmark engine (benchmark.engine "vllm"): every method in its own vLLM engine
(pipeline.engines.vllm), prompts decoded one at a time (batch size 1, greedy; benchmark.batch_sizes adds
passes that many prompts per generate call), acceptance from vLLM's own speculative-decoding counters.

The methods measured against each other are alive at once and decoded interleaved, one pass over every
prompt per method per round (pipeline.spread.measure), so machine noise falls on all of them alike; where
one engine fills the machine (Kimi-K2.5 on a GPU node: benchmark.vllm.engines_at_once false) they run one
at a time instead (`measure_engines_in_turn`). n-gram settings are first timed one engine at a time on the
calibration prompts; the fastest is then measured. The candidate drafts a chain of
benchmark.vllm.num_speculative_tokens (default: benchmark.draft_steps). Every output must equal vLLM's own
greedy decoding (the baseline engine's), or the stage fails.

vLLM counts acceptance differently from the reference decoder at the end of a request: it drafts
num_speculative_tokens in every step and counts every draft the target accepted, also those past max_tokens
(pipeline.decoding.reference_decoder.WholeChainProposer cites where), where the reference decoder drafts
only as many tokens as the request still needs. Beside vLLM the reference decoder counts its drafts the way
vLLM does (pipeline.benchmark.Engine.drafts_whole_chain); counted so, the two agree cycle for cycle on the
demo's drafter and the tests' (the same accepted-drafts histogram).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import spread
from pipeline.benchmark.figures import (
    engine_bench,
    interval,
    ngram_sweep,
    outputs_sha256,
    required_tau,
    sampled_bench,
)
from pipeline.benchmark.job import BenchJob, BenchmarkFailed
from pipeline.benchmark_settings import BenchmarkConfig, NgramLocalSetting, ServingSampling, VllmBenchConfig
from pipeline.drafter.export import (
    CONFIG_NAME,
    architecture_of,
    copy_with_layer_ids,
    engine_layer_ids,
    engine_refusals,
    read_drafter_dir,
    require_exported_for,
    written_layer_ids,
)
from pipeline.engine_settings import VllmEngineConfig
from pipeline.engines import vllm as vllm_engines
from pipeline.engines.vllm import SpecCounters, VllmEngine, VllmGeneration
from pipeline.records import BatchBench, BenchMethods, EngineBench, MethodResult, NgramSweep
from pipeline.spread import Measurement

log = logging.getLogger(__name__)


def measure(job: BenchJob) -> EngineBench:
    """Every method in vLLM: the n-gram settings timed one engine at a time, then baseline, the fastest
    n-gram, the incumbent and the candidate measured alive at once and interleaved (or, with
    benchmark.vllm.engines_at_once false, one engine after another); at every other of benchmark.batch_sizes
    and sampled at benchmark.serving_sampling too."""
    bench = job.settings
    settings = bench.vllm or VllmBenchConfig()
    vllm_engines.vllm_python(settings)  # missing: a clear error before any work
    drafter_dirs = {name: vllm_loadable(name, path, job.workdir) for name, path in job.drafter_dirs.items()}
    steps = settings.num_speculative_tokens or bench.draft_steps
    swept = {}
    if len(bench.ngram_settings) > 1:
        swept = time_ngram_settings(settings, job.target_dir, job.prompts, bench, job.trust_remote_code)
    ngram = max(bench.ngram_settings, key=lambda s: pass_tok_s(swept[s.label]) if swept else 0.0)
    specs = {
        "baseline": EngineSpec(job.target_dir),
        "ngram": EngineSpec(job.target_dir, ngram_setting_speculation(ngram)),
        **{
            name: EngineSpec(job.target_dir, vllm_engines.eagle3_speculation(path, steps))
            for name, path in drafter_dirs.items()
        },
    }
    runs = measure_specs(job, specs, settings, sampled_too=["baseline", *drafter_dirs])
    return vllm_figures(job, runs, swept, steps)


def measure_specs(
    job: BenchJob, specs: Mapping[str, EngineSpec], settings: VllmBenchConfig, sampled_too: Collection[str]
) -> VllmRuns:
    """The engines of `specs` greedy at batch 1 and at every other of benchmark.batch_sizes, and those named
    in `sampled_too` sampled at benchmark.serving_sampling: alive at once and interleaved, or with
    benchmark.vllm.engines_at_once false one at a time (measure_engines_in_turn)."""
    bench = job.settings
    if not settings.engines_at_once:
        return measure_engines_in_turn(
            specs, settings, job.trust_remote_code, job.prompts, bench, sampled_too
        )
    against = [("candidate", name) for name in specs if name != "candidate"]
    levels = [size for size in bench.measured_batch_sizes() if size != 1]
    sampled = None
    with running_engines(specs, settings, job.trust_remote_code) as engines:
        version = engines["baseline"].vllm_version
        greedy = Passes(*measure_engines(engines, job.prompts, bench, against))
        at_batch = {
            size: Passes(*measure_engines(engines, job.prompts, bench, against, None, size))
            for size in levels
        }
        if bench.serving_sampling is not None:
            chosen = {name: engines[name] for name in sampled_too}
            ratios = [("candidate", name) for name in sampled_too if name != "candidate"]
            sampled = Passes(*measure_engines(chosen, job.prompts, bench, ratios, bench.serving_sampling))
    return VllmRuns(greedy=greedy, version=version, sampled=sampled, at_batch=at_batch)


def vllm_figures(job: BenchJob, runs: VllmRuns, swept: dict[str, VllmGeneration], steps: int) -> EngineBench:
    """What the engines measured as the engine's figures; every output must equal the baseline engine's
    greedy output of the same prompt (require_greedy_outputs)."""
    bench = job.settings
    require_greedy_outputs(runs.greedy.passes, swept)
    for size, level in runs.at_batch.items():
        require_greedy_outputs(level.passes, {}, f" at batch {size}")
    others = [name for name in runs.greedy.passes if name != "candidate"]
    methods = BenchMethods.model_validate(
        {name: method_result(passes) for name, passes in runs.greedy.passes.items()}
    )
    sweep = vllm_ngram_sweep(bench, {label: method_result([g]) for label, g in swept.items()}, methods.ngram)
    speedups = {other: interval(runs.greedy.measured.ratio("candidate", other)) for other in others}
    shape = (steps, 1, steps + 1)
    tau = round(required_tau(job.evaluation, shape), 4)
    figures = engine_bench(job, "vllm", shape, tau, methods, speedups, sweep)
    figures.engine_version = runs.version
    figures.batches = [
        vllm_batch(size, level, steps, others) for size, level in sorted(runs.at_batch.items())
    ]
    sampled, serving = runs.sampled, bench.serving_sampling
    if sampled is not None and serving is not None:
        results = {name: method_result(passes) for name, passes in sampled.passes.items()}
        figures.sampled = sampled_bench(
            serving, results, lambda other: sampled.measured.ratio("candidate", other)
        )
    return figures


@dataclass(frozen=True)
class EngineSpec:
    """One method's engine: the target, and vLLM's speculative_config (None: plain greedy decoding)."""

    model_dir: Path
    speculation: dict[str, Any] | None = None


def ngram_setting_speculation(setting: NgramLocalSetting) -> dict[str, Any]:
    """vLLM's n-gram for one of benchmark.ngram_settings: min/max match as prompt_lookup_min/max, steps as
    num_speculative_tokens."""
    return vllm_engines.ngram_speculation(setting.min_match, setting.max_match, setting.steps)


@contextmanager
def running_engines(
    specs: Mapping[str, EngineSpec], settings: VllmEngineConfig, trust_remote_code: bool
) -> Iterator[dict[str, VllmEngine]]:
    """Every method's engine, alive at once for the block; all stopped on exit, also on errors."""
    with ExitStack() as stack:
        engines = {
            name: stack.enter_context(
                vllm_engines.running_engine(
                    name, settings, spec.model_dir, spec.speculation, trust_remote_code
                )
            )
            for name, spec in specs.items()
        }
        yield engines


def decode_pass(
    engine: VllmEngine,
    prompts: list[list[int]],
    max_new_tokens: int,
    serving: ServingSampling | None = None,
    batch_size: int = 1,
) -> VllmGeneration:
    """One pass over the prompts, `batch_size` requests at a time (default one): greedy, or sampled at
    `serving`."""
    if serving is None:
        return engine.generate(prompts, max_new_tokens, temperature=0.0, batch_size=batch_size)
    return engine.generate(
        prompts,
        max_new_tokens,
        temperature=serving.temperature,
        top_p=serving.top_p,
        top_k=serving.top_k,
        batch_size=batch_size,
    )


def pass_tok_s(generation: VllmGeneration) -> float:
    return sum(len(output) for output in generation.outputs) / sum(generation.seconds)


def summed_counters(passes: list[VllmGeneration]) -> SpecCounters | None:
    counters = [generation.spec for generation in passes if generation.spec is not None]
    if not counters:
        return None
    total = counters[0]
    for more in counters[1:]:
        total = total + more
    return total


def method_result(passes: list[VllmGeneration]) -> MethodResult:
    """One method's figures over its measured passes; acceptance from vLLM's counters."""
    tokens = sum(len(output) for generation in passes for output in generation.outputs)
    seconds = sum(sum(generation.seconds) for generation in passes)
    result = MethodResult(
        tokens=tokens,
        seconds=round(seconds, 4),
        tok_s=round(tokens / seconds, 2),
        round_tok_s=[round(pass_tok_s(generation), 2) for generation in passes],
        requests=sum(len(generation.outputs) for generation in passes),
        outputs_sha256=outputs_sha256(passes[0].outputs),
    )
    spec = summed_counters(passes)
    tau = spec.tau() if spec is not None else None
    if spec is not None and tau is not None:
        result.tau_measured = round(tau, 4)
        result.accepted_histogram = spec.accepted_histogram()
        result.acceptance_per_position = [round(p, 4) for p in spec.per_position_acceptance()]
    return result


def greedy_mismatches(passes: Mapping[str, list[VllmGeneration]], greedy: list[list[int]]) -> dict[str, int]:
    """Per method, how many of its outputs (over every pass; a pass may cover the first prompts only) differ
    from greedy decoding's outputs of the same prompts; methods without a difference are left out."""
    mismatches = {
        name: sum(
            output != expected
            for generation in runs
            for output, expected in zip(generation.outputs, greedy, strict=False)
        )
        for name, runs in passes.items()
    }
    return {name: count for name, count in mismatches.items() if count}


def time_ngram_settings(
    settings: VllmEngineConfig,
    target_dir: Path,
    prompts: list[list[int]],
    bench: BenchmarkConfig,
    trust_remote_code: bool,
) -> dict[str, VllmGeneration]:
    """Every configured n-gram setting in its own engine, one engine at a time: a warm-up prompt, then one
    timed pass over the calibration prompts. By setting label."""
    calibration = prompts[: bench.calibration_prompts]
    timed = {}
    for setting in bench.ngram_settings:
        speculation = ngram_setting_speculation(setting)
        with vllm_engines.running_engine(
            f"ngram {setting.label}", settings, target_dir, speculation, trust_remote_code
        ) as e:
            decode_pass(e, prompts[:1], bench.max_new_tokens)
            timed[setting.label] = decode_pass(e, calibration, bench.max_new_tokens)
        log.info("benchmark (vllm): n-gram %s: %.1f tok/s", setting.label, pass_tok_s(timed[setting.label]))
    return timed


def measure_engines(
    engines: Mapping[str, VllmEngine],
    prompts: list[list[int]],
    bench: BenchmarkConfig,
    ratios: list[tuple[str, str]],
    serving: ServingSampling | None = None,
    batch_size: int = 1,
) -> tuple[dict[str, list[VllmGeneration]], Measurement]:
    """Every engine decodes every prompt once per round, `batch_size` at a time, interleaved
    (pipeline.spread.measure: a warm-up round, then at least max(3, repeats) measured rounds, and more until
    every ratio's interval is ci_rel_width narrow or the budget is spent: budget_s where the promotion rule
    reads the measurement, greedy at a gated batch size, reported_budget_s elsewhere); greedy, or sampled at
    `serving`. The measured passes per engine, and the measurement."""
    passes: dict[str, list[VllmGeneration]] = {name: [] for name in engines}
    rounds = RoundLog(len(engines))

    def side(name: str) -> Callable[[], float]:
        def decode_all() -> float:
            passes[name].append(
                decode_pass(engines[name], prompts, bench.max_new_tokens, serving, batch_size)
            )
            tok_s = pass_tok_s(passes[name][-1])
            rounds.record(name, tok_s)
            return tok_s

        return decode_all

    min_rounds = max(3, bench.repeats)
    measured = spread.measure(
        {name: side(name) for name in engines},
        ratios,
        confidence=bench.confidence,
        rel_width=bench.ci_rel_width,
        budget_s=bench.budget_s_for(serving is None and bench.decides_at(batch_size)),
        min_rounds=min_rounds,
        max_rounds=max(min_rounds, 10_000),
    )
    log.info("benchmark (vllm): %d measured rounds, stopped by %s", measured.rounds, measured.stopped_by)
    return {name: runs[len(runs) - measured.rounds :] for name, runs in passes.items()}, measured


def measure_engines_in_turn(
    specs: Mapping[str, EngineSpec],
    settings: VllmEngineConfig,
    trust_remote_code: bool,
    prompts: list[list[int]],
    bench: BenchmarkConfig,
    sampled_too: Collection[str] = (),
) -> VllmRuns:
    """benchmark.vllm.engines_at_once false: one engine alive at a time, as a GPU node holds one Kimi-K2.5
    engine. Each decodes a warm-up pass, then max(3, benchmark.repeats) timed passes over the prompts; the
    speedups pair the passes by index (stopped by "max_rounds": their number is fixed beforehand). A drift of
    the machine from one engine to the next is not cancelled as interleaved rounds cancel it. While each
    engine is up it also decodes greedy at every other of benchmark.batch_sizes, and (the engines named in
    `sampled_too`) sampled at benchmark.serving_sampling."""
    rounds = max(3, bench.repeats)
    levels = [size for size in bench.measured_batch_sizes() if size != 1]
    passes: dict[str, list[VllmGeneration]] = {}
    sampled: dict[str, list[VllmGeneration]] = {}
    at_batch: dict[int, dict[str, list[VllmGeneration]]] = {size: {} for size in levels}
    version = ""
    start = time.perf_counter()
    for name, spec in specs.items():
        with vllm_engines.running_engine(
            name, settings, spec.model_dir, spec.speculation, trust_remote_code
        ) as engine:
            version = engine.vllm_version
            passes[name] = _timed_passes(engine, name, prompts, bench, rounds, None)
            for size in levels:
                at_batch[size][name] = _timed_passes(engine, name, prompts, bench, rounds, None, size)
            if name in sampled_too and bench.serving_sampling is not None:
                sampled[name] = _timed_passes(engine, name, prompts, bench, rounds, bench.serving_sampling)
    elapsed = time.perf_counter() - start

    def paired(runs: dict[str, list[VllmGeneration]]) -> Passes:
        return Passes(runs, _paired_by_index(runs, rounds, bench.confidence, elapsed))

    return VllmRuns(
        greedy=paired(passes),
        version=version,
        sampled=paired(sampled) if sampled else None,
        at_batch={size: paired(runs) for size, runs in at_batch.items()},
    )


@dataclass(frozen=True)
class Passes:
    """Passes of engines run one at a time, and their measurement (speedups paired by pass index)."""

    passes: dict[str, list[VllmGeneration]]
    measured: Measurement


@dataclass(frozen=True)
class VllmRuns:
    """What measure_engines_in_turn measured: greedy one request at a time, vLLM's version, sampled at the
    serving temperature (None: not asked), and greedy at each other batch size."""

    greedy: Passes
    version: str
    sampled: Passes | None
    at_batch: dict[int, Passes]


def _timed_passes(
    engine: VllmEngine,
    name: str,
    prompts: list[list[int]],
    bench: BenchmarkConfig,
    rounds: int,
    serving: ServingSampling | None,
    batch_size: int = 1,
) -> list[VllmGeneration]:
    """A warm-up pass, then `rounds` timed passes over the prompts `batch_size` at a time, greedy or sampled
    at `serving`."""
    how = "greedy" if serving is None else f"at temperature {serving.temperature}"
    how += f" at batch {batch_size}" if batch_size != 1 else ""
    decode_pass(engine, prompts, bench.max_new_tokens, serving, batch_size)
    timed = []
    for index in range(rounds):
        timed.append(decode_pass(engine, prompts, bench.max_new_tokens, serving, batch_size))
        log.info(
            "benchmark (vllm): %s %s pass %d of %d: %.1f tok/s",
            name,
            how,
            index + 1,
            rounds,
            pass_tok_s(timed[-1]),
        )
    return timed


def _paired_by_index(
    passes: Mapping[str, list[VllmGeneration]], rounds: int, confidence: float, elapsed: float
) -> Measurement:
    samples = {name: tuple(pass_tok_s(g) for g in runs) for name, runs in passes.items()}
    return Measurement(samples, rounds, "max_rounds", confidence, elapsed)


class RoundLog:
    """A log line per round of interleaved passes (each engine once), with every engine's tokens/s."""

    def __init__(self, engines: int):
        self.engines = engines
        self.rounds = 0
        self.current: dict[str, float] = {}

    def record(self, name: str, tok_s: float) -> None:
        self.current[name] = tok_s
        if len(self.current) == self.engines:
            self.rounds += 1
            figures = ", ".join(f"{n} {v:.1f}" for n, v in sorted(self.current.items()))
            log.info("benchmark (vllm): round %d (round 1 is the warm-up), tok/s: %s", self.rounds, figures)
            self.current = {}


def vllm_loadable(name: str, drafter_dir: Path, workdir: Path) -> Path:
    """The drafter directory vLLM loads. Without vLLM's aux layer ids vLLM would read SGLang's and feed the
    drafter other layers than it was trained on: a candidate must carry them (EngineNotExported), an incumbent
    promoted before drafters were exported with them is benchmarked from a local copy given the ids its
    contract takes (pipeline.drafter.export.engine_layer_ids). A drafter vLLM cannot load here (eagle3-mla)
    is refused with the reason, before vLLM starts."""
    config = json.loads((drafter_dir / CONFIG_NAME).read_text())
    refusal = engine_refusals(config).get("vllm")
    if refusal is not None:
        raise BenchmarkFailed(
            f"benchmark.engine vllm cannot benchmark the {name} drafter {drafter_dir}, an "
            f"{architecture_of(config)} drafter: {refusal}. Benchmark it with benchmark.engine local (the "
            "project's reference decoder) or sglang"
        )
    if name == "candidate" or written_layer_ids(config, "vllm") is not None:
        require_exported_for(config, "vllm", drafter_dir)
        return drafter_dir
    ids = engine_layer_ids(read_drafter_dir(drafter_dir)[2], "vllm")
    copy = workdir / f"{name}_drafter_vllm"
    shutil.rmtree(copy, ignore_errors=True)
    log.info(
        "benchmark (vllm): the %s drafter has no vLLM aux layer ids; benchmarking a copy with %s", name, ids
    )
    return copy_with_layer_ids(drafter_dir, copy, "vllm", ids)


def require_greedy_outputs(
    passes: dict[str, list[VllmGeneration]], swept: dict[str, VllmGeneration], where: str = ""
) -> None:
    """BenchmarkFailed unless every output of every method (each n-gram setting's calibration pass too) equals
    the vLLM baseline's greedy output of the same prompt, token for token (`where`: at which batch size)."""
    greedy = passes["baseline"][0].outputs
    bad = greedy_mismatches({**passes, **{f"ngram {label}": [g] for label, g in swept.items()}}, greedy)
    if bad:
        raise BenchmarkFailed(
            f"vLLM's speculative outputs{where} differ from its greedy decoding (outputs, per method): {bad}"
        )


def vllm_batch(size: int, level: Passes, steps: int, others: list[str]) -> BatchBench:
    """vLLM's engines decoding the prompts `size` at a time: every method's figures and the candidate's
    speedups (its chain of `steps`, as at batch 1)."""
    methods = BenchMethods.model_validate({name: method_result(runs) for name, runs in level.passes.items()})
    return BatchBench(
        batch_size=size,
        draft_steps=steps,
        topk=1,
        draft_tokens=steps + 1,
        speedups={other: interval(level.measured.ratio("candidate", other)) for other in others},
        tau_measured=methods.candidate.tau_measured,
        methods=methods,
    )


def vllm_ngram_sweep(
    bench: BenchmarkConfig, swept: dict[str, MethodResult], measured: MethodResult
) -> NgramSweep:
    """The n-gram sweep of the vLLM benchmark: every setting's calibration figures; with one setting (nothing
    to choose, so nothing was swept) its measured figures."""
    if swept:
        calibration = (
            f"the first {bench.calibration_prompts} benchmark prompts (calibration), one engine per setting"
        )
        return ngram_sweep(bench.ngram_settings, swept, calibration)
    only = bench.ngram_settings[0]
    return ngram_sweep([only], {only.label: measured}, "every benchmark prompt (the only setting)")
