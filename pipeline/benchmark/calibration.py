"""How the reference decoder chooses its draft setting: the forwards' costs measured on this machine, every
setting ranked by the speed model from the evaluation's acceptance, the best few timed beside plain
decoding prompt by prompt (calibrate), and the fastest measured chosen, or the simplest within its noise
(pipeline.decoding.choice)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property, partial

import torch

from pipeline import spread
from pipeline.benchmark.decoded import eagle_method, method_result
from pipeline.benchmark.figures import interval, setting_choice
from pipeline.benchmark.job import BenchmarkFailed
from pipeline.benchmark_settings import BenchmarkConfig
from pipeline.decoding.batched import BatchedTarget, EagleRows
from pipeline.decoding.choice import Choice, Shape, choose, settled, shape_label
from pipeline.decoding.reference_decoder import (
    DecodeResult,
    DraftTree,
    EagleProposer,
    TargetRunner,
    greedy_decode,
)
from pipeline.decoding.speedup import (
    CycleTiming,
    Overhead,
    StepCosts,
    candidate_settings,
    fit_overhead,
    rank_settings,
)
from pipeline.progress import Progress
from pipeline.records import Calibration, DraftSetting, EvalRecord, SettingChoice
from pipeline.spread import Measurement

log = logging.getLogger(__name__)


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
        summary = method_result([self.results[name]])
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
        shape = setting_shape(setting)
        methods[shape_label(shape)] = eagle_method(with_aux, drafter, shape, new_tokens, eos)
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
        measured = spread.measure(
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
