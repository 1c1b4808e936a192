"""The reference decoder as a benchmark engine (benchmark.engine "reference"): the project's own speculative
decoder (pipeline.decoding.reference_decoder) over the target on this machine, every method decoding the
held-out prompts interleaved prompt by prompt, so that machine noise hits all of them alike.

Deciding (no serving engine beside it): its draft setting chosen by the speed model and calibration
(pipeline.benchmark.calibration), n-gram at its fastest configured setting, greedy at batch 1 (per domain
too), at every other of benchmark.batch_sizes and sampled at benchmark.serving_sampling.

Beside a serving engine (benchmark.reference_beside): at that engine's setting, with its fastest n-gram
setting, greedy at batch 1, and the check the serving engine's acceptance must pass (`acceptance_check`).

Every speculative output must equal plain greedy decoding token for token, or the stage fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from pipeline import spread
from pipeline.benchmark.calibration import choose_setting, measure_batch_costs, setting_shape
from pipeline.benchmark.decoded import eagle_method, method_result, ngram_method, outputs_of, tok_s_of
from pipeline.benchmark.figures import (
    engine_bench,
    histogram_acceptance,
    interval,
    ngram_sweep,
    outputs_sha256,
    required_tau,
    sampled_bench,
)
from pipeline.benchmark.job import BenchJob, BenchmarkFailed
from pipeline.benchmark_settings import BenchmarkConfig, NgramLocalSetting, ServingSampling, engine
from pipeline.config import DEFAULT_DOMAIN
from pipeline.decoding.batched import BatchedTarget, EagleRows, NgramRows, batched_speculative_decode
from pipeline.decoding.choice import Shape
from pipeline.decoding.reference_decoder import (
    DecodeResult,
    EagleProposer,
    NgramProposer,
    TargetRunner,
    WholeChainProposer,
    greedy_decode,
    speculative_decode,
)
from pipeline.decoding.sampling import Sampling
from pipeline.decoding.speedup import rank_settings
from pipeline.drafter.export import load_drafter
from pipeline.drafter.model import Eagle3Drafter
from pipeline.engines.target import load_frozen_tensors, load_model
from pipeline.progress import Progress
from pipeline.records import (
    AcceptanceCheck,
    BatchBench,
    BenchMethods,
    EngineBench,
    MeasuredCosts,
    NgramSweep,
    PredictedVsMeasured,
    RatioInterval,
    SampledBench,
    SpeedModel,
)
from pipeline.spread import Measurement

log = logging.getLogger(__name__)

Unit = TypeVar("Unit")  # what a method decodes in one call: a prompt, or a batch of prompts


def measure(job: BenchJob) -> EngineBench:
    """The reference decoder's figures: deciding, or beside the serving engine of `job.serving`."""
    model, drafters = load_decoding(job)
    if job.serving is not None:
        return measure_beside(job, model, drafters, job.serving)
    settings = job.settings
    decided = choose_setting(
        job.evaluation, model, job.tokenizer, drafters["candidate"], job.prompts, job.aux_layer_ids, settings
    )
    chosen = setting_shape(decided.setting)
    ngram, ngram_sweep = sweep_ngram(model, job.tokenizer, job.prompts, settings)
    methods, speedups, per_domain = compare_methods(job, model, drafters, chosen, ngram)
    prediction = decided.setting
    speed_model = SpeedModel(
        costs=MeasuredCosts.model_validate(decided.costs.as_dict()),
        chosen=prediction,
        calibration=decided.calibration,
        predicted_vs_measured=PredictedVsMeasured(
            tau=(prediction.tau, methods.candidate.tau_measured),
            speedup=(prediction.speedup, round(speedups["baseline"].ratio, 4)),
        ),
        ranked=decided.ranked[:10],
        overhead=decided.overhead.as_dict() if decided.overhead is not None else None,
        choice=decided.choice,
    )
    figures = engine_bench(
        job, "reference", chosen, prediction.tau, methods, speedups, ngram_sweep, speed_model
    )
    figures.domains = per_domain
    if settings.serving_sampling is not None:
        figures.sampled = compare_sampled(job, model, drafters, chosen, settings.serving_sampling)
    figures.batches = [
        batch_bench(job, model, drafters, ngram, size, methods)
        for size in settings.measured_batch_sizes()
        if size != 1
    ]
    return figures


