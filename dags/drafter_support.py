"""Airflow glue shared by the drafter DAGs: how a pipeline stage becomes a task (in the worker
process, or a Kubernetes pod, as the deployment config says), S3 credentials from an Airflow
connection, and a failure callback. No pipeline logic lives here."""

from __future__ import annotations

import functools
import logging
import os

from airflow.sdk import BaseOperatorLink, task

from pipeline.deployment import load_deployment

DEPLOYMENT = load_deployment()
log = logging.getLogger("drafter.dags")


def report_failure(context) -> None:
    """One clear line naming what failed; the exception itself is in the task log."""
    ti = context.get("task_instance")
    log.error("drafter task %s of run %s failed: %s", getattr(ti, "task_id", "?"),
              getattr(context.get("dag_run"), "run_id", "?"), type(context.get("exception")).__name__)


def _with_s3_connection(function):
    """Export the connection's S3 credentials to the task process (never to logs or XCom)."""
    conn_id = DEPLOYMENT.aws_conn_id

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if conn_id:
            from airflow.sdk import Connection
            from airflow.sdk.exceptions import AirflowNotFoundException, AirflowRuntimeError

            try:
                connection = Connection.get(conn_id)
            except (AirflowNotFoundException, AirflowRuntimeError):  # no such connection: keep the environment
                connection = None
            if connection is not None and connection.login:
                os.environ["AWS_ACCESS_KEY_ID"] = connection.login
                os.environ["AWS_SECRET_ACCESS_KEY"] = connection.password or ""
                region = (connection.extra_dejson or {}).get("region_name")
                if region:
                    os.environ["AWS_DEFAULT_REGION"] = region
        return function(*args, **kwargs)

    return wrapper


class RunReportLink(BaseOperatorLink):
    """The run report's address as an extra link on the report task (from the task's XCom)."""

    name = "Run report"

    def get_link(self, operator, *, ti_key) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        return XCom.get_value(ti_key=ti_key, key=REPORT_LINK_KEY) or ""


REPORT_LINK_KEY = "report_link"


def show_report(ti, report: dict) -> dict:
    """Say where the run report is: a log line and the task's extra link."""
    log.info("run report (%s): %s", report["outcome"], report["link"])
    ti.xcom_push(key=REPORT_LINK_KEY, value=report["link"])
    return report


def with_report_link(task_output):
    """Attach the report link to the task producing `task_output` (an XComArg)."""
    task_output.operator.operator_extra_links = (RunReportLink(),)
    return task_output


def retrain_schedule(asset):
    """drafter_train's schedule: a published dataset, or the deployment's retraining cron."""
    from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable

    if not DEPLOYMENT.retrain_cron:
        return [asset]
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(DEPLOYMENT.retrain_cron, timezone="UTC"), assets=[asset])


def worker_task(stage: str | None = None, short_circuit: bool = False, **extra):
    """A task that runs on the Airflow worker itself (light steps: planning, the gate, publishing an
    Asset), with the stage's retries and timeout and S3 credentials from the connection. A
    short-circuit task (the gate) skips everything downstream when it returns a false value."""
    options = {**(DEPLOYMENT.task_options(stage) if stage else {}), **extra}
    decorator = task.short_circuit if short_circuit else task
    return lambda function: decorator(**options)(_with_s3_connection(function))


def stage_task(stage: str, **extra):
    """The decorator for a pipeline stage's task: retries, timeout, pool and placement (the worker, or
    a Kubernetes pod with the stage's image and resources) from the deployment config."""
    if DEPLOYMENT.executor == "kubernetes":
        return task.kubernetes(**DEPLOYMENT.pod_options(stage), **{**DEPLOYMENT.task_options(stage), **extra})
    return worker_task(stage, **extra)
