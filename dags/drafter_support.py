"""Airflow glue shared by the drafter DAGs: how a pipeline stage becomes a task (in the worker
process, or a Kubernetes pod, as the deployment config says), S3 credentials from an Airflow
connection, and alerts through Airflow's notifiers (what they say: pipeline.ops.alerts). No pipeline
logic lives here."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os

import pendulum
from airflow.providers.common.compat.sdk import task_decorator_factory
from airflow.providers.standard.decorators.python import _PythonDecoratedOperator
from airflow.sdk import BaseOperatorLink, Param, dag, task

from pipeline.ops.alerts import Alert, deadline_alert, failure_alert
from pipeline.ops.deployment import NotifierConfig, load_deployment

DEPLOYMENT = load_deployment()
log = logging.getLogger("drafter.dags")


def drafter_dag(dag_id: str, schedule, params: dict[str, Param]):
    """The @dag decorator both drafter DAGs share: one run at a time, no catch-up, failures reported
    and alerted, and a deadline alert where the deployment sets the DAG a deadline."""
    return dag(
        dag_id=dag_id,
        schedule=schedule,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=1,
        tags=["drafter"],
        default_args={"on_failure_callback": report_failure},
        params=params,
        deadline=deadline_alerts(dag_id),
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
    """One clear line naming what failed (the exception itself is in the task log), and the failure
    alert to the deployment's notifiers."""
    ti = context.get("task_instance")
    dag_run = context.get("dag_run")
    error = context.get("exception")
    log.error(
        "drafter task %s of run %s failed: %s",
        getattr(ti, "task_id", "?"),
        getattr(dag_run, "run_id", "?"),
        type(error).__name__,
    )
    if DEPLOYMENT.notifiers_for("failure"):
        alert = failure_alert(
            getattr(ti, "dag_id", "?"),
            getattr(dag_run, "run_id", "?"),
            getattr(ti, "task_id", "?"),
            getattr(ti, "try_number", None),
            error if isinstance(error, BaseException) else None,
            getattr(ti, "log_url", ""),
        )
        send_alert(alert, context)


def send_alert(alert: Alert | dict, context=None) -> None:
    """Deliver an alert through every notifier the deployment names for its kind. A notifier that
    fails is logged by its kind and connection only (an error can hold the address, and a Slack
    webhook's address is its secret) and does not fail the task."""
    if isinstance(alert, dict):
        alert = Alert(**alert)
    for notifier in DEPLOYMENT.notifiers_for(alert.event):
        kind, kwargs = _notifier_call(notifier, alert)
        try:
            kind(**kwargs).notify(context or {})
        except Exception as error:
            log.error(
                "%s alert through the %s notifier (connection %s) failed: %s",
                alert.event,
                notifier.kind,
                notifier.conn_id,
                type(error).__name__,
            )
        else:
            log.info(
                "%s alert sent through the %s notifier (connection %s)",
                alert.event,
                notifier.kind,
                notifier.conn_id,
            )


def notify_promotion(context) -> None:
    """The promote task's success callback, from what the task returned: the promotion alert, or the
    inconclusive benchmark's (nothing promoted, and what to do)."""
    if not (DEPLOYMENT.notifiers_for("promotion") or DEPLOYMENT.notifiers_for("inconclusive")):
        return
    from pipeline.tasks import inconclusive_notice, promotion_notice

    ti = context["ti"]
    run, promoted = ti.xcom_pull(task_ids="configure"), ti.xcom_pull(task_ids=ti.task_id)
    alert = promotion_notice(run, promoted) or inconclusive_notice(run, promoted)
    if alert is not None:
        send_alert(alert, context)