def load_decoding(job: BenchJob) -> tuple[torch.nn.Module, dict[str, Eagle3Drafter]]:
    """The target and every drafter of the job, loaded for the reference decoder."""
    frozen = load_frozen_tensors(job.target_dir)
    drafters = {
        name: load_drafter(path, frozen["embed"].float())[0] for name, path in job.drafter_dirs.items()
    }
    return load_model(job.target_dir, trust_remote_code=job.trust_remote_code), drafters


def measure_beside(
    job: BenchJob, model, drafters: dict[str, Eagle3Drafter], serving: EngineBench
) -> EngineBench:
    """Beside the serving engine's `serving` figures: every method greedy at batch 1, the drafters at the
    serving engine's chain and n-gram at its fastest setting, timed interleaved (reported beside the serving
    engine's, not decisive); plain decoding's outputs must equal the serving engine's; and the acceptance the
    serving engine's must match (`acceptance_check`)."""
    if serving.topk != 1:
        raise BenchmarkFailed(
            f"the reference decoder beside {serving.engine} checks a chain's acceptance, and "
            f"{serving.engine} served a tree (topk {serving.topk})"
        )
    shape = (serving.draft_steps, 1, serving.draft_steps + 1)
    served = serving_ngram(job, serving)
    ngram, swept = (
        (served, None) if served is not None else sweep_ngram(model, job.tokenizer, job.prompts, job.settings)
    )
    methods, speedups, per_domain = compare_methods(job, model, drafters, shape, ngram)
    unswept = f"every benchmark prompt: {serving.engine}'s fastest setting, not swept again here"
    sweep = swept or ngram_sweep([ngram], {ngram.label: methods.ngram}, unswept)
    if methods.baseline.outputs_sha256 != serving.methods.baseline.outputs_sha256:
        raise BenchmarkFailed(
            f"{serving.engine}'s greedy outputs differ from the reference decoder's on the same prompts: "
            "the two do not decode the same target"
        )
    figures = engine_bench(
        job, "reference", shape, required_tau(job.evaluation, shape), methods, speedups, sweep
    )
    figures.domains = per_domain
    figures.acceptance = acceptance_check(job, model, drafters["candidate"], serving)
    return figures


def serving_ngram(job: BenchJob, serving: EngineBench) -> NgramLocalSetting | None:
    """The n-gram setting the serving engine found fastest, when it is one of benchmark.ngram_settings (as
    vLLM's are): the reference decoder measures it alone, unswept."""
    best = serving.ngram_sweep.best if serving.ngram_sweep is not None else None
    return next((s for s in job.settings.ngram_settings if s.label == best), None)


def acceptance_check(job: BenchJob, model, drafter: Eagle3Drafter, serving: EngineBench) -> AcceptanceCheck:
    """The serving engine's acceptance of the candidate against the reference decoder's, on the same prompts
    and chain, the reference decoder's drafts counted as the serving engine counts them
    (pipeline.benchmark.Engine.drafts_whole_chain); within benchmark.acceptance_tolerance or not."""
    steps, settings = serving.draft_steps, job.settings
    served = serving.methods.candidate
    if served.tau_measured is None or served.acceptance_per_position is None:
        raise BenchmarkFailed(f"{serving.engine} recorded no acceptance of the candidate to check")
    whole_chain = engine(serving.engine).drafts_whole_chain
    eos = job.tokenizer.eos_token_id
    outputs, histogram = chain_acceptance(
        model, drafter, job.aux_layer_ids, job.prompts, settings.max_new_tokens, eos, steps, whole_chain
    )
    if outputs_sha256(outputs) != served.outputs_sha256:
        raise BenchmarkFailed(
            f"the candidate's outputs in {serving.engine} differ from the reference decoder's greedy outputs"
        )
    reference_tau, per_position = histogram_acceptance(histogram)
    rel_diff = abs(served.tau_measured - reference_tau) / reference_tau
    check = AcceptanceCheck(
        engine=serving.engine,
        draft_steps=steps,
        tau=served.tau_measured,
        reference_tau=round(reference_tau, 4),
        rel_diff=round(rel_diff, 4),
        tolerance=settings.acceptance_tolerance,
        passed=rel_diff <= settings.acceptance_tolerance,
        acceptance_per_position=served.acceptance_per_position,
        reference_acceptance_per_position=[round(p, 4) for p in per_position],
    )
    log.info(
        "benchmark: acceptance in %s %.3f, the reference decoder's %.3f (relative difference %.4f, "
        "tolerance %s)",
        serving.engine,
        check.tau,
        check.reference_tau,
        check.rel_diff,
        check.tolerance,
    )
    return check


