"""Alerts: what they say (pipeline.ops.alerts, pipeline.tasks), the deployment's notifier config, and
delivery through Airflow's own notifiers (the Slack, SMTP and HTTP providers) to local HTTP and SMTP
sinks on 127.0.0.1, deadline alerts included through the triggerer's callback trigger. Airflow runs in
a subprocess here (its home must not be fixed in this worker: the airflow_home fixture sets its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import yaml

from tests.conftest import REPO, AlertSinks

SLACK_TOKEN = "T0DRAFTER/B0ALERTS/slack-token-3c9d"
WEBHOOK_TOKEN = "webhook-bearer-81f2e0"


# Sends one alert of each kind through drafter_support.send_alert (a worker's callbacks), and runs each
# deadline alert's callback through Airflow's CallbackTrigger, as the triggerer does with a late run.
DELIVER = """
import asyncio, json, sys
sys.path.insert(0, "dags")
from drafter_support import DEPLOYMENT, deadline_alerts, send_alert
from pipeline.ops.alerts import failure_alert, inconclusive_alert, promotion_alert, rejection_alert
from airflow.triggers.callback import CallbackTrigger

send_alert(failure_alert("drafter_train", "run-f", "train", 2, RuntimeError("no route to s3://k:pw@b/x"), "http://af/log"))
send_alert(rejection_alert("run-r", "tiny-test", ["tau_simulated 1.4 < 50"], "file:///store/runs/run-r/report/report.html"))
promoted = {"version": "v0007-aa", "alias": "production", "registry_uri": "s3://b/drafters/tiny-test/versions/v0007-aa",
            "speedups": {"baseline": 1.8}, "pull_command": "drafter pull --alias v0007-aa"}
send_alert(promotion_alert("run-p", "tiny-test", promoted, "file:///r.html"))
undecided = [{"comparison": "candidate/baseline", "ratio": 1.503, "ci_low": 0.5, "ci_high": 4.52, "rounds": 3,
              "required": 1.0}]
todo = "rerun on a quiet machine, or raise benchmark.budget_s (now 90 s)"
send_alert(inconclusive_alert("run-i", "tiny-test", todo, undecided, "file:///i.html"))

async def late(alerts):
    run = {"dag_id": "drafter_data", "dag_run_id": "run-late", "queued_at": "2026-12-02T10:00:00Z"}
    context = {"dag_run": {**run, "state": "running"},
               "deadline": {"id": "d1", "deadline_time": "2026-12-02T10:00:06Z"}}
    states = []
    for alert in alerts:
        trigger = CallbackTrigger(alert.callback.path, {**alert.callback.kwargs, "context": context})
        states += [event.payload["state"] async for event in trigger.run()]
    return states

