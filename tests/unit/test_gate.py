"""The gate's decision: thresholds, the incumbent, and each held-out domain against the incumbent's."""

import pytest

from pipeline.config import GateConfig
from pipeline.promotion import gate_record, signed
from pipeline.records import DomainAcceptance, EvalRecord, IncumbentEval
from tests.builders import eval_record


def _domain(tau: float, samples: int = 10) -> DomainAcceptance:
    full = [tau - 1.0]
    return DomainAcceptance(
        samples=samples, acc=full, full_acc=full, cond_acc=full, tau_simulated=tau, full_acc_at={}
    )


def _evaluated(pooled: float, domains: dict[str, float], incumbent: IncumbentEval | None) -> EvalRecord:
    return eval_record().model_copy(
        update={
            "tau_simulated": pooled,
            "domains": {name: _domain(tau) for name, tau in domains.items()},
            "incumbent": incumbent,
        }
    )


def _incumbent(pooled: float, domains: dict[str, float]) -> IncumbentEval:
    return IncumbentEval(
        version="v1",
        acc=[0.5],
        full_acc=[0.5],
        cond_acc=[0.5],
        tau_simulated=pooled,
        full_acc_at={},
        domains={name: _domain(tau) for name, tau in domains.items()},
    )


GATE = GateConfig(min_cond_acc=[0.1], min_tau_simulated=1.0, max_domain_regression_vs_incumbent=0.05)


def test_a_candidate_better_on_average_but_worse_on_one_domain_is_refused_naming_it():
    incumbent = _incumbent(2.0, {"chat": 2.2, "math": 1.8})
    # better pooled (2.3 > 2.0), much better on chat, but math falls 0.3 below the incumbent's
    evaluation = _evaluated(2.3, {"chat": 2.8, "math": 1.5}, incumbent)
    decision = gate_record(evaluation, GATE, "r1")
    assert not decision.passed
    failed = [check for check in decision.checks if not check.passed]
    assert [check.check for check in failed] == ["tau_simulated_vs_incumbent[math]"]
    assert failed[0].threshold == pytest.approx(1.75) and failed[0].incumbent_version == "v1"
    assert any(
        reason.startswith("tau_simulated_vs_incumbent[math] = 1.5000 <") for reason in decision.reasons
    )


def test_every_domain_within_the_margin_passes_and_new_domains_have_nothing_to_compare():
    incumbent = _incumbent(2.0, {"chat": 2.2, "math": 1.8})
    evaluation = _evaluated(2.1, {"chat": 2.3, "math": 1.76, "code": 1.2}, incumbent)
    decision = gate_record(evaluation, GATE, "r1")
    assert decision.passed
    checked = {check.check for check in decision.checks}
    assert {"tau_simulated_vs_incumbent[chat]", "tau_simulated_vs_incumbent[math]"} <= checked
    assert "tau_simulated_vs_incumbent[code]" not in checked  # the incumbent never saw code


def test_domains_are_not_checked_unless_the_gate_asks():
    incumbent = _incumbent(2.0, {"chat": 2.2, "math": 1.8})
    evaluation = _evaluated(2.3, {"chat": 2.8, "math": 1.5}, incumbent)
    lenient = GATE.model_copy(update={"max_domain_regression_vs_incumbent": None})
    assert gate_record(evaluation, lenient, "r1").passed


def test_the_report_shows_each_domain_beside_the_incumbent():
    from pipeline.ops.report import RunRecord, render_html

    incumbent = _incumbent(2.0, {"chat": 2.2})
    evaluation = _evaluated(2.3, {"chat": 2.8, "math": 1.5}, incumbent)
    page = render_html(RunRecord("r1", config={}, eval=evaluation, stages=["eval"]), {}, ([], ""))
    chat = "<th>domain chat (eval, 10 held out)</th><td>cond_acc_k 1.8; tau simulated 2.800 (incumbent 2.200)"
    assert chat in page
    assert (
        "<tr><th>domain math (eval, 10 held out)</th><td>cond_acc_k 0.5; tau simulated 1.500</td></tr>"
        in page
    )


def test_a_candidate_behind_the_incumbent_by_any_margin_is_refused_with_by_how_much_and_where():
    incumbent = _incumbent(2.0, {"chat": 2.2, "math": 1.8})
    evaluation = _evaluated(1.99, {"chat": 2.25, "math": 1.73}, incumbent)
    decision = gate_record(
        evaluation, GATE.model_copy(update={"max_domain_regression_vs_incumbent": None}), "r1"
    )
    assert not decision.passed
    failed = [check for check in decision.checks if not check.passed]
    assert [(c.check, c.threshold) for c in failed] == [("tau_simulated_vs_incumbent", 2.0)]
    assert (
        "against incumbent v1: tau_simulated 1.990 vs 2.000, behind by 0.0100 "
        "(per domain: chat ahead by 0.0500, math behind by 0.0700)"
    ) in decision.reasons
    # level with the incumbent is not behind it
    assert gate_record(_evaluated(2.0, {}, incumbent), GATE, "r2").passed
    assert signed(0.0) == "level" and signed(-0.25) == "behind by 0.2500"


def test_a_config_that_tolerates_a_regression_against_the_incumbent_is_refused_with_the_reason():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_regression_vs_incumbent was removed: a candidate behind"):
        GateConfig(min_cond_acc=[0.1], max_regression_vs_incumbent=0.05)


def test_the_report_and_status_say_by_how_much_and_where_a_candidate_trails_the_incumbent(tmp_path):
    from pipeline import layout
    from pipeline.manifest import publish
    from pipeline.ops.report import RunRecord, incumbent_rows, render_html, status_table
    from pipeline.records import publish_record
    from pipeline.storage import StorageConfig, open_store

    incumbent = _incumbent(2.0, {"chat": 2.2, "math": 1.8}).model_copy(
        update={"target_differs": ["revision 'k2' -> 'k2.5'"]}
    )
    evaluation = _evaluated(1.9, {"chat": 2.3, "math": 1.5}, incumbent)
    assert incumbent_rows(evaluation) == [
        ("vs incumbent v1 (tau simulated, eval)", "1.900 vs 2.000: behind by 0.1000"),
        ("vs incumbent on chat", "2.300 vs 2.200: ahead by 0.1000"),
        ("vs incumbent on math", "1.500 vs 1.800: behind by 0.3000"),
        ("incumbent trained for another target", "revision 'k2' -> 'k2.5'"),
    ]
    page = render_html(RunRecord("r1", config={}, eval=evaluation, stages=["eval"]), {}, ([], ""))
    assert "<th>vs incumbent on math</th><td>1.500 vs 1.800: behind by 0.3000</td>" in page
    store = open_store(StorageConfig(root=str(tmp_path / "store")))
    publish(store, layout.run_stage_prefix("r1", "train"), "train", [], {"run_id": "r1"})
    publish_record(store, layout.run_stage_prefix("r1", "eval"), evaluation, {"run_id": "r1"})
    assert (
        "against incumbent v1: tau_simulated 1.900 vs 2.000, behind by 0.1000 "
        "(per domain: chat ahead by 0.1000, math behind by 0.3000)"
    ) in status_table(store, "tiny")
    skipped = eval_record()  # an incumbent that reads other features
    assert incumbent_rows(skipped) == [
        ("vs incumbent v0", "not compared: different capture contract: vocab_size")
    ]
