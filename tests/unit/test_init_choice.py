"""train.init auto's decision (pipeline.training.init_choice): scratch without an incumbent or with one that
reads features another way, warm on the same target, a probe on another target, and the step plateau that
ends a stalled warm start."""

import pytest

from pipeline.config import load_config
from pipeline.data.capture_contract import ContractMismatch
from pipeline.records import InitProbe, VocabularyCoverage
from pipeline.training.init_choice import (
    decide_auto,
    probe_bar,
    restart_choice,
    target_differences,
    warm_plateau_reached,
    warm_restart_bar,
)
from pipeline.training.worker import check_warm_start_contract
from tests.conftest import REPO

TARGET = {
    "name": "kimi",
    "model_path": "Kimi-K2.5",
    "revision": "abc",
    "config_sha256": "c1",
    "tokenizer_sha256": "t1",
    "chat_template_sha256": "h1",
}


def contract(**target) -> dict:
    return {
        "aux_layer_ids": [1, 29, 57],
        "hidden_size": 7168,
        "vocab_size": 163840,
        "teacher_norm": "post_final_norm",
        "layer_convention": "output_of_layer_k",
        "target": {**TARGET, **target},
    }


def probe_returning(cond_acc0: float, bar: float = 0.5):
    calls = []

    def probe() -> InitProbe:
        calls.append(1)
        return InitProbe(cond_acc=[cond_acc0, 0.1], tau_simulated=1.4, bar=bar)

    return probe, calls


def decide(incumbent, data, probe):
    return decide_auto("registry:production", "v1", incumbent, data, probe, check_warm_start_contract)


def test_no_incumbent_trains_from_scratch():
    probe, calls = probe_returning(0.9)
    choice = decide(None, contract(), probe)
    assert (choice.requested, choice.chosen) == ("auto", "scratch") and not calls
    assert "no drafter at registry:production" in choice.reason


def test_an_incumbent_of_the_same_target_is_warm_started_without_a_probe():
    probe, calls = probe_returning(0.0)
    choice = decide(contract(), contract(), probe)
    assert choice.chosen == "warm" and choice.version == "v1" and not calls and choice.probe is None
    assert "same target" in choice.reason


def test_an_incumbent_that_reads_features_another_way_is_never_warm_started():
    probe, calls = probe_returning(0.9)
    incumbent = {**contract(), "aux_layer_ids": [2, 30, 58]}
    choice = decide(incumbent, contract(), probe)
    assert choice.chosen == "scratch" and not calls and "aux_layer_ids" in choice.reason


@pytest.mark.parametrize(("probed", "chosen"), [(0.62, "warm"), (0.38, "scratch")])
def test_an_incumbent_of_another_target_is_probed_against_the_bar(probed, chosen):
    probe, calls = probe_returning(probed, bar=0.5)
    choice = decide(contract(revision="k2", config_sha256="c0"), contract(), probe)
    assert choice.chosen == chosen and calls == [1]
    assert choice.probe is not None and choice.probe.cond_acc[0] == probed
    assert "revision 'k2' -> 'abc'" in choice.reason and "config_sha256" in choice.reason
    assert f"{probed:.3f}" in choice.reason


@pytest.mark.parametrize(("incumbent_outside", "chosen"), [(0.603, "scratch"), (0.04, "warm")])
def test_an_incumbent_whose_vocabulary_misses_the_new_tokens_is_not_warm_started(incumbent_outside, chosen):
    """The probe clears the bar (38% against 30%, as K2's drafter on K2.5) but the incumbent's draft
    vocabulary misses 60% of the new held-out tokens: a warm start keeps it, and stalls (benchmarks/
    exp_warm_start_vocab_shift.py). A few points more than scratch's own vocabulary misses is tolerated."""
    probe, _ = probe_returning(0.38, bar=0.3)
    measured = []

    def coverage() -> VocabularyCoverage:
        measured.append(1)
        return VocabularyCoverage(incumbent_outside=incumbent_outside, fresh_outside=0.001)

    incumbent = contract(revision="k2")
    choice = decide_auto(
        "registry:production", "v1", incumbent, contract(), probe, check_warm_start_contract, coverage, 0.05
    )
    assert choice.chosen == chosen and measured == [1] and choice.vocabulary is not None
    assert choice.reason.startswith("registry:production was trained on another target (revision 'k2' -> ")
    if chosen == "scratch":
        assert choice.reason.endswith(
            "0.380, clears the bar 0.300, but its draft vocabulary misses 60.3% of the new held-out tokens "
            "(one built from the new data misses 0.1%): a warm start keeps it and could never emit them"
        )
    # not measured for the same target, nor for an incumbent already under the bar
    for same_or_under, result in ((contract(), "warm"), (contract(revision="k2"), "scratch")):
        low, _ = probe_returning(0.1, bar=0.3)
        decided = decide_auto("r", "v", same_or_under, contract(), low, check_warm_start_contract, coverage)
        assert decided.chosen == result and decided.vocabulary is None
    assert measured == [1]