def deadline_alerts(dag_id: str) -> list:
    """Airflow deadline alerts for a DAG with a deadline in the deployment: counted from when a run
    was queued, one per notifier that takes deadline alerts. Airflow's triggerer delivers them,
    rendering the alert's templates with the late run."""
    minutes = DEPLOYMENT.deadline_minutes.get(dag_id)
    if minutes is None:
        return []
    from airflow.sdk.definitions.deadline import AsyncCallback, DeadlineAlert, DeadlineReference

    alert = deadline_alert(dag_id, minutes)
    return [
        DeadlineAlert(
            reference=DeadlineReference.DAGRUN_QUEUED_AT,
            interval=dt.timedelta(minutes=minutes),
            callback=AsyncCallback(kind, kwargs=kwargs),
            name=f"{dag_id}-deadline-{notifier.kind}-{notifier.conn_id}",
        )
        for notifier in DEPLOYMENT.notifiers_for("deadline")
        for kind, kwargs in [_notifier_call(notifier, alert)]
    ]


def _notifier_call(notifier: NotifierConfig, alert: Alert) -> tuple[type, dict]:
    """The provider's notifier class for a notifier config, and its arguments for this alert."""
    if notifier.kind == "slack":
        from airflow.providers.slack.notifications.slack_webhook import SlackWebhookNotifier

        return SlackWebhookNotifier, {"slack_webhook_conn_id": notifier.conn_id, "text": alert.text}
    if notifier.kind == "email":
        from airflow.providers.smtp.notifications.smtp import SmtpNotifier

        return SmtpNotifier, {
            "smtp_conn_id": notifier.conn_id,
            "to": list(notifier.to),
            "from_email": notifier.from_email,
            "subject": alert.subject,
            "html_content": alert.html,
        }
    from airflow.providers.http.notifications.http import HttpNotifier

    return HttpNotifier, {
        "http_conn_id": notifier.conn_id,
        "endpoint": notifier.endpoint,
        "json": alert.payload,
    }


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

            from drafter_triggers import connection_keys

            try:
                keys = connection_keys(Connection.get(conn_id))
            except (
                AirflowNotFoundException,
                AirflowRuntimeError,
            ):  # no such connection: keep the environment
                keys = None
            if keys is not None:
                os.environ["AWS_ACCESS_KEY_ID"] = keys.access_key_id
                os.environ["AWS_SECRET_ACCESS_KEY"] = keys.secret_access_key
                if keys.region:
                    os.environ["AWS_DEFAULT_REGION"] = keys.region
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


def watched_asset(name: str, trigger):
    """An Asset whose events come from `trigger`, polled by the triggerer (an AssetWatcher)."""
    from airflow.sdk import Asset, AssetWatcher

    return Asset(
        name=name, uri=f"drafter://{name}", watchers=[AssetWatcher(name=f"{name}_watch", trigger=trigger)]
    )


def watch_asset(kind: str, trigger_class: str):
    """The asset of the deployment's watch.<kind>, fired by drafter_triggers.<trigger_class> as the
    triggerer polls it; None where the deployment does not watch it."""
    watch = getattr(DEPLOYMENT.watch, kind) if DEPLOYMENT.watch else None
    if watch is None:
        return None
    import drafter_triggers

    trigger = getattr(drafter_triggers, trigger_class)(
        watch=watch.model_dump(mode="json"),
        run_config=DEPLOYMENT.run_config,
        aws_conn_id=DEPLOYMENT.aws_conn_id,
    )
    return watched_asset(f"drafter_{kind}", trigger)


def served_acceptance_asset():
    """The fleet's acceptance under its floor (the deployment's watch.served_acceptance), or None."""
    return watch_asset("served_acceptance", "ServedAcceptanceTrigger")


def target_revision_asset():
    """Another target revision served than the production drafter's (watch.target_revision), or None."""
    return watch_asset("target_revision", "TargetRevisionTrigger")


def data_schedule():
    """drafter_data's schedule: the fleet serving another target revision, where that is watched."""
    asset = target_revision_asset()
    return None if asset is None else [asset]


def retrain_schedule(asset):
    """drafter_train's schedule: a published dataset or the fleet's acceptance under its floor, or the
    deployment's retraining cron."""
    import functools
    import operator

    from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable

    assets = [asset] + [watched for watched in (served_acceptance_asset(),) if watched is not None]
    condition = functools.reduce(operator.or_, assets)
    if not DEPLOYMENT.retrain_cron:
        return condition
    return AssetOrTimeSchedule(
        timetable=CronTriggerTimetable(DEPLOYMENT.retrain_cron, timezone="UTC"), assets=condition
    )


