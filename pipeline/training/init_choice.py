"""train.init: which drafter a training run starts from, and why.

- scratch: a new drafter.
- warm: the drafter at train.init_from (a directory or registry:<alias or version>).
- auto: the incumbent (train.init_from, default registry:<registry.alias>) when it makes sense, else scratch:
  - no incumbent, or one that reads features another way (aux layers, hidden size, vocabulary): scratch;
  - an incumbent trained on the same target (the capture contract's target identity: model, revision,
    config, tokenizer and chat-template hashes): warm;
  - an incumbent of another target: probed first, scored on the new dataset's held-out split; warm only
    when its cond_acc_0 there clears auto_init.min_probe_cond_acc (default the gate's step-0 bar) and its
    draft vocabulary misses at most auto_init.max_vocabulary_gap more of the held-out tokens than one built
    from the new data (a warm start keeps the incumbent's vocabulary: what it misses, it never emits;
    benchmarks/exp_warm_start_vocab_shift.py stalls at 38% that way while scratch reaches 75%).
  A warm start chosen by auto that plateaus early (training cond_acc_0 gaining less than
  auto_init.plateau_min_gain over auto_init.plateau_steps steps) under its restart bar is stopped by the
  worker and restarted from scratch by the train stage (`warm_plateau_reached`, pipeline.stages.train).
  The bar (`warm_restart_bar`) is what the incumbent reached on its own target's held-out data (its
  registry lineage) less auto_init.plateau_shortfall_vs_own, or the gate's step-0 bar when that is
  higher: a warm start stalled far under its own level has not adapted, even above the gate's bar.

This is the failure the project began with: a Kimi-K2 drafter warm-started on Kimi-K2.5 data stalled at
cond_acc_0 38% while scratch reached 74.7%, and nobody restarted it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.config import RunConfig
from pipeline.data.capture_contract import ContractMismatch
from pipeline.records import InitChoice, InitProbe, VocabularyCoverage, WarmRestartBar

# the target identity fields of a capture contract that say two targets are the same model
SAME_TARGET_FIELDS = (
    "model_path",
    "revision",
    "config_sha256",
    "tokenizer_sha256",
    "chat_template_sha256",
)


def target_differences(incumbent_contract: dict[str, Any], data_contract: dict[str, Any]) -> list[str]:
    """The target identity fields in which the incumbent's target and the new data's differ."""
    old, new = incumbent_contract.get("target") or {}, data_contract.get("target") or {}
    return [
        f"{field} {old.get(field)!r} -> {new.get(field)!r}"
        for field in SAME_TARGET_FIELDS
        if old.get(field) != new.get(field)
    ]


def gate_step0_bar(config: RunConfig) -> float | None:
    """The gate's cond_acc_0 bar (gate.min_cond_acc[0]), None when it sets none."""
    return config.gate.min_cond_acc[0] if config.gate.min_cond_acc else None


def probe_bar(config: RunConfig) -> float:
    """The held-out cond_acc_0 an incumbent of another target must reach on the new data for a warm start."""
    configured = config.train.auto_init.min_probe_cond_acc
    if configured is not None:
        return configured
    return gate_step0_bar(config) or 0.0


def warm_restart_bar(config: RunConfig, own_cond_acc0: float | None) -> WarmRestartBar:
    """Under what training cond_acc_0 a stalled warm start restarts from scratch. own_cond_acc0: the
    incumbent's held-out cond_acc_0 on its own target (its registry lineage), None when unknown."""
    gate_bar = gate_step0_bar(config)
    shortfall = config.train.auto_init.plateau_shortfall_vs_own
    if own_cond_acc0 is None:
        if gate_bar is None:
            return WarmRestartBar(
                cond_acc0=1.0, reason="any plateau: the incumbent has no registry lineage and the gate no bar"
            )
        return WarmRestartBar(
            cond_acc0=gate_bar, reason="the gate's step-0 bar; the incumbent has no registry lineage"
        )
    own = f"its own held-out cond_acc_0 {own_cond_acc0:.3f} in its registry lineage, less {shortfall}"
    from_own = round(own_cond_acc0 - shortfall, 6)
    if gate_bar is not None and gate_bar > from_own:
        return WarmRestartBar(cond_acc0=gate_bar, reason=f"the gate's step-0 bar, above {own}")
    return WarmRestartBar(cond_acc0=from_own, reason=own)