def test_target_differences_name_only_the_identity_fields_that_changed():
    assert target_differences(contract(), contract(name="renamed-in-config")) == []
    assert target_differences(contract(), contract(tokenizer_sha256="t2")) == [
        "tokenizer_sha256 't1' -> 't2'"
    ]


def test_the_probe_bar_defaults_to_the_gates_step_0_bar():
    config = load_config(REPO / "configs" / "local.yaml", ["gate.min_cond_acc=[0.42]"])
    assert probe_bar(config) == 0.42
    config = load_config(REPO / "configs" / "local.yaml", ["train.auto_init.min_probe_cond_acc=0.6"])
    assert probe_bar(config) == 0.6
    with pytest.raises(ValueError, match="auto_init"):
        load_config(REPO / "configs" / "local.yaml", ["train.auto_init.window=3"])


def test_a_warm_start_plateaus_when_it_gains_too_little_over_the_step_window_under_the_bar():
    stalled = [(20, 0.380), (40, 0.381), (60, 0.382), (80, 0.383)]
    assert warm_plateau_reached(stalled, window_steps=60, min_gain=0.01, bar=0.5)
    # not yet a window's worth of steps
    assert not warm_plateau_reached(stalled[:3], window_steps=60, min_gain=0.01, bar=0.5)
    # learning: gains more than min_gain over the window
    learning = [(20, 0.30), (40, 0.33), (60, 0.36), (80, 0.39)]
    assert not warm_plateau_reached(learning, window_steps=60, min_gain=0.01, bar=0.5)
    # flat but already over the bar: a good warm start, kept
    assert not warm_plateau_reached([(s, 0.8) for s in (20, 40, 60, 80)], 60, 0.01, 0.5)
    assert not warm_plateau_reached([], 60, 0.01, 0.5)


def test_the_restart_bar_is_what_the_incumbent_reached_on_its_own_target_less_the_shortfall():
    """K2's drafter reached 0.75 on K2; a warm start on K2.5 stalled at 0.38, over a 0.30 gate bar: it has
    not adapted, and is restarted. The gate's bar is the floor; without lineage, the gate's bar alone."""
    config = load_config(REPO / "configs" / "local.yaml", ["gate.min_cond_acc=[0.3]"])
    assert config.train.auto_init.plateau_shortfall_vs_own == 0.15
    bar = warm_restart_bar(config, own_cond_acc0=0.75)
    assert bar.cond_acc0 == pytest.approx(0.60)
    assert bar.reason == "its own held-out cond_acc_0 0.750 in its registry lineage, less 0.15"
    stalled_above_the_gate = [(20, 0.380), (40, 0.381), (60, 0.382), (80, 0.383)]
    assert warm_plateau_reached(stalled_above_the_gate, 60, 0.01, bar.cond_acc0)
    assert not warm_plateau_reached(stalled_above_the_gate, 60, 0.01, 0.3)  # the gate's bar alone misses it
    # an incumbent that holds its own level on new data of the same target is kept
    assert not warm_plateau_reached([(s, 0.74) for s in (20, 40, 60, 80)], 60, 0.01, bar.cond_acc0)
    # a weak incumbent: the gate's bar is higher than its own level less the shortfall
    weak = warm_restart_bar(config, own_cond_acc0=0.40)
    assert weak.cond_acc0 == 0.3 and weak.reason.startswith("the gate's step-0 bar, above its own")
    unknown = warm_restart_bar(config, own_cond_acc0=None)
    assert unknown.cond_acc0 == 0.3 and "no registry lineage" in unknown.reason
    no_gate = load_config(REPO / "configs" / "local.yaml", ["gate.min_cond_acc=[]"])
    assert warm_restart_bar(no_gate, None).cond_acc0 == 1.0
    assert warm_restart_bar(no_gate, 0.75).cond_acc0 == pytest.approx(0.60)
    shorter = load_config(REPO / "configs" / "local.yaml", ["train.auto_init.plateau_shortfall_vs_own=0.05"])
    assert warm_restart_bar(shorter, 0.75).cond_acc0 == pytest.approx(0.70)
    # the scratch attempt that follows says under what and why
    probe, _ = probe_returning(0.0)
    warm = decide(contract(), contract(), probe).model_copy(update={"restart_under": bar})
    restart = restart_choice(warm, 200, 0.383)
    assert restart.chosen == "scratch" and restart.reason == (
        "the warm start from registry:production plateaued at training cond_acc_0 0.383 after 200 steps, "
        "under 0.600 (its own held-out cond_acc_0 0.750 in its registry lineage, less 0.15); restarted from "
        "scratch"
    )


def test_the_compatibility_check_is_the_warm_start_contract_check():
    with pytest.raises(ContractMismatch, match="hidden_size"):
        check_warm_start_contract({**contract(), "hidden_size": 4096}, contract())
