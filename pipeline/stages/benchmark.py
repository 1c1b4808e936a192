"""benchmark: tok/s and acceptance length of baseline, n-gram, incumbent and candidate in ONE run.

The local engine is the reference speculative decoder (pipeline.decoding.reference_decoder) over the target on
held-out prompts; methods run interleaved prompt by prompt so machine noise hits all of them alike. The vLLM
engine runs every method in its own vLLM engine, interleaved pass by pass (pipeline.engines.vllm_bench); the
SGLang engine, one server per method (pipeline.engines.sglang_bench).
n-gram runs at its best: every configured n-gram setting is measured (locally on the calibration prompts,
on SGLang one server per setting) and the candidate is compared with the fastest; the record keeps all.
Every speculative output must equal plain greedy decoding token for token, or the stage fails.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property, partial
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import torch

from pipeline import layout
from pipeline.benchmark.settings import (
    BenchmarkConfig,
    NgramLocalSetting,
    NgramServerSetting,
    ServingSampling,
    SGLangBenchConfig,
    VllmBenchConfig,
)
from pipeline.config import DEFAULT_DOMAIN, RunConfig
from pipeline.data.conversations import prompt_ids
from pipeline.data.jsonl import decode_jsonl
from pipeline.decoding.batched import BatchedTarget, EagleRows, NgramRows, batched_speculative_decode
from pipeline.decoding.choice import Choice, Shape, choose, settled, shape_label
from pipeline.decoding.reference_decoder import (
    DecodeResult,
    DraftTree,
    EagleProposer,
    NgramProposer,
    TargetRunner,
    greedy_decode,
    speculative_decode,
    tree_speculative_decode,
)
from pipeline.decoding.sampling import Sampling
from pipeline.decoding.speedup import (
    CycleTiming,
    Overhead,
    StepCosts,
    candidate_settings,
    fit_overhead,
    predicted_tau,
    rank_settings,
)
from pipeline.drafter.export import (
    CONFIG_NAME,
    architecture_of,
    copy_with_layer_ids,
    engine_layer_ids,
    engine_refusals,
    load_drafter,
    no_engine_here,
    read_drafter_dir,
    require_exported_for,
    written_layer_ids,
)
from pipeline.drafter.model import Eagle3Drafter
from pipeline.engines.target import describe_target, load_frozen_tensors, load_model, load_tokenizer
from pipeline.engines.vllm_bench import outputs_sha256
from pipeline.manifest import read_listed, read_manifest
from pipeline.ops import registry
from pipeline.progress import Progress
from pipeline.records import (
    BatchBench,
    BenchDecision,
    BenchMethods,
    BenchRecord,
    BenchVerdict,
    Calibration,
    DraftSetting,
    EvalRecord,
    MeasuredAcceptance,
    MeasuredCosts,
    MethodResult,
    NgramSettingResult,
    NgramSweep,
    PredictedVsMeasured,
    RatioInterval,
    RealEngineFigures,
    SampledBench,
    SettingChoice,
    SpeedModel,
    TimedSetting,
    UndecidedSpeedup,
    publish_record,
    read_record,
)
from pipeline.spread import Measurement, RatioEstimate, measure, ratio_from_samples
from pipeline.stages import StageInputs, StageOutput
from pipeline.stages.evaluate import local_drafter_dir
from pipeline.storage import ObjectStore

if TYPE_CHECKING:
    from pipeline.engines.vllm import VllmGeneration
    from pipeline.engines.vllm_bench import InTurn

log = logging.getLogger(__name__)

Unit = TypeVar("Unit")  # what a method decodes in one call: a prompt, or a batch of prompts


class BenchmarkFailed(RuntimeError):
    pass


def heldout_prompts(store: ObjectStore, prompts_uri: str, tokenizer, count: int) -> list[list[int]]:
    """The first user turn of up to `count` held-out conversations, taken from every domain in turn (one of
    each, then the next of each), so the benchmark covers all domains alike."""
    return heldout_set(store, prompts_uri, tokenizer, count)[0]


def heldout_set(
    store: ObjectStore, prompts_uri: str, tokenizer, count: int
) -> tuple[list[list[int]], list[str]]:
    """heldout_prompts, with each prompt's domain."""
    prefix = store.key_for(prompts_uri)
    manifest = read_manifest(store, prefix, kind="prompts")
    shards_of: dict[str, list[str]] = {}
    for shard in manifest["shards"]:
        if shard["split"] == "eval":
            shards_of.setdefault(shard.get("domain", DEFAULT_DOMAIN), []).append(shard["name"])
    streams = [
        (
            domain,
            chain.from_iterable(decode_jsonl(read_listed(store, prefix, manifest, name)) for name in names),
        )
        for domain, names in sorted(shards_of.items())
    ]
    prompts: list[list[int]] = []
    domains: list[str] = []
    while streams and len(prompts) < count:
        for domain, stream in list(streams):
            record = next(stream, None)
            if record is None:
                streams.remove((domain, stream))
                continue
            first_user = next(i for i, m in enumerate(record["messages"]) if m["role"] == "user")
            prompts.append(prompt_ids(tokenizer, record["messages"][: first_user + 1]))
            domains.append(domain)
            if len(prompts) == count:
                break
    if not prompts:
        raise BenchmarkFailed(f"prompts {prompts_uri} have no held-out (eval) conversations to benchmark on")
    return prompts, domains


def _tok_s(results: list[DecodeResult]) -> float:
    return sum(len(r.tokens) for r in results) / sum(r.seconds for r in results)


def _summary(passes: list[list[DecodeResult]]) -> MethodResult:
    """One method's figures over its passes (rounds) through the prompts."""
    results = [result for one_pass in passes for result in one_pass]
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    summary = MethodResult(
        tokens=tokens,
        seconds=round(seconds, 4),
        tok_s=round(tokens / seconds, 2),
        round_tok_s=[round(_tok_s(one_pass), 2) for one_pass in passes],
    )
    forwards = sum(r.verify_forwards for r in results)
    if forwards:
        summary.tau_measured = round(sum(r.cycle_tokens for r in results) / forwards, 4)
        histogram = [sum(h) for h in zip(*(r.accepted_histogram for r in results), strict=True)]
        summary.accepted_histogram = histogram
        summary.acceptance_per_position = [
            round(sum(histogram[i + 1 :]) / forwards, 4) for i in range(len(histogram) - 1)
        ]
    summary.outputs_sha256 = outputs_sha256(outputs_of(passes[0]))
    return summary


def outputs_of(one_pass: list[DecodeResult]) -> list[list[int]]:
    """Every sequence's output in a pass, in order (a batch's rows each count as one)."""
    return [row for result in one_pass for row in (result.rows or [result.tokens])]


def domain_summaries(
    passes: dict[str, list[list[DecodeResult]]], domains: list[str]
) -> dict[str, BenchMethods]:
    """Every method's figures on each domain's prompts (`domains`: each prompt's, in the passes' order)."""
    per_domain = {}
    for domain in sorted(set(domains)):
        indices = [i for i, prompt_domain in enumerate(domains) if prompt_domain == domain]
        per_domain[domain] = BenchMethods.model_validate(
            {
                name: _summary([[one_pass[i] for i in indices] for one_pass in runs])
                for name, runs in passes.items()
            }
        )
    return per_domain


def median_seconds(
    actions: Mapping[str, Callable[[], object]], rounds: int = 15, warmup: int = 3
) -> dict[str, float]:
    """Each action's median seconds over `rounds` interleaved rounds (every action once per round, the order
    reversed every other round) after `warmup` rounds: a machine that warms up or drifts while the forwards
    are timed shifts them all alike, not the ones timed first."""
    names = list(actions)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            actions[name]()
            if index >= warmup:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def step_costs(
    target: Callable[[], object],
    chains: Mapping[int, Callable[[], object]],
    trees: Mapping[int, Callable[[], object]],
    drafts: Mapping[int, Callable[[], object]],
) -> StepCosts:
    """StepCosts from forwards timed together (median_seconds)."""
    actions: dict[str, Callable[[], object]] = {"target": target}
    actions.update({f"chain{n}": action for n, action in chains.items()})
    actions.update({f"tree{n}": action for n, action in trees.items()})
    actions.update({f"draft{w}": action for w, action in drafts.items()})
    seconds = median_seconds(actions)
    return StepCosts(
        target_step=seconds["target"],
        verify_chain={n: seconds[f"chain{n}"] for n in chains},
        verify_tree={n: seconds[f"tree{n}"] for n in trees},
        draft={w: seconds[f"draft{w}"] for w in drafts},
    )


