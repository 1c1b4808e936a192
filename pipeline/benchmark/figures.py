"""What more than one engine builds its figures with: intervals as records keep them, the n-gram sweep's
record, sampled figures, paired speedups of engines run one at a time, the setting choice's record, and an
engine's figures as one EngineBench."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence

from pipeline.benchmark.job import BenchJob, BenchmarkFailed
from pipeline.benchmark_settings import NgramLocalSetting, NgramServerSetting, ServingSampling
from pipeline.decoding.choice import Choice, Shape, shape_label
from pipeline.decoding.speedup import predicted_tau
from pipeline.records import (
    BenchMethods,
    EngineBench,
    EvalRecord,
    MethodResult,
    NgramSettingResult,
    NgramSweep,
    RatioInterval,
    SampledBench,
    SettingChoice,
    SpeedModel,
)
from pipeline.spread import Measurement, RatioEstimate, ratio_from_samples


def engine_bench(
    job: BenchJob,
    engine: str,
    setting: Shape,
    tau_simulated: float,
    methods: BenchMethods,
    speedups: dict[str, RatioInterval],
    ngram_sweep: NgramSweep,
    speed_model: SpeedModel | None = None,
) -> EngineBench:
    """An engine's figures: the (steps, topk, draft tokens) setting it ran, every method's figures (n-gram's
    at its fastest setting, every setting in `ngram_sweep`) and the candidate's headline figures."""
    candidate, baseline = methods.candidate, methods.baseline
    return EngineBench(
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
        prompts=len(job.prompts),
        max_new_tokens=job.settings.max_new_tokens,
        methods=methods,
        speed_model=speed_model,
        ngram_sweep=ngram_sweep,
    )


def outputs_sha256(outputs: list[list[int]]) -> str:
    """The fingerprint of one pass's outputs (MethodResult.outputs_sha256): the same for every method and
    engine whose outputs are the same token ids."""
    return hashlib.sha256(json.dumps(outputs, separators=(",", ":")).encode()).hexdigest()


def histogram_acceptance(histogram: list[int]) -> tuple[float, list[float]]:
    """Tau and the acceptance per chain position of verify steps counted by drafts accepted (histogram[i]:
    the steps that accepted i), as vLLM's counters give them: tau = 1 + accepted drafts / steps."""
    steps = sum(histogram)
    if not steps:
        raise BenchmarkFailed("no draft was verified: no acceptance to compare")
    accepted = sum(i * count for i, count in enumerate(histogram))
    return 1 + accepted / steps, [sum(histogram[i + 1 :]) / steps for i in range(len(histogram) - 1)]


def interval(estimate: RatioEstimate) -> RatioInterval:
    """A pipeline.spread estimate as records keep it."""
    return RatioInterval.model_validate(estimate.as_dict())


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


def ngram_sweep(
    settings: Sequence[NgramLocalSetting | NgramServerSetting],
    results: Mapping[str, MethodResult],
    measured_on: str,
) -> NgramSweep:
    """The sweep's record: every setting's figures (`results`, by setting label), and the fastest (highest
    tokens/s; the first of equals) as the n-gram the candidate must beat; with one setting, that one."""
    if not settings:
        raise BenchmarkFailed("no n-gram setting was measured")
    entries = [
        NgramSettingResult(setting=setting.label, knobs=setting.model_dump(), result=results[setting.label])
        for setting in settings
    ]
    best = max(entries, key=lambda entry: entry.result.tok_s)
    return NgramSweep(measured_on=measured_on, settings=entries, best=best.setting)


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