alerts = deadline_alerts("drafter_data")
print("DEADLINES", json.dumps([a.callback.path for a in alerts]))
print("STATES", json.dumps([str(s) for s in asyncio.run(late(alerts))]))
"""


def test_alerts_reach_slack_email_and_webhook_through_airflows_notifiers(tmp_path, alert_sinks):
    deployment = {
        "executor": "local",
        "deadline_minutes": {"drafter_data": 0.1},
        "notifiers": [
            *AlertSinks.NOTIFIERS,
            # a notifier whose server is down: logged without its address, the others still deliver
            {"kind": "webhook", "conn_id": "drafter_down", "events": ["failure"]},
        ],
    }
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(deployment))
    connections = {
        **alert_sinks.connections(SLACK_TOKEN, WEBHOOK_TOKEN),
        "drafter_down": {"conn_type": "http", "host": "127.0.0.1", "port": 9, "schema": "http"},
    }
    env = dict(
        os.environ,
        AIRFLOW_HOME=str(tmp_path / "airflow"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        DRAFTER_DEPLOYMENT=str(tmp_path / "deployment.yaml"),
        **{f"AIRFLOW_CONN_{name.upper()}": json.dumps(conn) for name, conn in connections.items()},
    )
    before_slack, before_hooks = len(alert_sinks.requests("/slack/")), len(alert_sinks.requests("/hooks/"))
    before_mail = len(alert_sinks.emails())
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DELIVER)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs[-4000:]

    # the deadline alerts: one per notifier taking them, each run to success by the callback trigger
    paths = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("DEADLINES"))[10:])
    assert paths == [
        "airflow.providers.slack.notifications.slack_webhook.SlackWebhookNotifier",
        "airflow.providers.smtp.notifications.smtp.SmtpNotifier",
        "airflow.providers.http.notifications.http.HttpNotifier",
    ]
    states = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("STATES"))[7:])
    assert states == ["running", "success"] * 3, logs[-4000:]

    slack_requests = alert_sinks.requests("/slack/")[before_slack:]
    slack = [json.loads(r["body"])["text"] for r in slack_requests]
    hooks = alert_sinks.requests("/hooks/")[before_hooks:]
    webhook = [json.loads(r["body"]) for r in hooks]
    mail = alert_sinks.emails()[before_mail:]
    # failure, rejection, promotion, inconclusive, deadline
    assert len(slack) == len(webhook) == len(mail) == 5
    assert all(r["path"] == f"/slack/{SLACK_TOKEN}" for r in slack_requests)
    assert all(r["path"] == "/hooks/drafter" for r in hooks)
    assert all(r["headers"]["Authorization"] == f"Bearer {WEBHOOK_TOKEN}" for r in hooks)

    failure, rejection, promotion, inconclusive, deadline = slack
    assert failure.startswith("*drafter: drafter_train task train failed*")
    assert "error: RuntimeError: no route to s3://***@b/x" in failure and "pw@" not in failure
    assert "reason: tau_simulated 1.4 < 50" in rejection and "production is unchanged" in rejection
    assert "version v0007-aa is now production" in promotion and "speedup vs baseline: 1.80x" in promotion
    assert "pull: drafter pull --alias v0007-aa" in promotion
    assert inconclusive.startswith(
        "*drafter: the benchmark could not tell whether the tiny-test candidate of run run-i is faster: not "
        "promoted*"
    )
    assert "what to do: rerun on a quiet machine, or raise benchmark.budget_s (now 90 s)" in inconclusive
    assert "candidate/baseline: 1.503 (interval 0.500-4.520, 3 rounds) holds the required 1.0" in inconclusive
    assert deadline.startswith("*drafter: drafter_data run run-late is past its deadline*")
    assert "deadline: 0.1 minutes after it was queued (2026-12-02T10:00:06Z)" in deadline

    assert [m["subject"] for m in mail] == [
        "drafter: drafter_train task train failed",
        "drafter: the gate rejected the tiny-test candidate of run run-r",
        "drafter: tiny-test version v0007-aa promoted",
        "drafter: the benchmark could not tell whether the tiny-test candidate of run run-i is faster: "
        "not promoted",
        "drafter: drafter_data run run-late is past its deadline",
    ]
    assert {(m["from"], m["to"]) for m in mail} == {("drafter@example.com", "ml-infra@example.com")}
    assert "<li>reason: tau_simulated 1.4 &lt; 50</li>" in mail[1]["body"]
    assert "<li>pull: drafter pull --alias v0007-aa</li>" in mail[2]["body"]
    assert "<li>production is unchanged</li>" in mail[3]["body"]
    assert "queued at 2026-12-02T10:00:00Z, state running" in mail[4]["body"]

    assert [hook["event"] for hook in webhook] == [
        "failure",
        "rejection",
        "promotion",
        "inconclusive",
        "deadline",
    ]
    assert webhook[0]["task_id"] == "train" and webhook[1]["reasons"] == ["tau_simulated 1.4 < 50"]
    assert webhook[2]["version"] == "v0007-aa" and webhook[2]["speedups"] == {"baseline": 1.8}
    assert webhook[3]["next_step"].endswith("(now 90 s)") and webhook[3]["undecided"][0]["rounds"] == 3
    assert webhook[4]["run_id"] == "run-late" and webhook[4]["deadline_minutes"] == 0.1

    assert "failure alert through the webhook notifier (connection drafter_down) failed" in logs
    for secret in (SLACK_TOKEN, WEBHOOK_TOKEN, AlertSinks.SMTP_PASSWORD, "pw@"):
        assert secret not in logs