def measure_costs(
    model,
    drafter,
    prompt: list[int],
    aux_layer_ids: list[int],
    widths: list[int],
    chain_tokens: set[int],
    tree_tokens: set[int],
) -> StepCosts:
    """Seconds per target forward (1 token, n chained tokens, an n-token tree) and per drafter forward
    (frontier width w), on a cache already holding the prompt."""
    runner = TargetRunner(model, aux_layer_ids)
    runner.reset()
    _, aux = runner.forward(prompt)
    prefix = runner.length
    proposer = EagleProposer(drafter)
    proposer.start(list(prompt) + [prompt[-1]], aux)
    last_hidden = proposer.last_hidden
    if last_hidden is None:
        raise BenchmarkFailed("the drafter kept no hidden state after the prompt")

    def target(tokens: int):
        runner.forward(prompt[-tokens:] if tokens <= len(prompt) else [prompt[-1]] * tokens)
        runner.crop(prefix)

    def tree(tokens: int):
        nodes = DraftTree(
            tokens=[prompt[-1]] * (tokens - 1),
            parents=[-1] + list(range(tokens - 2)),
            depths=list(range(1, tokens)),
        )
        runner.forward_tree(nodes, prompt[-1])
        runner.crop(prefix)

    def draft(width: int):
        cache = proposer.cache.expanded(width)
        drafter.decode(
            last_hidden.expand(width, -1, -1),
            torch.full((width, 1), prompt[-1]),
            cache.length,
            cache,
        )

    with torch.inference_mode():
        return step_costs(
            lambda: target(1),
            {n: partial(target, n) for n in sorted(chain_tokens)},
            {n: partial(tree, n) for n in sorted(tree_tokens)},
            {w: partial(draft, w) for w in sorted(set(widths) | {1})},
        )


@dataclass
class ChosenSetting:
    """What choose_setting decided, and everything it measured on the way."""

    setting: DraftSetting  # with the prediction of the model fitted on the calibration
    ranked: list[DraftSetting]  # every setting, by the fitted model
    costs: StepCosts
    calibration: list[Calibration] = field(default_factory=list)
    overhead: Overhead | None = None
    choice: SettingChoice | None = None


def shortlist_settings(ranked: list[DraftSetting], best: int) -> list[DraftSetting]:
    """The `best` settings the model predicts fastest, and the best predicted of each tree width (the
    chain's included), in rank order: what calibration times."""
    shortlist = ranked[:best]
    for topk in sorted({s.topk for s in ranked}):
        if not any(s.topk == topk for s in shortlist):
            shortlist.append(next(s for s in ranked if s.topk == topk))
    return shortlist


def setting_shape(setting: DraftSetting) -> Shape:
    return (setting.steps, setting.topk, setting.draft_tokens)


def choose_setting(
    evaluation: EvalRecord,
    model,
    tokenizer,
    drafter,
    prompts: list[list[int]],
    aux_layer_ids: list[int],
    settings: BenchmarkConfig,
) -> ChosenSetting:
    """The draft setting to benchmark. The speed model ranks every setting from the evaluation's acceptance
    and measured forward costs; the best few (and the best of each tree width) are timed beside plain
    decoding, prompt by prompt (calibrate); the fastest measured wins, or the simplest setting within its
    noise (pipeline.decoding.choice). The bookkeeping the forwards leave out is fitted on the timed
    settings, and every setting re-ranked with it."""
    max_steps = min(settings.max_draft_steps, len(evaluation.full_acc))
    widths = settings.tree_widths if settings.auto_select else [1]
    grid = (
        candidate_settings(max_steps, tuple(widths), settings.max_draft_tokens)
        if settings.auto_select
        else [(settings.draft_steps, 1, settings.draft_steps + 1)]
    )
    costs = measure_costs(
        model,
        drafter,
        prompts[0],
        aux_layer_ids,
        widths,
        {n for _, k, n in grid if k == 1},
        {n for _, k, n in grid if k > 1},
    )
    ranked = rank_settings(evaluation, costs, grid)
    if not ranked:
        raise BenchmarkFailed("no draft setting can be predicted from this evaluation")
    shortlist = shortlist_settings(ranked, settings.calibration_candidates)
    if len(shortlist) == 1:
        return ChosenSetting(shortlist[0], ranked, costs)
    eos = tokenizer.eos_token_id
    phases = [calibrate(model, drafter, aux_layer_ids, shortlist, prompts, settings, eos)]
    overhead, refitted = refit(evaluation, costs, grid, phases)
    choice = phases[0].choice
    # settings the model ranks among the best once it knows the bookkeeping, not yet timed: timed against
    # the first phase's fastest and every setting tied with it, and the choice made among those
    timed = {setting_shape(s) for s in shortlist}
    newcomers = [
        s
        for s in shortlist_settings(refitted, settings.calibration_candidates)
        if setting_shape(s) not in timed
    ]
    if newcomers:
        contenders = [s for s in shortlist if shape_label(setting_shape(s)) in choice.tied] + newcomers
        phases.append(calibrate(model, drafter, aux_layer_ids, contenders, prompts, settings, eos))
        overhead, refitted = refit(evaluation, costs, grid, phases)
        choice = phases[-1].choice
    by_shape = {setting_shape(s): s for s in refitted}
    chosen = by_shape[phases[-1].shape_of(choice.chosen)]
    log.info("benchmark: %s (calibration: %s)", choice.reason, "; ".join(phase.line() for phase in phases))
    latest = {shape: (index, phase) for index, phase in enumerate(phases, 1) for shape in phase.shapes}
    forwards_only = {setting_shape(s): s for s in ranked}
    return ChosenSetting(
        setting=chosen,
        ranked=refitted,
        costs=costs,
        calibration=[
            phase.record(forwards_only[shape], by_shape[shape].speedup, index)
            for shape, (index, phase) in latest.items()
        ],
        overhead=overhead,
        choice=setting_choice(choice, phases[-1].prompts, phases[-1].measured, len(phases)),
    )


def refit(
    evaluation: EvalRecord, costs: StepCosts, grid: list[Shape], phases: list[Calibrated]
) -> tuple[Overhead, list[DraftSetting]]:
    """The bookkeeping fitted on every calibration phase's measured cycles (and plain decoding's steps), and
    every setting ranked again with it."""
    cycles = [
        CycleTiming(shape[1], shape[2], costs.cycle(*shape), phase.seconds_per_cycle(shape))
        for phase in phases
        for shape in phase.shapes
    ]
    plain = [r for phase in phases for r in phase.results["baseline"]]
    per_token = sum(r.seconds for r in plain) / max(sum(len(r.tokens) for r in plain), 1)
    overhead = fit_overhead(cycles, costs.target_step, per_token)
    return overhead, rank_settings(evaluation, costs, grid, overhead)


@dataclass
class Calibrated:
    """Plain decoding and some settings timed prompt by prompt (calibrate): every decode, by side name
    (baseline, or the setting's shape_label), and the measurement that ran them."""

    results: dict[str, list[DecodeResult]]
    measured: Measurement
    prompts: int
    shapes: list[Shape]

    def shape_of(self, name: str) -> Shape:
        return next(shape for shape in self.shapes if shape_label(shape) == name)

    @cached_property
    def choice(self) -> Choice:
        return choose(self.measured, {shape_label(shape): shape for shape in self.shapes})

    def seconds_per_cycle(self, shape: Shape) -> float:
        results = self.results[shape_label(shape)]
        return sum(r.seconds for r in results) / max(sum(r.verify_forwards for r in results), 1)

    def record(self, setting: DraftSetting, predicted_speedup: float, phase: int) -> Calibration:
        shape = setting_shape(setting)
        name, choice = shape_label(shape), self.choice
        summary = _summary([self.results[name]])
        return Calibration(
            setting=setting,
            tok_s=summary.tok_s,
            tau_measured=summary.tau_measured,
            speedup=interval(self.measured.ratio(name, "baseline")),
            vs_fastest=interval(choice.vs_fastest[name]) if name in choice.vs_fastest else None,
            predicted_speedup=predicted_speedup,
            seconds_per_cycle=round(self.seconds_per_cycle(shape), 6),
            phase=phase,
        )

    def line(self) -> str:
        speedups = {
            shape_label(shape): round(self.measured.ratio(shape_label(shape), "baseline").ratio, 3)
            for shape in self.shapes
        }
        measured = self.measured
        return f"{measured.rounds} prompts per setting, stopped by {measured.stopped_by}, speedups {speedups}"


