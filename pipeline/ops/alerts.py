"""What a drafter alert says: a failed task, a rejected candidate, a promoted version, a benchmark that
could not tell whether the candidate is faster, a run past its deadline. Plain data here; the DAGs deliver
it through Airflow's notifiers (Slack webhook, SMTP email, a generic webhook) as the deployment config
names them (pipeline.ops.deployment.NotifierConfig).

An alert carries no secret: an error's text has every URL's user and password masked, and notifiers
take their addresses and credentials from Airflow connections, never from here."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.credentials import without_credentials

AlertEvent = Literal["failure", "rejection", "promotion", "inconclusive", "deadline"]
ALERT_EVENTS: tuple[AlertEvent, ...] = ("failure", "rejection", "promotion", "inconclusive", "deadline")
ERROR_CHARS = 600  # of a failed task's error in its alert (the task log holds all of it)


@dataclass(frozen=True)
class Alert:
    """One alert: a subject line, the lines under it, and the same facts as fields for a webhook."""

    event: AlertEvent
    subject: str
    lines: list[str]
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """Plain text (Slack)."""
        return "\n".join([f"*{self.subject}*", *(f"• {line}" for line in self.lines)])

    @property
    def html(self) -> str:
        """An email body."""
        items = "".join(f"<li>{html.escape(line)}</li>" for line in self.lines)
        return f"<h3>{html.escape(self.subject)}</h3><ul>{items}</ul>"

    @property
    def payload(self) -> dict[str, Any]:
        """A generic webhook's JSON body."""
        return {"event": self.event, "subject": self.subject, "lines": self.lines, **self.facts}


def failure_alert(
    dag_id: str, run_id: str, task_id: str, try_number: int | None, error: BaseException | None, log_url: str
) -> Alert:
    """A task that failed for good (its retries spent, or a permanent failure)."""
    error_text = _error_text(error)
    lines = [f"run {run_id}", f"task {task_id} (attempt {try_number or '?'})", f"error: {error_text}"]
    if log_url:
        lines.append(f"log: {log_url}")
    facts = {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "try_number": try_number}
    return Alert(
        "failure",
        f"drafter: {dag_id} task {task_id} failed",
        lines,
        {**facts, "error": error_text, "log_url": log_url},
    )


def rejection_alert(run_id: str, target: str, reasons: list[str], report_uri: str) -> Alert:
    """The gate rejected a candidate: nothing is benchmarked or promoted."""
    lines = [f"run {run_id}", *(f"reason: {reason}" for reason in reasons)]
    lines += ["production is unchanged", f"report: {report_uri}"]
    return Alert(
        "rejection",
        f"drafter: the gate rejected the {target} candidate of run {run_id}",
        lines,
        {"run_id": run_id, "target": target, "reasons": reasons, "report": report_uri},
    )


def inconclusive_alert(
    run_id: str, target: str, next_step: str, undecided: list[dict[str, Any]], report_uri: str
) -> Alert:
    """The benchmark could not tell whether the candidate is faster (its intervals stayed too wide):
    nothing is promoted. Neither a failure nor a slower candidate: `next_step` says how a rerun decides."""
    lines = [
        f"run {run_id}",
        *(
            f"{entry['comparison']}: {entry['ratio']:.3f} (interval {entry['ci_low']:.3f}-"
            f"{entry['ci_high']:.3f}, {entry['rounds']} rounds) holds the required {entry['required']}"
            for entry in undecided
        ),
        "production is unchanged",
        f"what to do: {next_step}",
        f"report: {report_uri}",
    ]
    return Alert(
        "inconclusive",
        f"drafter: the benchmark could not tell whether the {target} candidate of run {run_id} is faster: "
        "not promoted",
        lines,
        {
            "run_id": run_id,
            "target": target,
            "next_step": next_step,
            "undecided": undecided,
            "report": report_uri,
        },
    )


def promotion_alert(
    run_id: str,
    target: str,
    promoted: dict[str, Any],
    report_uri: str,
) -> Alert:
    """A promoted drafter version: its speedups and the command that pulls it (`promoted`: the promote
    stage's output)."""
    speedups = promoted.get("speedups") or {}
    lines = [
        f"version {promoted['version']} is now {promoted['alias']} ({promoted['registry_uri']})",
        *(f"speedup vs {method}: {value:.2f}x" for method, value in speedups.items()),
        f"pull: {promoted['pull_command']}",
        f"run {run_id}, report: {report_uri}",
    ]
    return Alert(
        "promotion",
        f"drafter: {target} version {promoted['version']} promoted",
        lines,
        {
            "run_id": run_id,
            "target": target,
            "version": promoted["version"],
            "alias": promoted["alias"],
            "registry_uri": promoted["registry_uri"],
            "speedups": speedups,
            "pull_command": promoted["pull_command"],
            "report": report_uri,
        },
    )


def deadline_alert(dag_id: str, minutes: float) -> Alert:
    """A run still going `minutes` after it was queued. Its fields are Jinja templates the notifier
    renders in Airflow's triggerer with the run's `dag_run` and `deadline` (the deadline alert's context)."""
    run = "{{ dag_run.dag_run_id }}"
    lines = [
        f"run {run}, queued at {{{{ dag_run.queued_at }}}}, state {{{{ dag_run.state }}}}",
        f"deadline: {minutes:g} minutes after it was queued ({{{{ deadline.deadline_time }}}})",
        "see docs/RUNBOOK.md: a slow or stalled run",
    ]
    return Alert(
        "deadline",
        f"drafter: {dag_id} run {run} is past its deadline",
        lines,
        {"dag_id": dag_id, "run_id": run, "deadline_minutes": minutes},
    )


def _error_text(error: BaseException | None) -> str:
    if error is None:
        return "unknown (see the task log)"
    message = " ".join(str(error).split())
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    text = without_credentials(text)
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 1] + "…"
