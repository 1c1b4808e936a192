"""Airflow glue shared by the drafter DAGs: how a pipeline stage becomes a task (in the worker
process, or a Kubernetes pod, as the deployment config says), S3 credentials from an Airflow
connection, and a failure callback. No pipeline logic lives here."""

from __future__ import annotations

import functools
import logging
import os

import pendulum
from airflow.sdk import BaseOperatorLink, Param, dag, task

from pipeline.ops.deployment import load_deployment

DEPLOYMENT = load_deployment()
log = logging.getLogger("drafter.dags")


def drafter_dag(dag_id: str, schedule, params: dict[str, Param]):
    """The @dag decorator both drafter DAGs share: one run at a time, no catch-up, failures reported."""
    return dag(
        dag_id=dag_id,
        schedule=schedule,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=1,
        tags=["drafter"],
        default_args={"on_failure_callback": report_failure},
        params=params,
    )


def trigger_form(config_description: str, override_example: str, **fields: Param) -> dict[str, Param]:
    """A DAG's trigger form: the run config (the deployment's by default), the DAG's own fields, and
    dotted config overrides."""
    return {
        "config": Param(
            DEPLOYMENT.run_config,
            type="string",
            minLength=1,
            title="Run config",
            description=config_description,
        ),
        **fields,
        "overrides": optional(
            "array",
            "Config overrides",
            f"Dotted overrides, e.g. {override_example}",
            items={"type": "string", "pattern": "^[A-Za-z0-9_.]+=.*$"},
        ),
    }


def optional(kind: str, title: str, description: str, **schema) -> Param:
    """A trigger-form field that may stay empty (the UI form does not require it)."""
    return Param(None, type=["null", kind], title=title, description=description, **schema)


def report_failure(context) -> None:
    """One clear line naming what failed; the exception itself is in the task log."""
    ti = context.get("task_instance")
    log.error(
        "drafter task %s of run %s failed: %s",
        getattr(ti, "task_id", "?"),
        getattr(context.get("dag_run"), "run_id", "?"),
        type(context.get("exception")).__name__,
    )


def _failing_permanent_errors_at_once(function):
    """A config error, contract mismatch, failed parity or rejected candidate fails the task without
    retries: a retry cannot fix it (pipeline.failures)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        from pipeline.failures import is_permanent

        try:
            return function(*args, **kwargs)
        except Exception as error:
            if is_permanent(error):
                from airflow.sdk.exceptions import AirflowFailException

                raise AirflowFailException(f"{type(error).__name__}: {error} (not retried)") from error
            raise

    return wrapper


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
            except (
                AirflowNotFoundException,
                AirflowRuntimeError,
            ):  # no such connection: keep the environment
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


def configured(run: dict | None) -> dict:
    """The run a teardown reports on. A run whose config never resolved (its configure task failed)
    has nothing to report: the teardown is skipped, not failed (and not retried)."""
    if run is None:
        from airflow.sdk.exceptions import AirflowSkipException

        raise AirflowSkipException(
            "the run config did not resolve (see the configure task): nothing to report"
        )
    return run


def with_report_link(task_output):
    """Attach the report link to the task producing `task_output` (an XComArg)."""
    task_output.operator.operator_extra_links = (RunReportLink(),)
    return task_output


def retrain_schedule(asset):
    """drafter_train's schedule: a published dataset, or the deployment's retraining cron."""
    from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable

    if not DEPLOYMENT.retrain_cron:
        return [asset]
    return AssetOrTimeSchedule(
        timetable=CronTriggerTimetable(DEPLOYMENT.retrain_cron, timezone="UTC"), assets=[asset]
    )


def worker_task(stage: str | None = None, short_circuit: bool = False, **extra):
    """A task that runs on the Airflow worker itself (light steps: planning, the gate, publishing an
    Asset), with the stage's retries and timeout and S3 credentials from the connection. A
    short-circuit task (the gate) skips everything downstream when it returns a false value."""
    options = {**(DEPLOYMENT.task_options(stage) if stage else {}), **extra}
    decorator = task.short_circuit if short_circuit else task
    return lambda function: decorator(**options)(
        _with_s3_connection(_failing_permanent_errors_at_once(function))
    )


def stage_task(stage: str, **extra):
    """The decorator for a pipeline stage's task: retries, timeout, pool and placement (the worker, or
    a Kubernetes pod with the stage's image and resources) from the deployment config."""
    if DEPLOYMENT.executor == "kubernetes":
        from airflow.providers.common.compat.sdk import task_decorator_factory

        return task_decorator_factory(
            decorated_operator_class=StagePodOperator,
            drafter_stage=stage,
            **DEPLOYMENT.pod_options(stage),
            **{**DEPLOYMENT.task_options(stage), **extra},
        )
    return worker_task(stage, **extra)


def pod_mount_paths() -> list[str] | None:
    """Where the task pods mount volumes (None when tasks run in the worker): the configure step
    refuses a run config that names a local path outside them."""
    if DEPLOYMENT.executor != "kubernetes":
        return None
    return [mount.path for mount in DEPLOYMENT.pod_mounts("configure")]


if DEPLOYMENT.executor == "kubernetes":
    from airflow.providers.cncf.kubernetes.decorators.kubernetes import _KubernetesDecoratedOperator
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    class StagePodOperator(_KubernetesDecoratedOperator):
        """`@task.kubernetes`, applied through `stage_task`.

        The provider ships the task function's source into the pod and strips only the decorator named
        here from it: under its own name `@task.kubernetes` it would leave `@stage_task(...)` in the
        shipped script, which fails in the pod with a NameError. A pod that ends with a permanent
        failure's exit code (pipeline.failures) fails the task at once instead of being retried. A stage
        whose pod follows the run's engine (the deployment's `engines`) is placed, when its pod is
        created, by the engine the run's configure step found (a vLLM benchmark in the vLLM image,
        in-process capture on a GPU node)."""

        custom_operator_name = "@stage_task"

        def __init__(self, *, drafter_stage: str, **kwargs) -> None:
            super().__init__(**kwargs)
            self.drafter_stage = drafter_stage

        def execute(self, context):
            if DEPLOYMENT.follows_engine(self.drafter_stage):
                engine = context["ti"].xcom_pull(task_ids="configure")["engines"][self.drafter_stage]
                for field, value in DEPLOYMENT.placed_fields(self.drafter_stage, engine).items():
                    setattr(self, field, value)
                self.log.info("%s runs engine %s: its pod runs %s", self.drafter_stage, engine, self.image)
            return super().execute(context)

        def cleanup(self, pod, remote_pod, xcom_result=None, context=None) -> None:
            from pipeline.failures import PERMANENT_EXIT_CODES

            try:
                super().cleanup(pod, remote_pod, xcom_result, context)
            except AirflowFailException:
                raise
            except AirflowException as failure:
                if _exit_code(remote_pod, self.base_container_name) in PERMANENT_EXIT_CODES:
                    raise AirflowFailException(
                        f"{failure}\na permanent failure (config, contract, parity or gate): not retried"
                    ) from failure
                raise


def _exit_code(pod, container_name: str) -> int | None:
    statuses = (pod.status.container_statuses if pod is not None and pod.status else None) or []
    for status in statuses:
        if status.name == container_name and status.state and status.state.terminated:
            return status.state.terminated.exit_code
    return None