def calibrate(
    model,
    drafter,
    aux_layer_ids: list[int],
    shortlist: list[DraftSetting],
    prompts: list[list[int]],
    settings: BenchmarkConfig,
    eos: int | None,
) -> Calibrated:
    """Plain decoding and every shortlisted setting on the calibration prompts, interleaved prompt by prompt
    (a round decodes one prompt with each, in alternating order; the prompts in turn, every one at least
    once after a warm-up round) until the choice is settled (pipeline.decoding.choice.settled) or
    benchmark.calibration_budget_s is spent. Each decode's tokens/s is one sample; a setting's speed over
    another's is paired by prompt. Every output must equal plain greedy decoding."""
    calibration = prompts[: settings.calibration_prompts]
    plain, with_aux = TargetRunner(model, None), TargetRunner(model, aux_layer_ids)
    new_tokens = settings.max_new_tokens
    methods = {"baseline": lambda p: greedy_decode(plain, p, new_tokens, eos)}
    for setting in shortlist:
        methods[shape_label(setting_shape(setting))] = eagle_method(
            with_aux, drafter, setting, new_tokens, eos
        )
    results: dict[str, list[DecodeResult]] = {name: [] for name in methods}
    progress = Progress(desc="calibration", unit="prompt")

    def side(name: str) -> Callable[[], float]:
        def decode_next_prompt() -> float:
            decoded = methods[name](calibration[len(results[name]) % len(calibration)])
            results[name].append(decoded)
            if name == "baseline":
                progress.update(1)
            return len(decoded.tokens) / decoded.seconds

        return decode_next_prompt

    labels = [name for name in methods if name != "baseline"]
    with torch.inference_mode():
        measured = measure(
            {name: side(name) for name in methods},
            [],
            confidence=settings.confidence,
            budget_s=settings.calibration_budget_s,
            min_rounds=max(2, len(calibration)),
            max_rounds=10_000,
            warmup=1,
            decided=settled(labels, settings.confidence, settings.calibration_resolution),
        )
    progress.close()
    for name in results:
        del results[name][: len(results[name]) - measured.rounds]
    greedy = [r.tokens for r in results["baseline"]]
    differ = [name for name in labels if [r.tokens for r in results[name]] != greedy]
    if differ:
        raise BenchmarkFailed(f"calibration: speculative outputs differ from greedy decoding with {differ}")
    return Calibrated(results, measured, len(calibration), [setting_shape(s) for s in shortlist])


def required_tau(evaluation: EvalRecord, shape: Shape) -> float:
    """The speed model's tokens per cycle for a configured setting, or a clear error when the evaluation did
    not simulate that tree (an evaluation from before shapes were simulated, or for another setting)."""
    tau = predicted_tau(evaluation, *shape)
    if tau is None:
        raise BenchmarkFailed(
            f"the evaluation has no simulated acceptance for the draft tree {shape_label(shape)} (steps, "
            "topk, draft tokens) the benchmark runs: evaluate again with this config "
            "(evaluate.simulated_anchors > 0)"
        )
    return tau


def eagle_method(
    runner: TargetRunner,
    drafter,
    setting: DraftSetting,
    max_new_tokens: int,
    eos: int | None,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
):
    """The drafter's chain or tree, greedy or sampled (`sampling`, drawing from `generator`)."""
    if setting.topk == 1:
        return lambda p: speculative_decode(
            runner, EagleProposer(drafter), p, max_new_tokens, eos, setting.steps, sampling, generator
        )
    return lambda p: tree_speculative_decode(
        runner,
        EagleProposer(drafter),
        p,
        max_new_tokens,
        eos,
        setting.steps,
        setting.topk,
        setting.draft_tokens,
        sampling,
        generator,
    )


def ngram_method(runner: TargetRunner, setting: NgramLocalSetting, max_new_tokens: int, eos: int | None):
    """The reference decoder's n-gram (prompt-lookup) speculation with one setting."""
    return lambda p: speculative_decode(
        runner,
        NgramProposer(setting.max_match, setting.min_match),
        p,
        max_new_tokens,
        eos,
        setting.steps,
    )


def fastest_ngram(settings: list[NgramSettingResult], measured_on: str) -> NgramSweep:
    """The sweep's record: every setting's figures, and the fastest (highest tokens/s; the first of equals)
    as the n-gram the candidate must beat."""
    if not settings:
        raise BenchmarkFailed("no n-gram setting was measured")
    best = max(settings, key=lambda entry: entry.result.tok_s)
    return NgramSweep(measured_on=measured_on, settings=settings, best=best.setting)


def sweep_ngram(
    model, tokenizer, prompts: list[list[int]], settings: BenchmarkConfig
) -> tuple[NgramLocalSetting, NgramSweep]:
    """Every configured n-gram setting timed on the calibration prompts (after a warm-up prompt), as the
    candidate's own setting is; the fastest is the n-gram the benchmark then measures against it."""
    runner = TargetRunner(model, None)
    calibration = prompts[: settings.calibration_prompts]
    results = []
    with torch.inference_mode():
        for setting in settings.ngram_settings:
            method = ngram_method(runner, setting, settings.max_new_tokens, tokenizer.eos_token_id)
            method(prompts[0])  # warm-up
            results.append(
                NgramSettingResult(
                    setting=setting.label,
                    knobs=setting.model_dump(),
                    result=_summary([[method(p) for p in calibration]]),
                )
            )
    sweep = fastest_ngram(results, f"the first {len(calibration)} benchmark prompts (calibration)")
    chosen = next(s for s in settings.ngram_settings if s.label == sweep.best)
    log.info("benchmark: n-gram at its fastest with %s of %d settings", sweep.best, len(results))
    return chosen, sweep


def _side(
    method: Callable[[Unit], DecodeResult], prompts: list[Unit], passes: list[list[DecodeResult]]
) -> Callable[[], float]:
    """One method as a side of pipeline.spread.measure: each call is one pass over every prompt and
    returns its tokens/s (all tokens over all seconds, the figure the record reports)."""

    def decode_all() -> float:
        passes.append([method(prompt) for prompt in prompts])
        return _tok_s(passes[-1])

    return decode_all


class Passes(dict[str, list[list[DecodeResult]]]):
    """Each method's measured passes (rounds) over the prompts, and the measurement that ran them."""

    measured: Measurement


def interleaved_passes(
    methods: dict[str, Callable[[Unit], DecodeResult]],
    prompts: list[Unit],
    settings: BenchmarkConfig,
    what: str,
) -> Passes:
    """The methods on the same prompts (or batches of prompts), interleaved pass by pass
    (pipeline.spread.measure; a round is one pass of each method over every prompt): at least `repeats` (and
    3) measured passes, then more until the candidate's speedup over every other method is `ci_rel_width`
    narrow or `budget_s` is spent. The warm-up round is dropped."""
    passes = Passes({name: [] for name in methods})
    sides = {name: _side(method, prompts, passes[name]) for name, method in methods.items()}
    min_rounds = max(3, settings.repeats)
    progress = Progress(desc=what, unit="round")  # how many rounds the interval needs is not known
    decode_baseline = sides["baseline"]

    def baseline_with_progress() -> float:
        tok_s = decode_baseline()
        progress.update(1)
        return tok_s

    sides["baseline"] = baseline_with_progress
    with torch.inference_mode():
        measured = measure(
            sides,
            [("candidate", other) for other in methods if other != "candidate"],
            confidence=settings.confidence,
            rel_width=settings.ci_rel_width,
            budget_s=settings.budget_s,
            min_rounds=min_rounds,
            max_rounds=max(min_rounds, 10_000),
        )
    progress.close()
    log.info("%s: %d rounds, stopped by %s", what, measured.rounds, measured.stopped_by)
    for name in passes:
        del passes[name][: len(passes[name]) - measured.rounds]
    passes.measured = measured
    return passes


