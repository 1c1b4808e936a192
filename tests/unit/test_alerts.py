"""Alerts, without Airflow: what they say (pipeline.ops.alerts, pipeline.tasks) and the deployment's
notifier and deadline config. Delivery through Airflow's notifiers: tests/integration/test_alerts.py."""

from __future__ import annotations

import json

import jinja2
import pytest
import yaml

from tests.conftest import storage_config, tiny_config_dict


def test_a_failure_alert_masks_credentials_and_bounds_the_error():
    from pipeline.ops.alerts import ERROR_CHARS, failure_alert

    error = RuntimeError("reading s3://AKIA123:topsecret@bucket/key failed\n  " + "x" * 2000)
    alert = failure_alert("drafter_data", "manual__1", "capture_shard", 3, error, "http://airflow/log/1")
    assert alert.subject == "drafter: drafter_data task capture_shard failed"
    assert "topsecret" not in alert.text + json.dumps(alert.payload) + alert.html
    assert alert.payload["error"].startswith("RuntimeError: reading s3://***@bucket/key failed x")
    assert len(alert.payload["error"]) == ERROR_CHARS
    assert "task capture_shard (attempt 3)" in alert.lines and "log: http://airflow/log/1" in alert.lines
    assert failure_alert("d", "r", "t", None, None, "").payload["error"] == "unknown (see the task log)"


def _run(tmp_path, run_id: str = "manual__2026-12-02T10-00-00") -> dict:
    config = tiny_config_dict(storage_config("file", tmp_path, None))
    return {"run_id": run_id, "config": config, "source": {"config": "configs/tiny.yaml", "overrides": []}}


def test_promotion_and_rejection_notices_name_version_speedups_pull_command_and_reasons(tmp_path):
    from pipeline.tasks import promotion_notice, rejection_notice

    run = _run(tmp_path)
    report = f"file://{tmp_path}/store/runs/{run['run_id']}/report/report.html"
    promoted = {
        "uri": "file:///x",
        "kind": "promote",
        "promoted": True,
        "version": "v0003-abc",
        "alias": "production",
        "registry_uri": "file:///store/drafters/tiny-test/versions/v0003-abc",
        "speedups": {"baseline": 1.62, "ngram": 1.31, "incumbent": 1.04},
        "bench_engine": "vllm",
    }
    alert = promotion_notice(run, promoted)
    assert (
        alert["event"] == "promotion" and alert["subject"] == "drafter: tiny-test version v0003-abc promoted"
    )
    pull = (
        "drafter pull --config configs/tiny.yaml --target tiny-test --alias v0003-abc "
        "--dest ./drafters/tiny-test/v0003-abc --engine vllm"
    )
    assert alert["facts"]["pull_command"] == pull and f"pull: {pull}" in alert["lines"]
    assert "speedup vs baseline: 1.62x" in alert["lines"] and "speedup vs incumbent: 1.04x" in alert["lines"]
    assert alert["facts"]["report"] == report
    assert promotion_notice(run, {**promoted, "promoted": False}) is None
    # the reference decoder's benchmark names no serving engine: the pull takes its default
    reference = promotion_notice(run, {**promoted, "bench_engine": "reference"})
    assert reference["facts"]["pull_command"].endswith("--dest ./drafters/tiny-test/v0003-abc")

    reasons = ["cond_acc_0 0.031 < 0.05", "tau_simulated 1.4 < 50"]
    rejected = rejection_notice(run, {"passed": False, "reasons": reasons})
    assert rejected["event"] == "rejection"
    assert [line for line in rejected["lines"] if line.startswith("reason: ")] == [
        f"reason: {reason}" for reason in reasons
    ]
    assert "production is unchanged" in rejected["lines"] and rejected["facts"]["report"] == report


def test_the_gate_decision_lists_each_reason(tmp_path):
    from pipeline.promotion import GateFailed

    failed = GateFailed("gate failed for run r:\n  a\n  b", ["a", "b"])
    assert failed.reasons == ["a", "b"] and str(failed).endswith("b")


def test_a_pods_exit_code_says_what_kind_of_failure_it_was():
    from pipeline.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_GATE, exit_code_meaning

    assert exit_code_meaning(EXIT_BAD_INPUT).startswith("bad input (a config")
    assert exit_code_meaning(EXIT_GATE).startswith("a rejected candidate")
    assert exit_code_meaning(EXIT_FAILED) == "a failure a retry may fix"