def chain_acceptance(
    model,
    drafter: Eagle3Drafter,
    aux_layer_ids: list[int],
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: int | None,
    steps: int,
    whole_chain: bool = False,
) -> tuple[list[list[int]], list[int]]:
    """The drafter's chain of `steps` over the prompts, greedy: every output, and the verify steps counted by
    drafts accepted (histogram[i]: the steps that accepted i); with `whole_chain`, all `steps` drafted in
    every cycle, as an engine that drafts no partial chains counts them (WholeChainProposer)."""
    runner = TargetRunner(model, aux_layer_ids)
    outputs, histogram = [], [0] * (steps + 1)
    with torch.inference_mode():
        for prompt in prompts:
            proposer = EagleProposer(drafter)
            drafting = WholeChainProposer(proposer, steps) if whole_chain else proposer
            result = speculative_decode(runner, drafting, prompt, max_new_tokens, eos, steps)
            outputs.append(result.tokens)
            histogram = [a + b for a, b in zip(histogram, result.accepted_histogram, strict=True)]
    return outputs, histogram


def sweep_ngram(
    model, tokenizer, prompts: list[list[int]], settings: BenchmarkConfig
) -> tuple[NgramLocalSetting, NgramSweep]:
    """Every configured n-gram setting timed on the calibration prompts (after a warm-up prompt), as the
    candidate's own setting is; the fastest is the n-gram the benchmark then measures against it."""
    runner = TargetRunner(model, None)
    calibration = prompts[: settings.calibration_prompts]
    results = {}
    with torch.inference_mode():
        for setting in settings.ngram_settings:
            method = ngram_method(runner, setting, settings.max_new_tokens, tokenizer.eos_token_id)
            method(prompts[0])  # warm-up
            results[setting.label] = method_result([[method(p) for p in calibration]])
    measured_on = f"the first {len(calibration)} benchmark prompts (calibration)"
    sweep = ngram_sweep(settings.ngram_settings, results, measured_on)
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
        return tok_s_of(passes[-1])

    return decode_all


class Passes(dict[str, list[list[DecodeResult]]]):
    """Each method's measured passes (rounds) over the prompts, and the measurement that ran them."""

    measured: Measurement