def compare_sampled(
    model,
    tokenizer,
    prompts: list[list[int]],
    drafters: dict[str, Eagle3Drafter],
    aux_layer_ids: list[int],
    settings: BenchmarkConfig,
    setting: DraftSetting,
    serving: ServingSampling,
) -> SampledBench:
    """Baseline and the drafters sampled at the serving temperature, interleaved as compare_methods runs
    them, each method drawing from a generator of its own (seeded: a rerun draws the same)."""
    sampling = Sampling(serving.temperature, serving.top_p, serving.top_k)
    plain = TargetRunner(model, None)
    with_aux = TargetRunner(model, aux_layer_ids)
    eos = tokenizer.eos_token_id
    draws = {name: torch.Generator().manual_seed(seed) for seed, name in enumerate(["baseline", *drafters])}
    methods = {
        "baseline": lambda p: greedy_decode(
            plain, p, settings.max_new_tokens, eos, sampling, draws["baseline"]
        )
    }
    for name, drafter in drafters.items():
        methods[name] = eagle_method(
            with_aux, drafter, setting, settings.max_new_tokens, eos, sampling, draws[name]
        )
    passes = interleaved_passes(methods, prompts, settings, f"benchmark at temperature {serving.temperature}")
    summaries = {name: _summary(runs) for name, runs in passes.items()}
    return sampled_bench(serving, summaries, lambda other: passes.measured.ratio("candidate", other))


def sampled_bench(
    serving: ServingSampling, methods: dict[str, MethodResult], ratio: Callable[[str], RatioEstimate]
) -> SampledBench:
    """The record of a measurement at the serving temperature: each method's figures, and the candidate's
    speedup over every other method (`ratio(other)`: the candidate's tokens/s over other's)."""
    return SampledBench(
        temperature=serving.temperature,
        top_p=serving.top_p,
        top_k=serving.top_k,
        methods=methods,
        speedups={other: interval(ratio(other)) for other in methods if other != "candidate"},
    )


def compare_methods(
    model,
    tokenizer,
    prompts: list[list[int]],
    drafters: dict[str, Eagle3Drafter],
    aux_layer_ids: list[int],
    settings: BenchmarkConfig,
    setting: DraftSetting,
    ngram: NgramLocalSetting,
    domains: list[str] | None = None,
) -> tuple[BenchMethods, dict[str, RatioInterval], dict[str, BenchMethods]]:
    """Every method greedy on the same prompts, interleaved (interleaved_passes); n-gram runs with `ngram`
    (the sweep's fastest setting). Outputs are checked against greedy decoding. Also returns the figures
    per domain (`domains`: each prompt's; default: all in DEFAULT_DOMAIN)."""
    plain = TargetRunner(model, None)
    with_aux = TargetRunner(model, aux_layer_ids)
    eos = tokenizer.eos_token_id
    methods = {
        "baseline": lambda p: greedy_decode(plain, p, settings.max_new_tokens, eos),
        "ngram": ngram_method(plain, ngram, settings.max_new_tokens, eos),
    }
    for name, drafter in drafters.items():
        methods[name] = eagle_method(with_aux, drafter, setting, settings.max_new_tokens, eos)
    passes = interleaved_passes(methods, prompts, settings, "benchmark")
    others = [name for name in methods if name != "candidate"]
    greedy = [r.tokens for one_pass in passes["baseline"] for r in one_pass]
    mismatches = {
        name: sum(r.tokens != tokens for r, tokens in zip((r for p in runs for r in p), greedy, strict=True))
        for name, runs in passes.items()
    }
    bad = {name: n for name, n in mismatches.items() if n}
    if bad:
        raise BenchmarkFailed(f"speculative outputs differ from greedy decoding on some prompts: {bad}")
    speedups = {other: interval(passes.measured.ratio("candidate", other)) for other in others}
    per_domain = domain_summaries(passes, domains or [DEFAULT_DOMAIN] * len(prompts))
    return (
        BenchMethods.model_validate({name: _summary(p) for name, p in passes.items()}),
        speedups,
        per_domain,
    )


def interval(estimate: RatioEstimate) -> RatioInterval:
    return RatioInterval.model_validate(estimate.as_dict())


SLOWER_THAN_INCUMBENT = "; upper bound < 1: measurably slower than the incumbent, never promoted"
Compared = Literal["faster", "slower", "undecided"]


def compared(ci_low: float, ci_high: float, required: float, incumbent: bool) -> Compared:
    """What one speedup interval decides by the promotion rule: faster when its lower bound clears
    `required` (against the incumbent, also not wholly under 1); slower when its upper bound is under
    `required`, or under 1 against the incumbent; undecided while it holds the threshold."""
    if incumbent and ci_high < 1.0:
        return "slower"
    if ci_low >= required:
        return "faster"
    return "slower" if ci_high < required else "undecided"


def width_to_decide(ratio: float, required: float, incumbent: bool) -> float:
    """The widest relative interval around `ratio` on which the promotion rule (`compared`) decides.
    pipeline.spread's intervals lie at ratio * e^(+-h), of relative width 2 sinh(h): the rule decides once
    the interval no longer reaches a threshold it held, so the candidates for h are the distances from the
    ratio to each threshold (`required`, and 1 against the incumbent), the widest that decides wins.
    0 when the ratio sits on a threshold (no interval decides)."""
    thresholds = {required, 1.0} if incumbent else {required}
    for distance in sorted((abs(math.log(ratio / t)) for t in thresholds if t > 0), reverse=True):
        half = distance * (1 - 1e-9)  # just inside: the bound no longer touches the threshold
        if compared(ratio * math.exp(-half), ratio * math.exp(half), required, incumbent) != "undecided":
            return 2 * math.sinh(half)
    return 0.0


def undecided_speedup(
    comparison: str, method: str, batch: int, speedup: RatioInterval, required: float
) -> UndecidedSpeedup:
    return UndecidedSpeedup(
        comparison=comparison,
        method=method,
        batch_size=batch,
        ratio=speedup.ratio,
        ci_low=speedup.ci_low,
        ci_high=speedup.ci_high,
        rounds=speedup.rounds,
        required=required,
        width_reached=(speedup.ci_high - speedup.ci_low) / speedup.ratio,
        width_needed=width_to_decide(speedup.ratio, required, method == "incumbent"),
    )


def more_measurement(settings: BenchmarkConfig) -> str:
    """How this engine's benchmark measures more rounds (and so narrower intervals) on a rerun."""
    if settings.engine == "sglang" and settings.sglang is not None:
        return (
            f"rerun while its servers serve nothing else, or raise benchmark.sglang.rounds (now "
            f"{settings.sglang.rounds}) and benchmark.num_prompts to fill them"
        )
    if settings.engine == "vllm" and not (settings.vllm or VllmBenchConfig()).engines_at_once:
        return (
            f"rerun on a quiet machine, or raise benchmark.repeats (now {settings.repeats}; each engine "
            "runs max(3, repeats) passes)"
        )
    return f"rerun on a quiet machine, or raise benchmark.budget_s (now {settings.budget_s:g} s)"


def next_step(settings: BenchmarkConfig, undecided: list[UndecidedSpeedup]) -> str:
    """What to do about an inconclusive benchmark: the widths it reached and needed, and how to measure
    more. An interval narrows about as 1/sqrt(rounds) at the same noise."""
    widths = "; ".join(
        f"{entry.comparison}: relative width {entry.width_reached:.3f} reached, "
        f"{entry.width_needed:.3f} needed"
        for entry in undecided
    )
    return f"the speedup intervals stayed too wide to decide ({widths}): {more_measurement(settings)}"


def speedup_reason(name: str, speedup: RatioInterval, required: float, against_incumbent: bool) -> str:
    """One reason of the promotion decision: the interval, and whether its lower bound clears `required`."""
    ok = speedup.ci_low >= required
    behind = against_incumbent and speedup.ci_high < 1.0
    return (
        f"{name} {speedup.ratio:.3f} ({speedup.confidence:.0%} interval {speedup.ci_low:.3f}-"
        f"{speedup.ci_high:.3f}, {speedup.rounds} rounds): lower bound {'>=' if ok else '<'} "
        f"required {required}" + (SLOWER_THAN_INCUMBENT if behind else "")
    )