def test_deadline_alert_templates_render_with_the_late_runs_context():
    from pipeline.ops.alerts import deadline_alert

    alert = deadline_alert("drafter_train", 2880)
    context = {
        "dag_run": {
            "dag_run_id": "scheduled__2026-12-01",
            "queued_at": "2026-12-01T04:00:00Z",
            "state": "running",
        },
        "deadline": {"deadline_time": "2026-12-03T04:00:00Z"},
    }
    text = jinja2.Template(alert.text).render(**context)
    assert "drafter_train run scheduled__2026-12-01 is past its deadline" in text
    assert "deadline: 2880 minutes after it was queued (2026-12-03T04:00:00Z)" in text
    assert "state running" in text


@pytest.mark.parametrize(
    "notifier, problem",
    [
        ({"kind": "email", "conn_id": "smtp_default"}, "needs `to`"),
        ({"kind": "slack", "conn_id": "s", "to": ["a@b.c"]}, "for email notifiers"),
        ({"kind": "slack", "conn_id": "s", "endpoint": "/x"}, "for webhook notifiers"),
        ({"kind": "webhook", "conn_id": "../etc"}, "conn_id"),
        ({"kind": "webhook", "conn_id": "w", "events": ["promoted"]}, "events"),
        ({"kind": "webhook", "conn_id": "w", "events": ["failure", "failure"]}, "named twice"),
        ({"kind": "webhook", "conn_id": "w", "url": "https://x"}, "url"),
        ({"kind": "pagerduty", "conn_id": "w"}, "kind"),
    ],
)
def test_a_notifier_config_that_cannot_work_is_refused(tmp_path, notifier, problem):
    from pipeline.config import ConfigError
    from pipeline.ops.deployment import load_deployment

    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump({"notifiers": [notifier]}))
    with pytest.raises(ConfigError, match=problem):
        load_deployment(path)


@pytest.mark.parametrize(
    "deadlines, problem",
    [({"drafter_nightly": 60}, "unknown DAGs"), ({"drafter_train": 0}, "positive number of minutes")],
)
def test_a_deadline_must_name_a_dag_and_be_positive(tmp_path, deadlines, problem):
    from pipeline.config import ConfigError
    from pipeline.ops.deployment import load_deployment

    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump({"deadline_minutes": deadlines}))
    with pytest.raises(ConfigError, match=problem):
        load_deployment(path)


def test_an_inconclusive_benchmark_has_its_own_alert_not_a_failure_or_a_refusal(tmp_path):
    from pipeline.benchmark_settings import BenchmarkConfig
    from pipeline.exit_codes import EXIT_INCONCLUSIVE, PERMANENT_EXIT_CODES, exit_code_meaning
    from pipeline.failures import exit_code_for
    from pipeline.promotion import BenchmarkInconclusive, speed_rule
    from pipeline.records import RatioInterval
    from pipeline.tasks import inconclusive_notice, promotion_notice

    run = _run(tmp_path)
    wide = RatioInterval(ratio=1.503, ci_low=0.50, ci_high=4.52, confidence=0.95, rounds=3)
    decision = speed_rule({"baseline": wide}, BenchmarkConfig(budget_s=90))
    stopped = BenchmarkInconclusive(decision)
    unsure = {"promoted": False, **stopped.outcome()}
    alert = inconclusive_notice(run, unsure)
    assert alert["event"] == "inconclusive"
    assert alert["subject"] == (
        f"drafter: the benchmark could not tell whether the tiny-test candidate of run {run['run_id']} "
        "is faster: not promoted"
    )
    assert (
        f"what to do: {decision.next_step}" in alert["lines"] and "production is unchanged" in alert["lines"]
    )
    assert "benchmark.budget_s (now 90 s)" in alert["facts"]["next_step"]
    assert alert["facts"]["undecided"][0]["comparison"] == "candidate/baseline"
    assert not any("failed" in line for line in [alert["subject"], *alert["lines"]])
    # neither a promotion nor a failure: its own event, and an exit code of its own that no retry changes
    assert promotion_notice(run, unsure) is None
    assert inconclusive_notice(run, {"promoted": False}) is None
    assert exit_code_for(stopped) == EXIT_INCONCLUSIVE == 4 and EXIT_INCONCLUSIVE in PERMANENT_EXIT_CODES
    assert exit_code_meaning(EXIT_INCONCLUSIVE).startswith("an inconclusive benchmark")


def test_a_notifier_can_take_inconclusive_benchmarks(tmp_path):
    from pipeline.ops.deployment import load_deployment

    path = tmp_path / "deployment.yaml"
    path.write_text(
        yaml.safe_dump({"notifiers": [{"kind": "webhook", "conn_id": "w", "events": ["inconclusive"]}]})
    )
    assert [n.conn_id for n in load_deployment(path).notifiers_for("inconclusive")] == ["w"]
    assert load_deployment(path).notifiers_for("failure") == []