class StageLineage:
    """Mixin of the drafter's task operators: what a stage task read and published (the object-store
    URIs in the stage output it returned: pipeline.ops.lineage), reported as the task's inputs and
    outputs to Airflow's OpenLineage provider, which calls this when the task succeeds. The provider
    emits nothing until its transport is configured ([openlineage] transport)."""

    stage_result: object = None

    def execute(self, context):
        self.stage_result = super().execute(context)
        return self.stage_result

    def get_openlineage_facets_on_complete(self, task_instance):
        from airflow.providers.openlineage.extractors import OperatorLineage
        from openlineage.client.event_v2 import Dataset

        from pipeline.ops.lineage import dataset_name, stage_lineage

        inputs, outputs = stage_lineage(self.stage_result)
        return OperatorLineage(
            inputs=[Dataset(*dataset_name(uri)) for uri in inputs],
            outputs=[Dataset(*dataset_name(uri)) for uri in outputs],
        )


class StagePythonOperator(StageLineage, _PythonDecoratedOperator):
    """`@task` (a worker task), its lineage reported."""


def _stage_python_task(**options):
    return task_decorator_factory(decorated_operator_class=StagePythonOperator, **options)


def worker_task(stage: str | None = None, short_circuit: bool = False, **extra):
    """A task that runs on the Airflow worker itself (light steps: planning, the gate, publishing an
    Asset; every stage with the local executor), with the stage's retries and timeout, S3 credentials
    from the connection and its lineage reported. A short-circuit task (the gate) skips everything
    downstream when it returns a false value."""
    options = {**(DEPLOYMENT.task_options(stage) if stage else {}), **extra}
    decorator = task.short_circuit if short_circuit else _stage_python_task
    return lambda function: decorator(**options)(
        _with_s3_connection(_failing_permanent_errors_at_once(function))
    )


def stage_task(stage: str, **extra):
    """The decorator for a pipeline stage's task: retries, timeout, pool and placement (the worker, or
    a Kubernetes pod with the stage's image and resources) from the deployment config."""
    if DEPLOYMENT.executor == "kubernetes":
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

    class StagePodOperator(StageLineage, _KubernetesDecoratedOperator):
        """`@task.kubernetes`, applied through `stage_task`.

        The provider ships the task function's source into the pod and strips only the decorator named
        here from it: under its own name `@task.kubernetes` it would leave `@stage_task(...)` in the
        shipped script, which fails in the pod with a NameError. A pod that ends with a permanent
        failure's exit code (pipeline.failures) fails the task at once instead of being retried. A stage
        whose pod follows the run's engine (the deployment's `engines`) is placed, when its pod is
        created, by the engine the run's configure step found (a vLLM benchmark in the vLLM image,
        in-process capture on a GPU node). Its lineage is reported as a worker task's is (StageLineage).
        """

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
            from pipeline.exit_codes import PERMANENT_EXIT_CODES, exit_code_meaning

            try:
                super().cleanup(pod, remote_pod, xcom_result, context)
            except AirflowFailException:
                raise
            except AirflowException as failure:
                code = _exit_code(remote_pod, self.base_container_name)
                if code in PERMANENT_EXIT_CODES:
                    # what it was first (a failure alert shows the start of this), the pod's status after
                    summary, _, status = str(failure).partition("\n")
                    raise AirflowFailException(
                        f"{summary} It exited {code}: {exit_code_meaning(code)}; not retried (the pod's "
                        f"log has the error)\n{status}"
                    ) from failure
                raise


def _exit_code(pod, container_name: str) -> int | None:
    statuses = (pod.status.container_statuses if pod is not None and pod.status else None) or []
    for status in statuses:
        if status.name == container_name and status.state and status.state.terminated:
            return status.state.terminated.exit_code
    return None
