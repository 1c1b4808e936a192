"""The gate's decision: thresholds, the incumbent, and each held-out domain against the incumbent's."""

import pytest

from pipeline.config import GateConfig
from pipeline.records import DomainAcceptance, EvalRecord, IncumbentEval
from pipeline.stages.gate import decide
from tests.test_records import eval_record


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
    decision = decide(evaluation, GATE, "r1")
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
    decision = decide(evaluation, GATE, "r1")
    assert decision.passed
    checked = {check.check for check in decision.checks}
    assert {"tau_simulated_vs_incumbent[chat]", "tau_simulated_vs_incumbent[math]"} <= checked
    assert "tau_simulated_vs_incumbent[code]" not in checked  # the incumbent never saw code


def test_domains_are_not_checked_unless_the_gate_asks():
    incumbent = _incumbent(2.0, {"chat": 2.2, "math": 1.8})
    evaluation = _evaluated(2.3, {"chat": 2.8, "math": 1.5}, incumbent)
    lenient = GATE.model_copy(update={"max_domain_regression_vs_incumbent": None})
    assert decide(evaluation, lenient, "r1").passed


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
