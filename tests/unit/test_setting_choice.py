"""Choosing the draft setting to serve: the fastest measured, within a stated noise bound, ties to the
simpler; the per-cycle bookkeeping fitted from calibration."""

import random

import pytest

from pipeline.decoding.choice import choose, settled, shape_label, simplicity
from pipeline.decoding.speedup import (
    CycleTiming,
    Overhead,
    StepCosts,
    fit_overhead,
    predicted_speedup,
    rank_settings,
)
from pipeline.records import ShapeAcceptance
from pipeline.spread import measure
from tests.builders import eval_record

COSTS = StepCosts(
    target_step=0.010,
    verify_chain={n: 0.010 + 0.0005 * n for n in range(2, 8)},
    verify_tree={n: 0.011 + 0.0006 * n for n in range(2, 17)},
    draft={1: 0.001, 2: 0.0012, 4: 0.0015},
)


def speeds(mean: float, noise: float, seed: int):
    """A side returning tokens/s around `mean`, each call off by up to +-noise (relative)."""
    draw = random.Random(seed)
    return lambda: mean * (1 + noise * (2 * draw.random() - 1))


def timed(sides: dict[str, tuple[float, float]], rounds: int = 40):
    names = [name for name in sides if name != "baseline"]
    return measure(
        {name: speeds(mean, noise, seed) for seed, (name, (mean, noise)) in enumerate(sides.items())},
        [],
        min_rounds=rounds,
        max_rounds=rounds,
        budget_s=60,
        warmup=0,
        decided=settled(names, 0.95, 0.001),
    )


def test_the_chooser_picks_the_faster_setting_over_one_the_model_over_predicts():
    # the evaluation over-predicts the tree (tau 4.4): the model ranks it first ...
    evaluation = eval_record().model_copy(
        update={
            "full_acc": [0.8, 0.6, 0.45],
            "shapes": [
                ShapeAcceptance(steps=3, topk=2, draft_tokens=7, full_acc=[0.9, 0.8, 0.7], tau=4.4, anchors=9)
            ],
        }
    )
    ranked = rank_settings(evaluation, COSTS, [(3, 2, 7), (3, 1, 4)])
    assert [shape_label((s.steps, s.topk, s.draft_tokens)) for s in ranked] == ["tree3x2-7", "chain3"]
    assert ranked[0].speedup > ranked[1].speedup
    # ... but measured, the chain is faster (180 against 150 tokens/s, each +-3%)
    measured = timed({"baseline": (100.0, 0.03), "tree3x2-7": (150.0, 0.03), "chain3": (180.0, 0.03)})
    choice = choose(measured, {"tree3x2-7": (3, 2, 7), "chain3": (3, 1, 4)})
    assert choice.chosen == choice.fastest == "chain3"
    assert choice.tied == ["chain3"]
    assert choice.vs_fastest["tree3x2-7"].ci_high < 1.0
    assert "fastest measured" in choice.reason


def test_a_lead_narrower_than_the_noise_is_a_tie_and_the_simpler_setting_wins():
    # the tree is 1% faster, but each prompt's speed varies by +-8%: the chain, simpler, is chosen
    measured = timed(
        {"baseline": (100.0, 0.08), "tree4x2-9": (160.0, 0.08), "chain4": (158.4, 0.08)}, rounds=8
    )
    choice = choose(measured, {"tree4x2-9": (4, 2, 9), "chain4": (4, 1, 5)})
    assert choice.fastest == "tree4x2-9" or choice.fastest == "chain4"
    assert set(choice.tied) == {"tree4x2-9", "chain4"}
    assert choice.chosen == "chain4"
    if choice.fastest != "chain4":
        assert choice.vs_fastest["chain4"].ci_low <= 1.0 <= choice.vs_fastest["chain4"].ci_high
        assert "within its noise" in choice.reason


def test_a_lead_beyond_the_noise_wins_however_complex_the_setting():
    measured = timed({"baseline": (100.0, 0.02), "tree5x4-16": (200.0, 0.02), "chain2": (150.0, 0.02)})
    choice = choose(measured, {"tree5x4-16": (5, 4, 16), "chain2": (2, 1, 3)})
    assert choice.chosen == "tree5x4-16" and choice.tied == ["tree5x4-16"]


def settled_measurement(sides: dict[str, tuple[float, float]], resolution: float):
    """Interleaved rounds of the sides (mean tokens/s, relative noise) until the settings are settled."""
    names = [name for name in sides if name != "baseline"]
    return measure(
        {name: speeds(mean, noise, seed) for seed, (name, (mean, noise)) in enumerate(sides.items())},
        [],
        min_rounds=3,
        max_rounds=2000,
        budget_s=60,
        warmup=0,
        decided=settled(names, 0.95, resolution),
    )


def test_measuring_stops_once_every_setting_is_settled():
    apart = settled_measurement(
        {"baseline": (100, 0.01), "chain3": (180, 0.01), "tree3x2-7": (120, 0.01)}, 0.04
    )
    assert apart.stopped_by == "decided" and apart.rounds < 10
    # a true tie never separates: it is settled once the interval is narrower than the resolution
    tied = settled_measurement({"baseline": (100, 0.02), "a": (150, 0.02), "b": (150, 0.02)}, 0.02)
    assert tied.stopped_by == "decided"
    assert tied.ratio("a", "b").rel_width <= 0.02


def test_simpler_means_chain_before_tree_then_fewer_draft_tokens():
    shapes = [(5, 4, 16), (3, 2, 7), (6, 1, 7), (2, 1, 3), (3, 4, 7)]
    assert sorted(shapes, key=simplicity) == [(2, 1, 3), (6, 1, 7), (3, 2, 7), (3, 4, 7), (5, 4, 16)]


def test_one_setting_timed_is_chosen_and_none_is_an_error():
    measured = timed({"baseline": (100.0, 0.01), "chain3": (150.0, 0.01)}, rounds=3)
    assert choose(measured, {"chain3": (3, 1, 4)}).chosen == "chain3"
    with pytest.raises(ValueError, match="no draft setting"):
        choose(measured, {})


def test_the_bookkeeping_is_fitted_from_measured_cycles():
    truth = Overhead(per_cycle=0.002, per_tree_cycle=0.003, per_draft_token=0.0004, per_plain_step=0.001)
    shapes = [(2, 1, 3), (5, 1, 6), (3, 2, 7), (4, 4, 12)]
    timings = [
        CycleTiming(k, n, COSTS.cycle(s, k, n), COSTS.cycle(s, k, n) + truth.cycle(k, n))
        for s, k, n in shapes
    ]
    fitted = fit_overhead(timings, COSTS.target_step, COSTS.target_step + 0.001)
    assert fitted.per_cycle == pytest.approx(0.002, abs=1e-9)
    assert fitted.per_tree_cycle == pytest.approx(0.003, abs=1e-9)
    assert fitted.per_draft_token == pytest.approx(0.0004, abs=1e-9)
    assert fitted.per_plain_step == pytest.approx(0.001)
    # the bookkeeping lowers a tree's predicted speedup more than a chain's
    chain, tree = (
        predicted_speedup(3.0, COSTS, fitted, 3, 1, 4),
        predicted_speedup(3.0, COSTS, fitted, 3, 2, 7),
    )
    assert chain == pytest.approx(3.0 * 0.011 / (COSTS.cycle(3, 1, 4) + 0.002 + 0.0016))
    assert tree < chain
    # nothing timed: only plain decoding's own bookkeeping
    assert fit_overhead([], 0.01, 0.012) == Overhead(per_plain_step=pytest.approx(0.002))
