"""The benchmark on vLLM (benchmark.engine 'vllm'): every method in its own vLLM engine
(pipeline.engines.vllm), prompts decoded one at a time (batch size 1, greedy; benchmark.batch_sizes adds
passes that many prompts per generate call), acceptance from vLLM's own speculative-decoding counters.

The methods measured against each other are alive at once and decoded interleaved, one pass over every
prompt per method per round (pipeline.spread.measure), so machine noise falls on all of them alike; where
one engine fills the machine (Kimi-K2.5 on a GPU node: benchmark.vllm.engines_at_once false) they run one
at a time instead (`measure_engines_in_turn`). n-gram settings are first timed one engine at a time on the
calibration prompts; the fastest is then measured.

vLLM counts acceptance differently from the reference decoder at the end of a request: it drafts
num_speculative_tokens in every step ("We don't schedule partial draft tokens",
vllm/v1/core/sched/scheduler.py:673-676) and counts every draft the target accepted, also those past
max_tokens (the count comes from the sampled tokens before the stop check: scheduler.py:2110-2135;
vllm/v1/spec_decode/metrics.py:41-49), where the reference decoder drafts only as many tokens as the request
still needs. `reference_acceptance` counts the reference decoder's drafts the way vLLM does; counted so, the
two agree cycle for cycle on the demo's drafter and the tests' (the same accepted-drafts histogram).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.benchmark.settings import BenchmarkConfig, NgramLocalSetting, ServingSampling
from pipeline.engine_settings import VllmEngineConfig
from pipeline.engines.vllm import (
    SpecCounters,
    VllmEngine,
    VllmGeneration,
    ngram_speculation,
    running_engine,
)
from pipeline.records import MethodResult
from pipeline.spread import Measurement, measure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """One method's engine: the target, and vLLM's speculative_config (None: plain greedy decoding)."""

    model_dir: Path
    speculation: dict[str, Any] | None = None


def ngram_setting_speculation(setting: NgramLocalSetting) -> dict[str, Any]:
    """vLLM's n-gram for one of benchmark.ngram_settings: min/max match as prompt_lookup_min/max, steps as
    num_speculative_tokens."""
    return ngram_speculation(setting.min_match, setting.max_match, setting.steps)


@contextmanager
def running_engines(
    specs: Mapping[str, EngineSpec], settings: VllmEngineConfig, trust_remote_code: bool
) -> Iterator[dict[str, VllmEngine]]:
    """Every method's engine, alive at once for the block; all stopped on exit, also on errors."""
    with ExitStack() as stack:
        engines = {
            name: stack.enter_context(
                running_engine(name, settings, spec.model_dir, spec.speculation, trust_remote_code)
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


def outputs_sha256(outputs: list[list[int]]) -> str:
    """The fingerprint of one pass's outputs (MethodResult.outputs_sha256)."""
    return hashlib.sha256(json.dumps(outputs, separators=(",", ":")).encode()).hexdigest()


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
        with running_engine(
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
    every ratio's interval is ci_rel_width narrow or budget_s is spent); greedy, or sampled at `serving`. The
    measured passes per engine, and the measurement."""
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
    measured = measure(
        {name: side(name) for name in engines},
        ratios,
        confidence=bench.confidence,
        rel_width=bench.ci_rel_width,
        budget_s=bench.budget_s,
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
) -> InTurnRuns:
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
        with running_engine(name, settings, spec.model_dir, spec.speculation, trust_remote_code) as engine:
            version = engine.vllm_version
            passes[name] = _timed_passes(engine, name, prompts, bench, rounds, None)
            for size in levels:
                at_batch[size][name] = _timed_passes(engine, name, prompts, bench, rounds, None, size)
            if name in sampled_too and bench.serving_sampling is not None:
                sampled[name] = _timed_passes(engine, name, prompts, bench, rounds, bench.serving_sampling)
    elapsed = time.perf_counter() - start

    def paired(runs: dict[str, list[VllmGeneration]]) -> InTurn:
        return InTurn(runs, _paired_by_index(runs, rounds, bench.confidence, elapsed))

    return InTurnRuns(
        greedy=paired(passes),
        version=version,
        sampled=paired(sampled) if sampled else None,
        at_batch={size: paired(runs) for size, runs in at_batch.items()},
    )


@dataclass(frozen=True)
class InTurn:
    """Passes of engines run one at a time, and their measurement (speedups paired by pass index)."""

    passes: dict[str, list[VllmGeneration]]
    measured: Measurement


@dataclass(frozen=True)
class InTurnRuns:
    """What measure_engines_in_turn measured: greedy one request at a time, vLLM's version, sampled at the
    serving temperature (None: not asked), and greedy at each other batch size."""

    greedy: InTurn
    version: str
    sampled: InTurn | None
    at_batch: dict[int, InTurn]


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


class VllmCountingProposer:
    """A reference-decoder proposer that drafts `steps` tokens every cycle, also when the request needs
    fewer, as vLLM does (see the module's docstring): the reference decoder's acceptance counted as vLLM
    counts it."""

    def __init__(self, proposer: Any, steps: int):
        self.proposer = proposer
        self.steps = steps
        self.needs_aux = proposer.needs_aux

    def start(self, context: list[int], aux: Any) -> None:
        self.proposer.start(context, aux)

    def propose(self, context: list[int], steps: int) -> list[int]:
        return self.proposer.propose(context, self.steps)

    def accept(self, context: list[int], accepted_count: int, aux: Any) -> None:
        self.proposer.accept(context, accepted_count, aux)


@dataclass(frozen=True)
class ReferenceRun:
    """The reference decoder over some prompts: its outputs and its acceptance as vLLM's counters."""

    outputs: list[list[int]]
    spec: SpecCounters


def counters_from_histogram(histogram: list[int]) -> SpecCounters:
    """vLLM's counters for verify steps counted by drafts accepted (histogram[i]: the steps accepting i)."""
    steps = len(histogram) - 1
    drafts = sum(histogram)
    return SpecCounters(
        drafts=drafts,
        draft_tokens=drafts * steps,
        accepted_tokens=sum(i * count for i, count in enumerate(histogram)),
        accepted_per_position=[sum(histogram[i + 1 :]) for i in range(steps)],
    )


def reference_acceptance(
    model: Any,
    drafter: Any,
    aux_layer_ids: list[int],
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    steps: int,
) -> ReferenceRun:
    """The project's reference decoder (pipeline.decoding.reference_decoder.speculative_decode, a chain of
    `steps` EAGLE-3 drafts) over the prompts, its drafts counted as vLLM counts them."""
    import torch

    from pipeline.decoding.reference_decoder import EagleProposer, TargetRunner, speculative_decode

    runner = TargetRunner(model, aux_layer_ids)
    outputs, histogram = [], [0] * (steps + 1)
    with torch.inference_mode():
        for prompt in prompts:
            proposer = VllmCountingProposer(EagleProposer(drafter), steps)
            result = speculative_decode(runner, proposer, prompt, max_new_tokens, eos_id, steps)
            outputs.append(result.tokens)
            histogram = [a + b for a, b in zip(histogram, result.accepted_histogram, strict=True)]
    return ReferenceRun(outputs=outputs, spec=counters_from_histogram(histogram))


@dataclass(frozen=True)
class BesideReference:
    """A drafter served by vLLM beside the reference decoder on the same prompts: acceptance from vLLM's
    counters and from the reference decoder's drafts (counted as vLLM counts them), and vLLM's speedup
    over its own greedy decoding, measured interleaved."""

    vllm_version: str
    steps: int
    served: SpecCounters
    reference: SpecCounters
    measured: Measurement

    def taus(self) -> tuple[float, float]:
        vllm_tau, reference_tau = self.served.tau(), self.reference.tau()
        if vllm_tau is None or reference_tau is None:
            raise ValueError("no draft was verified: nothing to compare")
        return vllm_tau, reference_tau

    def tau_rel_diff(self) -> float:
        vllm_tau, reference_tau = self.taus()
        return abs(vllm_tau - reference_tau) / reference_tau


class ServedOutputsDiffer(RuntimeError):
    pass


def beside_reference(
    settings: VllmEngineConfig,
    bench: BenchmarkConfig,
    target_dir: Path,
    drafter_dir: Path,
    reference: ReferenceRun,
    prompts: list[list[int]],
    steps: int,
    trust_remote_code: bool,
) -> BesideReference:
    """vLLM's plain greedy decoding and the drafter (a chain of `steps`, the directory's vLLM ids), both
    alive at once and measured interleaved on `prompts` (bench's rounds, width and budget); every output
    must equal the reference decoder's (`reference`, from reference_acceptance on the same prompts)."""
    from pipeline.engines.vllm import eagle3_speculation

    specs = {
        "baseline": EngineSpec(target_dir),
        "candidate": EngineSpec(target_dir, eagle3_speculation(drafter_dir, steps)),
    }
    with running_engines(specs, settings, trust_remote_code) as engines:
        version = engines["baseline"].vllm_version
        passes, measured = measure_engines(engines, prompts, bench, [("candidate", "baseline")])
    differ = greedy_mismatches(passes, reference.outputs)
    if differ:
        raise ServedOutputsDiffer(
            f"vLLM's outputs differ from the reference decoder's greedy outputs on some prompts: {differ}"
        )
    served = summed_counters(passes["candidate"])
    if served is None or not served.drafts:
        raise ServedOutputsDiffer("vLLM verified no draft of the candidate: nothing to compare")
    return BesideReference(version, steps, served, reference.spec, measured)