def decide_auto(
    source: str,
    version: str | None,
    incumbent_contract: dict[str, Any] | None,
    data_contract: dict[str, Any],
    probe: Callable[[], InitProbe],
    check_compatible: Callable[[dict[str, Any], dict[str, Any]], None],
    coverage: Callable[[], VocabularyCoverage] | None = None,
    max_vocabulary_gap: float = 0.05,
) -> InitChoice:
    """train.init auto's choice. `probe` scores the incumbent on the new held-out data and `coverage`
    measures what its draft vocabulary misses there; both run only for an incumbent of another target.
    `check_compatible` raises ContractMismatch when the incumbent reads features another way."""

    def choice(
        chosen: str, reason: str, measured: InitProbe | None = None, found: VocabularyCoverage | None = None
    ) -> InitChoice:
        located = {"requested": "auto", "source": source, "version": version}
        return InitChoice(**located, chosen=chosen, reason=reason, probe=measured, vocabulary=found)

    if incumbent_contract is None:
        return choice("scratch", f"no drafter at {source} to warm-start from")
    try:
        check_compatible(incumbent_contract, data_contract)
    except ContractMismatch as err:
        return choice("scratch", f"{source} reads the features another way ({_one_line(err)})")
    differences = target_differences(incumbent_contract, data_contract)
    if not differences:
        return choice("warm", f"{source} was trained on this same target")
    measured = probe()
    changed = "; ".join(differences)
    verdict = "clears" if measured.cond_acc[0] >= measured.bar else "is under"
    reason = (
        f"{source} was trained on another target ({changed}); its held-out cond_acc_0 on the new data, "
        f"{measured.cond_acc[0]:.3f}, {verdict} the bar {measured.bar:.3f}"
    )
    if verdict != "clears" or coverage is None:
        return choice("warm" if verdict == "clears" else "scratch", reason, measured)
    found = coverage()
    missing = vocabulary_gap(found, max_vocabulary_gap)
    return choice("scratch" if missing else "warm", f"{reason}{missing or ''}", measured, found)


def vocabulary_gap(found: VocabularyCoverage, max_gap: float) -> str | None:
    """Why a warm start would be capped by the incumbent's draft vocabulary, or None."""
    if found.incumbent_outside - found.fresh_outside <= max_gap:
        return None
    return (
        f", but its draft vocabulary misses {found.incumbent_outside:.1%} of the new held-out tokens (one "
        f"built from the new data misses {found.fresh_outside:.1%}): a warm start keeps it and could never "
        "emit them"
    )


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def fixed_choice(config: RunConfig) -> InitChoice:
    """train.init scratch or warm: what the config says."""
    settings = config.train
    if settings.init == "warm":
        return InitChoice(
            requested="warm", chosen="warm", reason="train.init is warm", source=settings.init_from
        )
    return InitChoice(requested="scratch", chosen="scratch", reason="train.init is scratch")


def restart_choice(first: InitChoice, steps: int, cond_acc0: float) -> InitChoice:
    """The scratch attempt that follows a warm attempt stopped for an early plateau."""
    bar = first.restart_under
    under = f", under {bar.cond_acc0:.3f} ({bar.reason})" if bar else ""
    return InitChoice(
        requested=first.requested,
        chosen="scratch",
        reason=(
            f"the warm start from {first.source} plateaued at training cond_acc_0 {cond_acc0:.3f} after "
            f"{steps} steps{under}; restarted from scratch"
        ),
        source=first.source,
        version=first.version,
    )


def warm_plateau_reached(
    intervals: list[tuple[int, float]], window_steps: int, min_gain: float, bar: float
) -> bool:
    """Whether a warm start has stalled: the latest interval's training cond_acc_0 gained less than
    min_gain over the interval at least window_steps earlier, and is still under the bar. intervals:
    (global step, cond_acc_0) of each log interval, oldest first."""
    if not intervals:
        return False
    step, current = intervals[-1]
    earlier = [value for at, value in intervals if at <= step - window_steps]
    if not earlier:
        return False
    return current - earlier[-1] < min_gain and current < bar