def interleaved_passes(
    methods: dict[str, Callable[[Unit], DecodeResult]],
    prompts: list[Unit],
    settings: BenchmarkConfig,
    what: str,
    budget_s: float,
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
        measured = spread.measure(
            sides,
            [("candidate", other) for other in methods if other != "candidate"],
            confidence=settings.confidence,
            rel_width=settings.ci_rel_width,
            budget_s=budget_s,
            min_rounds=min_rounds,
            max_rounds=max(min_rounds, 10_000),
        )
    progress.close()
    log.info("%s: %d rounds, stopped by %s", what, measured.rounds, measured.stopped_by)
    for name in passes:
        del passes[name][: len(passes[name]) - measured.rounds]
    passes.measured = measured
    return passes


def compare_methods(
    job: BenchJob, model, drafters: dict[str, Eagle3Drafter], shape: Shape, ngram: NgramLocalSetting
) -> tuple[BenchMethods, dict[str, RatioInterval], dict[str, BenchMethods]]:
    """Every method greedy on the job's prompts, interleaved (interleaved_passes): the drafters at `shape`
    (steps, topk, draft tokens), n-gram with `ngram`. Outputs are checked against greedy decoding. Also
    returns the figures per domain (the job's domains: each prompt's)."""
    settings, new_tokens = job.settings, job.settings.max_new_tokens
    plain = TargetRunner(model, None)
    with_aux = TargetRunner(model, job.aux_layer_ids)
    eos = job.tokenizer.eos_token_id
    methods = {
        "baseline": lambda p: greedy_decode(plain, p, new_tokens, eos),
        "ngram": ngram_method(plain, ngram, new_tokens, eos),
    }
    for name, drafter in drafters.items():
        methods[name] = eagle_method(with_aux, drafter, shape, new_tokens, eos)
    decides = job.serving is None and settings.decides_at(1)
    passes = interleaved_passes(methods, job.prompts, settings, "benchmark", settings.budget_s_for(decides))
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
    per_domain = domain_summaries(passes, job.domains or [DEFAULT_DOMAIN] * len(job.prompts))
    return (
        BenchMethods.model_validate({name: method_result(p) for name, p in passes.items()}),
        speedups,
        per_domain,
    )


def compare_sampled(
    job: BenchJob, model, drafters: dict[str, Eagle3Drafter], shape: Shape, serving: ServingSampling
) -> SampledBench:
    """Baseline and the drafters sampled at the serving temperature, interleaved as compare_methods runs
    them, each method drawing from a generator of its own (seeded: a rerun draws the same)."""
    sampling = Sampling(serving.temperature, serving.top_p, serving.top_k)
    plain = TargetRunner(model, None)
    with_aux = TargetRunner(model, job.aux_layer_ids)
    eos, new_tokens = job.tokenizer.eos_token_id, job.settings.max_new_tokens
    draws = {name: torch.Generator().manual_seed(seed) for seed, name in enumerate(["baseline", *drafters])}
    methods = {"baseline": lambda p: greedy_decode(plain, p, new_tokens, eos, sampling, draws["baseline"])}
    for name, drafter in drafters.items():
        methods[name] = eagle_method(with_aux, drafter, shape, new_tokens, eos, sampling, draws[name])
    what = f"benchmark at temperature {serving.temperature}"
    passes = interleaved_passes(methods, job.prompts, job.settings, what, job.settings.budget_s_for(False))
    summaries = {name: method_result(runs) for name, runs in passes.items()}
    return sampled_bench(serving, summaries, lambda other: passes.measured.ratio("candidate", other))


def domain_summaries(
    passes: dict[str, list[list[DecodeResult]]], domains: list[str]
) -> dict[str, BenchMethods]:
    """Every method's figures on each domain's prompts (`domains`: each prompt's, in the passes' order)."""
    per_domain = {}
    for domain in sorted(set(domains)):
        indices = [i for i, prompt_domain in enumerate(domains) if prompt_domain == domain]
        per_domain[domain] = BenchMethods.model_validate(
            {
                name: method_result([[one_pass[i] for i in indices] for one_pass in runs])
                for name, runs in passes.items()
            }
        )
    return per_domain


def batches_of(prompts: list[list[int]], size: int) -> list[list[list[int]]]:
    """Every prompt, in order, in batches of `size`; the last batch filled up from the first prompts, so every
    batch measures that batch size."""
    count = -(-len(prompts) // size)
    return [[prompts[(i * size + j) % len(prompts)] for j in range(size)] for i in range(count)]


def batch_bench(
    job: BenchJob,
    model,
    drafters: dict[str, Eagle3Drafter],
    ngram: NgramLocalSetting,
    batch: int,
    at_batch_1: BenchMethods,
) -> BatchBench:
    """Every method decoding the prompts `batch` at a time with the reference decoder's batched decoding,
    interleaved batch pass by pass: the drafters draft the chain the speed model ranks fastest from costs
    measured at this batch size, n-gram its fastest setting at batch 1. Every output must equal the
    baseline's at batch 1 (`at_batch_1`), or the stage fails."""
    settings, evaluation, prompts, aux_layer_ids = (
        job.settings,
        job.evaluation,
        job.prompts,
        job.aux_layer_ids,
    )
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
    eos, new_tokens = job.tokenizer.eos_token_id, settings.max_new_tokens
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
    what, budget_s = f"benchmark at batch {batch}", settings.budget_s_for(settings.decides_at(batch))
    passes = interleaved_passes(methods, batches_of(prompts, batch), settings, what, budget_s)
    require_batch_outputs(passes, len(prompts), at_batch_1, batch)
    figures = BenchMethods.model_validate({name: method_result(runs) for name, runs in passes.items()})
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