def promotion_decision(
    speedups: dict[str, RatioInterval],
    settings: BenchmarkConfig,
    batches: Mapping[int, dict[str, RatioInterval]] | None = None,
) -> BenchDecision:
    """Promotable when the LOWER bound of every speedup's interval clears its threshold, at every batch size
    benchmark.promote_at_batch_sizes names: a candidate is faster only when the noise of the measurement
    cannot explain it. Whatever min_speedup_vs_incumbent allows, a candidate measurably slower than the
    incumbent (the interval's UPPER bound below 1) never promotes. `speedups` are the headline batch
    size's, `batches` the other measured sizes'.

    The verdict tells a slower candidate from one the benchmark could not judge: slower when an interval
    lies under its threshold; inconclusive when none does but some still holds its threshold while wider
    than benchmark.ci_rel_width (the budget ran out first: the record keeps the widths reached and needed,
    and `next_step` says how to rerun); an interval that reached benchmark.ci_rel_width and still holds its
    threshold is not measurably faster, a refusal."""
    required = {
        "baseline": settings.min_speedup_vs_baseline,
        "ngram": settings.min_speedup_vs_ngram,
        "incumbent": settings.min_speedup_vs_incumbent,
    }
    measured = {settings.headline_batch_size(): speedups, **(batches or {})}
    gated = settings.gated_batch_sizes()
    named = gated != [settings.headline_batch_size()]
    reasons: list[str] = []
    seen: set[str] = set()
    undecided: list[UndecidedSpeedup] = []
    for batch in gated:
        at = f" at batch {batch}" if named else ""
        if batch not in measured:
            seen.add("refused")
            reasons.append(
                f"candidate speed{at}: not measured, and benchmark.promote_at_batch_sizes needs it"
            )
            continue
        for other, speedup in measured[batch].items():
            against_incumbent = other == "incumbent"
            reasons.append(
                speedup_reason(f"candidate/{other} speed{at}", speedup, required[other], against_incumbent)
            )
            outcome = compared(speedup.ci_low, speedup.ci_high, required[other], against_incumbent)
            if outcome != "undecided":
                seen.add(outcome)
                continue
            entry = undecided_speedup(f"candidate/{other}{at}", other, batch, speedup, required[other])
            # wider than the benchmark aims for: its budget ran out first; as narrow: not measurably faster
            too_wide = entry.width_reached > settings.ci_rel_width
            seen.add("inconclusive" if too_wide else "refused")
            undecided += [entry] if too_wide else []
    verdict: BenchVerdict = next((v for v in ("slower", "refused", "inconclusive") if v in seen), "faster")
    inconclusive = verdict == "inconclusive"
    return BenchDecision(
        promotable=verdict == "faster",
        reasons=reasons,
        verdict=verdict,
        undecided=undecided if inconclusive else [],
        next_step=next_step(settings, undecided) if inconclusive else None,
    )


def record_decision(record: BenchRecord, settings: BenchmarkConfig) -> BenchDecision:
    """The promotion decision over everything the record measured, every batch size included."""
    return promotion_decision(
        record.speedups, settings, {batch.batch_size: batch.speedups for batch in record.batches}
    )


def bench_record(
    config: RunConfig,
    run_id: str,
    prompts: int,
    engine: Literal["local", "sglang", "vllm"],
    setting: tuple[int, int, int],
    tau_simulated: float,
    methods: BenchMethods,
    speedups: dict[str, RatioInterval],
    ngram_sweep: NgramSweep,
    speed_model: SpeedModel | None = None,
) -> BenchRecord:
    """The record of one benchmark: the (steps, topk, draft tokens) setting it ran, every method's
    figures (n-gram's at its fastest setting, every setting in `ngram_sweep`), the candidate's headline
    figures and the promotion decision."""
    candidate, baseline = methods.candidate, methods.baseline
    return BenchRecord(
        engine=engine,
        draft_steps=setting[0],
        topk=setting[1],
        draft_tokens=setting[2],
        tau_simulated=tau_simulated,
        tau_measured=candidate.tau_measured,
        baseline_tok_s=baseline.tok_s,
        drafter_tok_s=candidate.tok_s,
        speedup_vs_baseline=round(speedups["baseline"].ratio, 4),
        speedup_vs_ngram=round(speedups["ngram"].ratio, 4),
        speedups=speedups,
        run_id=run_id,
        prompts=prompts,
        max_new_tokens=config.benchmark.max_new_tokens,
        methods=methods,
        speed_model=speed_model,
        decision=promotion_decision(speedups, config.benchmark),
        ngram_sweep=ngram_sweep,
    )


def local_record(
    config: RunConfig,
    target,
    tokenizer,
    drafter_dirs: dict[str, Path],
    prompts: list[list[int]],
    evaluation: EvalRecord,
    aux_layer_ids: list[int],
    run_id: str,
    domains: list[str] | None = None,
) -> BenchRecord:
    """The reference decoder on this machine: costs measured, best setting chosen, every method run, its
    figures pooled and per domain (`domains`: each prompt's)."""
    settings = config.benchmark
    frozen = load_frozen_tensors(target.model_dir)
    drafters = {name: load_drafter(path, frozen["embed"].float())[0] for name, path in drafter_dirs.items()}
    model = load_model(target.model_dir, trust_remote_code=config.target.trust_remote_code)
    decided = choose_setting(
        evaluation, model, tokenizer, drafters["candidate"], prompts, aux_layer_ids, settings
    )
    chosen = decided.setting
    ngram, ngram_sweep = sweep_ngram(model, tokenizer, prompts, settings)
    methods, speedups, per_domain = compare_methods(
        model, tokenizer, prompts, drafters, aux_layer_ids, settings, chosen, ngram, domains
    )
    speedup = round(speedups["baseline"].ratio, 4)
    speed_model = SpeedModel(
        costs=MeasuredCosts.model_validate(decided.costs.as_dict()),
        chosen=chosen,
        calibration=decided.calibration,
        predicted_vs_measured=PredictedVsMeasured(
            tau=(chosen.tau, methods.candidate.tau_measured), speedup=(chosen.speedup, speedup)
        ),
        ranked=decided.ranked[:10],
        overhead=decided.overhead.as_dict() if decided.overhead is not None else None,
        choice=decided.choice,
    )
    setting = (chosen.steps, chosen.topk, chosen.draft_tokens)
    record = bench_record(
        config,
        run_id,
        len(prompts),
        "local",
        setting,
        chosen.tau,
        methods,
        speedups,
        ngram_sweep,
        speed_model,
    )
    record.domains = per_domain
    if settings.serving_sampling is not None:
        record.sampled = compare_sampled(
            model, tokenizer, prompts, drafters, aux_layer_ids, settings, chosen, settings.serving_sampling
        )
    record.batches = [
        batch_bench(
            model, tokenizer, prompts, drafters, aux_layer_ids, settings, evaluation, ngram, size, methods
        )
        for size in settings.measured_batch_sizes()
        if size != 1
    ]
    if settings.vllm_beside_reference:
        record.real_engine = served_beside_reference(
            config,
            target.model_dir,
            model,
            drafters["candidate"],
            drafter_dirs["candidate"],
            prompts,
            chosen.steps,
            run_id,
        )
    return record


def batches_of(prompts: list[list[int]], size: int) -> list[list[list[int]]]:
    """Every prompt, in order, in batches of `size`; the last batch filled up from the first prompts, so every
    batch measures that batch size."""
    count = -(-len(prompts) // size)
    return [[prompts[(i * size + j) % len(prompts)] for j in range(size)] for i in range(count)]


def measure_batch_costs(
    model, drafter, prompt: list[int], aux_layer_ids: list[int], batch: int, chain_tokens: set[int]
) -> StepCosts:
    """StepCosts of chains at a batch size: seconds per target forward of n tokens in every row, and per
    drafter forward of one token in every row, on caches already holding `batch` copies of the prompt."""
    target = BatchedTarget(model, aux_layer_ids)
    drafting = EagleRows(drafter)
    contexts = [list(prompt) + [prompt[-1]]] * batch

    def verify(tokens: int) -> None:
        target.forward([[prompt[-1]] * tokens] * batch)
        target.drop_last_block()

    with torch.inference_mode():
        target.reset(batch)
        _, aux, counts = target.forward([prompt] * batch)
        target.commit(torch.ones(batch, len(prompt), dtype=torch.bool))
        drafting.start(contexts, aux, counts)
        return step_costs(
            lambda: verify(1),
            {n: partial(verify, n) for n in sorted(chain_tokens)},
            {},
            {1: lambda: drafting.propose(contexts, [2] * batch)},
        )


def batch_bench(
    model,
    tokenizer,
    prompts: list[list[int]],
    drafters: dict[str, Eagle3Drafter],
    aux_layer_ids: list[int],
    settings: BenchmarkConfig,
    evaluation: EvalRecord,
    ngram: NgramLocalSetting,
    batch: int,
    at_batch_1: BenchMethods,
) -> BatchBench:
    """Every method decoding the prompts `batch` at a time with the reference decoder's batched decoding,
    interleaved batch pass by pass: the drafters draft the chain the speed model ranks fastest from costs
    measured at this batch size, n-gram its fastest setting at batch 1. Every output must equal the
    baseline's at batch 1 (`at_batch_1`), or the stage fails."""
    chains = [
        (steps, 1, steps + 1)
        for steps in range(1, min(settings.max_draft_steps, len(evaluation.full_acc)) + 1)
    ]
    costs = measure_batch_costs(
        model, drafters["candidate"], prompts[0], aux_layer_ids, batch, {n for _, _, n in chains}
    )
    ranked = rank_settings(evaluation, costs, chains)
    if not ranked:
        raise BenchmarkFailed(f"no chain at batch {batch} can be predicted from this evaluation")
    chosen = ranked[0]
    eos, new_tokens = tokenizer.eos_token_id, settings.max_new_tokens
    plain, with_aux = BatchedTarget(model, None), BatchedTarget(model, aux_layer_ids)
    lookup = NgramProposer(ngram.max_match, ngram.min_match)
    methods: dict[str, Callable[[list[list[int]]], DecodeResult]] = {
        "baseline": lambda rows: batched_speculative_decode(plain, None, rows, new_tokens, eos, 1),
        "ngram": lambda rows: batched_speculative_decode(
            plain, NgramRows(lookup), rows, new_tokens, eos, ngram.steps
        ),
    }
    for name, drafter in drafters.items():
        methods[name] = _batched_eagle(with_aux, drafter, new_tokens, eos, chosen.steps)
    passes = interleaved_passes(methods, batches_of(prompts, batch), settings, f"benchmark at batch {batch}")
    require_batch_outputs(passes, len(prompts), at_batch_1, batch)
    figures = BenchMethods.model_validate({name: _summary(runs) for name, runs in passes.items()})
    speedups = {
        other: interval(passes.measured.ratio("candidate", other))
        for other in methods
        if other != "candidate"
    }
    log.info(
        "benchmark at batch %d: chain of %d, speedup %.3f [%.3f, %.3f] (predicted %.3f)",
        batch,
        chosen.steps,
        speedups["baseline"].ratio,
        speedups["baseline"].ci_low,
        speedups["baseline"].ci_high,
        chosen.speedup,
    )
    return BatchBench(
        batch_size=batch,
        draft_steps=chosen.steps,
        topk=1,
        draft_tokens=chosen.draft_tokens,
        speedups=speedups,
        tau_measured=figures.candidate.tau_measured,
        predicted_tau=chosen.tau,
        predicted_speedup=chosen.speedup,
        methods=figures,
        costs=MeasuredCosts.model_validate(costs.as_dict()),
        ranked=ranked,
    )


def _batched_eagle(
    target: BatchedTarget, drafter: Eagle3Drafter, max_new_tokens: int, eos: int | None, steps: int
) -> Callable[[list[list[int]]], DecodeResult]:
    return lambda rows: batched_speculative_decode(
        target, EagleRows(drafter), rows, max_new_tokens, eos, steps
    )


def require_batch_outputs(
    passes: dict[str, list[list[DecodeResult]]], prompts: int, at_batch_1: BenchMethods, batch: int
) -> None:
    """BenchmarkFailed unless every method's batched outputs equal the batched baseline's, and those equal
    the baseline's at batch 1 (each sequence's own greedy decoding)."""
    greedy = outputs_of(passes["baseline"][0])
    bad = {
        name: sum(outputs_of(one_pass) != greedy for one_pass in runs)
        for name, runs in passes.items()
        if any(outputs_of(one_pass) != greedy for one_pass in runs)
    }
    if bad:
        raise BenchmarkFailed(f"outputs at batch {batch} differ from batched greedy decoding (passes): {bad}")
    if outputs_sha256(greedy[:prompts]) != at_batch_1.baseline.outputs_sha256:
        raise BenchmarkFailed(
            f"batched greedy decoding at batch {batch} differs from decoding each prompt alone"
        )


def served_beside_reference(
    config: RunConfig,
    target_dir: Path,
    model,
    drafter: Eagle3Drafter,
    drafter_dir: Path,
    prompts: list[list[int]],
    steps: int,
    run_id: str,
) -> RealEngineFigures | None:
    """The candidate also served by vLLM (a chain of the chosen setting's `steps`) beside the reference
    decoder on the same prompts (pipeline.engines.vllm_bench.beside_reference): None, with a log line saying
    how to get vLLM, when its Python is missing. Outputs that differ from the reference decoder's fail."""
    from pipeline.engines.vllm_bench import ServedOutputsDiffer, beside_reference, reference_acceptance

    settings = config.benchmark.vllm or VllmBenchConfig()
    if not Path(settings.python).is_file():
        log.info(
            "benchmark: vLLM's Python %s is missing, so the candidate is not also served by vLLM; "
            "`make vllm-venv` adds vLLM's figures beside the reference decoder's",
            settings.python,
        )
        return None
    drafter_config = json.loads((drafter_dir / CONFIG_NAME).read_text())
    refusal = no_engine_here(drafter_config)  # this vLLM is the CPU build: its MLA runs 576-wide latents only
    if refusal is not None:
        log.info(
            "benchmark: the %s candidate is not also served by vLLM: %s",
            architecture_of(drafter_config),
            refusal,
        )
        return None
    served_dir = vllm_loadable("candidate", drafter_dir, config.storage.run_workdir(run_id))
    aux_layer_ids = read_drafter_dir(drafter_dir)[2]["aux_layer_ids"]
    eos = load_tokenizer(target_dir, config.target.trust_remote_code).eos_token_id
    bench = config.benchmark
    reference = reference_acceptance(model, drafter, aux_layer_ids, prompts, bench.max_new_tokens, eos, steps)
    try:
        served = beside_reference(
            settings,
            bench,
            target_dir,
            served_dir,
            reference,
            prompts,
            steps,
            config.target.trust_remote_code,
        )
    except ServedOutputsDiffer as err:
        raise BenchmarkFailed(str(err)) from err
    vllm_tau, reference_tau = served.taus()
    speedup = interval(served.measured.ratio("candidate", "baseline"))
    log.info(
        "benchmark: served by vLLM %s: tau %.3f (reference decoder %.3f), speedup %.3f [%.3f, %.3f]",
        served.vllm_version,
        vllm_tau,
        reference_tau,
        speedup.ratio,
        speedup.ci_low,
        speedup.ci_high,
    )
    return RealEngineFigures(
        engine="vllm",
        engine_version=served.vllm_version,
        draft_steps=steps,
        tau=round(vllm_tau, 4),
        reference_tau=round(reference_tau, 4),
        tau_rel_diff=round(served.tau_rel_diff(), 4),
        acceptance_per_position=[round(p, 4) for p in served.served.per_position_acceptance()],
        reference_acceptance_per_position=[round(p, 4) for p in served.reference.per_position_acceptance()],
        baseline_tok_s=round(served.measured.geomean("baseline"), 2),
        drafter_tok_s=round(served.measured.geomean("candidate"), 2),
        speedup_vs_baseline=speedup,
    )


def sglang_record(
    config: RunConfig,
    drafter_dirs: dict[str, Path],
    prompts: list[list[int]],
    evaluation: EvalRecord,
    run_id: str,
    domains: list[str] | None = None,
) -> BenchRecord:
    """SGLang servers started one method at a time (production). The drafters' setting is the config's, or,
    with benchmark.sglang.candidates, the one chosen by timing each (choose_server_setting). With `domains`
    (each prompt's), each method's acceptance per domain too."""
    from pipeline.engines.sglang_bench import ngram_method_name, run_methods, time_settings

    configured = config.benchmark.sglang
    if configured is None:
        raise BenchmarkFailed("benchmark.engine 'sglang' needs benchmark.sglang")
    bench = config.benchmark
    serving = bench.serving_sampling
    settings, timed = configured, {}
    if configured.candidates:
        timed = time_settings(configured, prompts, bench.max_new_tokens, drafter_dirs["candidate"])
        choice = choose(
            server_rounds(timed, bench.confidence), {shape_label(shape): shape for shape in timed}
        )
        settings = configured.serving(next(shape for shape in timed if shape_label(shape) == choice.chosen))
        log.info("benchmark (sglang): %s", choice.reason)
    measured = run_methods(
        settings, prompts, bench.max_new_tokens, drafter_dirs, serving, bench.measured_batch_sizes(), domains
    )
    by_domain = {name: figures.pop("domains", {}) for name, figures in measured.greedy.items()}
    methods, ngram_sweep = sglang_methods(measured.greedy, settings.ngram_settings)
    speedups = paired_speedups(methods, bench.confidence)
    setting = (settings.steps, settings.topk, settings.draft_tokens)
    tau = round(required_tau(evaluation, settings.setting()), 4)
    record = bench_record(
        config, run_id, len(prompts), "sglang", setting, tau, methods, speedups, ngram_sweep
    )
    record.batch_size = settings.concurrency
    fastest_ngram_server = next(s for s in settings.ngram_settings if s.label == ngram_sweep.best)
    record.domain_acceptance = domain_acceptance(by_domain, ngram_method_name(fastest_ngram_server))
    record.batches = [
        sglang_batch(level, figures, settings, fastest_ngram_server, bench.confidence)
        for level, figures in sorted(measured.at_concurrency.items())
    ]
    if serving is not None:
        results = {name: MethodResult.model_validate(figures) for name, figures in measured.sampled.items()}
        record.sampled = sampled_bench(
            serving, results, paired_ratio(results["candidate"], results, bench.confidence)
        )
    if timed:
        record.timed_settings, record.setting_choice = timed_server_settings(
            timed, choice, methods.baseline, evaluation, bench.confidence
        )
    return record


def server_rounds(timed: dict[Shape, dict], confidence: float) -> Measurement:
    """The SGLang setting servers' per-round tokens/s as one measurement (rounds paired by index: the same
    prompts in the same batches on every server)."""
    samples = {shape_label(shape): tuple(figures["round_tok_s"]) for shape, figures in timed.items()}
    rounds = min(len(values) for values in samples.values())
    return Measurement(
        {name: values[:rounds] for name, values in samples.items()},
        rounds,
        "max_rounds",
        confidence,
        sum(figures["seconds"] for figures in timed.values()),
    )


def timed_server_settings(
    timed: dict[Shape, dict],
    choice: Choice,
    baseline: MethodResult,
    evaluation: EvalRecord,
    confidence: float,
) -> tuple[list[TimedSetting], SettingChoice]:
    """The record of the timed SGLang settings: each one's figures and speed over the baseline server's
    (paired by round) and over the fastest setting's, and the choice."""
    entries = []
    for shape, figures in timed.items():
        name = shape_label(shape)
        result = MethodResult.model_validate(figures)
        entries.append(
            TimedSetting(
                steps=shape[0],
                topk=shape[1],
                draft_tokens=shape[2],
                tau_predicted=predicted_tau(evaluation, *shape),
                tau_measured=result.tau_measured,
                tok_s=result.tok_s,
                round_tok_s=result.round_tok_s,
                speedup=interval(ratio_from_samples(result.round_tok_s, baseline.round_tok_s, confidence)),
                vs_fastest=interval(choice.vs_fastest[name]) if name in choice.vs_fastest else None,
            )
        )
    measured = server_rounds(timed, confidence)
    prompts = sum(int(f["requests"]) for f in timed.values()) // len(timed)
    return entries, setting_choice(choice, prompts, measured)


def setting_choice(choice: Choice, prompts: int, measured: Measurement, phases: int = 1) -> SettingChoice:
    """The record of a choice made on `measured` (the last phase's), over `prompts` prompts."""
    return SettingChoice(
        chosen=choice.chosen,
        fastest=choice.fastest,
        tied=choice.tied,
        reason=choice.reason,
        prompts=prompts,
        rounds=measured.rounds,
        stopped_by=measured.stopped_by,
        phases=phases,
    )


def domain_acceptance(
    by_domain: dict[str, dict[str, dict]], fastest_ngram: str
) -> dict[str, dict[str, MeasuredAcceptance]]:
    """Each server's per-domain acceptance (`by_domain`: server name -> domain -> figures) as domain ->
    method; n-gram is its fastest setting's server, the other n-gram servers are left out."""
    from pipeline.engines.sglang_bench import NGRAM_PREFIX

    names = {
        name: ("ngram" if name == fastest_ngram else name)
        for name in by_domain
        if name == fastest_ngram or not name.startswith(NGRAM_PREFIX)
    }
    domains = sorted({domain for figures in by_domain.values() for domain in figures})
    return {
        domain: {
            method: MeasuredAcceptance.model_validate(by_domain[name][domain])
            for name, method in names.items()
            if domain in by_domain[name]
        }
        for domain in domains
    }


def sglang_batch(
    level: int,
    figures: dict[str, dict],
    settings: SGLangBenchConfig,
    ngram: NgramServerSetting,
    confidence: float,
) -> BatchBench:
    """The SGLang servers' figures with `level` requests in flight; n-gram is the setting fastest at the
    headline concurrency."""
    from pipeline.engines.sglang_bench import ngram_method_name

    ngram_names = {ngram_method_name(setting) for setting in settings.ngram_settings}
    plain = {name: result for name, result in figures.items() if name not in ngram_names}
    methods = BenchMethods.model_validate({**plain, "ngram": figures[ngram_method_name(ngram)]})
    return BatchBench(
        batch_size=level,
        draft_steps=settings.steps,
        topk=settings.topk,
        draft_tokens=settings.draft_tokens,
        speedups=paired_speedups(methods, confidence),
        tau_measured=methods.candidate.tau_measured,
        methods=methods,
    )


def vllm_record(
    config: RunConfig,
    target_dir: Path,
    drafter_dirs: dict[str, Path],
    prompts: list[list[int]],
    evaluation: EvalRecord,
    run_id: str,
) -> BenchRecord:
    """vLLM engines on this machine (its CPU build locally, its GPU build in a benchmark pod): every n-gram
    setting timed one engine at a time, then baseline, the fastest n-gram, the incumbent and the candidate
    measured one prompt at a time, alive at once and interleaved or, with benchmark.vllm.engines_at_once
    false, one engine after another (pipeline.engines.vllm_bench); acceptance
    from vLLM's counters. Every output must equal the baseline's greedy decoding. The candidate drafts a
    chain of benchmark.vllm.num_speculative_tokens (default: benchmark.draft_steps)."""
    from pipeline.engines.vllm import eagle3_speculation, vllm_python
    from pipeline.engines.vllm_bench import (
        EngineSpec,
        InTurn,
        measure_engines,
        measure_engines_in_turn,
        method_result,
        ngram_setting_speculation,
        pass_tok_s,
        running_engines,
        time_ngram_settings,
    )

    bench = config.benchmark
    settings = bench.vllm or VllmBenchConfig()
    vllm_python(settings)  # missing: a clear error before any work
    drafter_dirs = {
        name: vllm_loadable(name, path, config.storage.run_workdir(run_id))
        for name, path in drafter_dirs.items()
    }
    steps = settings.num_speculative_tokens or bench.draft_steps
    trust = config.target.trust_remote_code
    swept = {}
    if len(bench.ngram_settings) > 1:
        swept = time_ngram_settings(settings, target_dir, prompts, bench, trust)
    ngram = max(bench.ngram_settings, key=lambda s: pass_tok_s(swept[s.label]) if swept else 0.0)
    specs = {
        "baseline": EngineSpec(target_dir),
        "ngram": EngineSpec(target_dir, ngram_setting_speculation(ngram)),
        **{
            name: EngineSpec(target_dir, eagle3_speculation(path, steps))
            for name, path in drafter_dirs.items()
        },
    }
    others = [name for name in specs if name != "candidate"]
    sampled_too = ["baseline", *drafter_dirs]  # at the serving temperature, with benchmark.serving_sampling
    sampled: InTurn | None = None
    at_batch: dict[int, InTurn] = {}
    if settings.engines_at_once:
        with running_engines(specs, settings, trust) as engines:
            version = engines["baseline"].vllm_version
            against = [("candidate", o) for o in others]
            passes, measured = measure_engines(engines, prompts, bench, against)
            for size in bench.measured_batch_sizes():
                if size != 1:
                    at_batch[size] = InTurn(*measure_engines(engines, prompts, bench, against, None, size))
            if bench.serving_sampling is not None:
                chosen = {name: engines[name] for name in sampled_too}
                ratios = [("candidate", o) for o in sampled_too if o != "candidate"]
                sampled = InTurn(*measure_engines(chosen, prompts, bench, ratios, bench.serving_sampling))
    else:
        runs = measure_engines_in_turn(specs, settings, trust, prompts, bench, sampled_too)
        passes, measured, version = runs.greedy.passes, runs.greedy.measured, runs.version
        sampled, at_batch = runs.sampled, runs.at_batch
    require_greedy_outputs(passes, swept)
    for size, level in at_batch.items():
        require_greedy_outputs(level.passes, {}, f" at batch {size}")
    methods = BenchMethods.model_validate({name: method_result(runs) for name, runs in passes.items()})
    sweep = vllm_ngram_sweep(bench, {label: method_result([g]) for label, g in swept.items()}, methods.ngram)
    speedups = {other: interval(measured.ratio("candidate", other)) for other in others}
    tau = round(required_tau(evaluation, (steps, 1, steps + 1)), 4)
    record = bench_record(
        config, run_id, len(prompts), "vllm", (steps, 1, steps + 1), tau, methods, speedups, sweep
    )
    record.engine_version = version
    record.batches = [vllm_batch(size, level, steps, others) for size, level in sorted(at_batch.items())]
    if sampled is not None and bench.serving_sampling is not None:
        serving = bench.serving_sampling
        results = {name: method_result(runs) for name, runs in sampled.passes.items()}
        measured_sampled = sampled.measured
        record.sampled = sampled_bench(
            serving, results, lambda other: measured_sampled.ratio("candidate", other)
        )
    return record


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
    from pipeline.engines.vllm_bench import greedy_mismatches

    greedy = passes["baseline"][0].outputs
    bad = greedy_mismatches({**passes, **{f"ngram {label}": [g] for label, g in swept.items()}}, greedy)
    if bad:
        raise BenchmarkFailed(
            f"vLLM's speculative outputs{where} differ from its greedy decoding (outputs, per method): {bad}"
        )


def vllm_batch(size: int, level: InTurn, steps: int, others: list[str]) -> BatchBench:
    """vLLM's engines decoding the prompts `size` at a time: every method's figures and the candidate's
    speedups (its chain of `steps`, as at batch 1)."""
    from pipeline.engines.vllm_bench import method_result

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
        return fastest_ngram(
            [
                NgramSettingResult(setting=s.label, knobs=s.model_dump(), result=swept[s.label])
                for s in bench.ngram_settings
            ],
            f"the first {bench.calibration_prompts} benchmark prompts (calibration), one engine per setting",
        )
    only = bench.ngram_settings[0]
    return NgramSweep(
        measured_on="every benchmark prompt (the only setting)",
        settings=[NgramSettingResult(setting=only.label, knobs=only.model_dump(), result=measured)],
        best=only.label,
    )


def sglang_methods(
    measured: dict[str, dict], ngram_settings: list[NgramServerSetting]
) -> tuple[BenchMethods, NgramSweep]:
    """run_methods' figures as the record keeps them: n-gram's servers (one per setting, named
    pipeline.engines.sglang_bench.ngram_method_name) as the sweep, and the fastest as the n-gram method."""
    from pipeline.engines.sglang_bench import ngram_method_name

    sweep = fastest_ngram(
        [
            NgramSettingResult(
                setting=setting.label,
                knobs=setting.model_dump(),
                result=MethodResult.model_validate(measured[ngram_method_name(setting)]),
            )
            for setting in ngram_settings
        ],
        "every benchmark prompt, one server per setting",
    )
    ngram_names = {ngram_method_name(setting) for setting in ngram_settings}
    plain = {name: figures for name, figures in measured.items() if name not in ngram_names}
    best = next(entry.result for entry in sweep.settings if entry.setting == sweep.best)
    return BenchMethods.model_validate({**plain, "ngram": best}), sweep


def paired_speedups(methods: BenchMethods, confidence: float) -> dict[str, RatioInterval]:
    """The candidate over every other method, from their paired per-round tokens/s (one server at a time:
    rounds are paired batches of the same prompts, not interleaved); n-gram is its fastest setting."""
    present = methods.present()
    ratio = paired_ratio(methods.candidate, present, confidence)
    return {other: interval(ratio(other)) for other in present if other != "candidate"}


def paired_ratio(
    candidate: MethodResult, methods: Mapping[str, MethodResult], confidence: float
) -> Callable[[str], RatioEstimate]:
    """The candidate's tokens/s over a method's, from their per-round figures paired round by round."""
    return lambda other: ratio_from_samples(candidate.round_tok_s, methods[other].round_tok_s, confidence)


class Inputs(StageInputs):
    train_uri: str
    eval_uri: str
    prompts_uri: str


Output = StageOutput


def incumbent_dir(config: RunConfig, store: ObjectStore, evaluation: EvalRecord, run_id: str) -> Path | None:
    """The incumbent version the evaluation compared against (not whatever the alias names now)."""
    if evaluation.incumbent is None:
        return None
    workdir = config.storage.run_workdir(run_id)
    return registry.pull(
        store,
        config.target.name,
        evaluation.incumbent.version,
        workdir / "incumbent_drafter",
        describe_target(config).model_dir,
    )


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    train_uri, eval_uri, prompts_uri = inputs.train_uri, inputs.eval_uri, inputs.prompts_uri
    evaluation = read_record(store, eval_uri, EvalRecord)
    settings = config.benchmark
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir, config.target.trust_remote_code)
    drafter_dirs = {
        "candidate": local_drafter_dir(store, store.key_for(train_uri), config.storage.run_workdir(run_id))
    }
    incumbent = incumbent_dir(config, store, evaluation, run_id)
    if incumbent is not None:
        drafter_dirs["incumbent"] = incumbent
    contracts = {name: read_drafter_dir(path)[2] for name, path in drafter_dirs.items()}
    aux_layer_ids = contracts["candidate"]["aux_layer_ids"]
    for name, contract in contracts.items():
        if contract["aux_layer_ids"] != aux_layer_ids:
            raise BenchmarkFailed(
                f"{name} drafter reads aux layers {contract['aux_layer_ids']}, the candidate {aux_layer_ids}"
            )
    prompts, domains = heldout_set(store, prompts_uri, tokenizer, settings.num_prompts)
    if settings.engine == "sglang":
        record = sglang_record(config, drafter_dirs, prompts, evaluation, run_id, domains)
    elif settings.engine == "vllm":
        record = vllm_record(config, Path(target.model_dir), drafter_dirs, prompts, evaluation, run_id)
    else:
        record = local_record(
            config, target, tokenizer, drafter_dirs, prompts, evaluation, aux_layer_ids, run_id, domains
        )
    record.decision = record_decision(record, settings)
    prefix = layout.run_stage_prefix(run_id, "bench")
    summary = {
        **record.summary().model_dump(mode="json"),
        "decision": record.decision.model_dump(mode="json"),
    }
    manifest = publish_record(store, prefix, record, {"run_id": run_id, "summary": summary})
    log.info(
        "benchmark (%s): baseline %.1f tok/s, ngram %.1f (%s), candidate %.1f at steps %d topk %d tokens %d "
        "(tau %s measured, %.2f simulated)",
        record.engine,
        record.baseline_tok_s,
        record.methods.ngram.tok_s,
        record.ngram_sweep.best if record.ngram_sweep else "-",
        record.drafter_tok_s,
        record.draft_steps,
        record.topk,
        record.draft_tokens,
        record.tau_measured,
        record.tau_simulated,
    )
    if record.decision.verdict == "inconclusive":
        log.warning("benchmark inconclusive: %s", record.decision.next_step)
    return Output(uri=store.uri(prefix), kind=manifest["kind"])
