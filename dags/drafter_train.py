"""drafter_train: train -> evaluate -> gate -> benchmark -> promote, then the run report.

Scheduled when drafter_data publishes a dataset (the `drafter_dataset` Asset) OR on the deployment's
retraining cron (then it trains on the newest dataset of the target); also triggered from the UI.
A rejected candidate short-circuits at the gate: benchmark and promote are skipped, and the gate's
log, its alert and the stored decision record say why. A benchmark that could not tell whether the
candidate is faster promotes nothing and is no failure: the promote task returns that outcome, and its
success callback sends the `inconclusive` alert with what to do, as it alerts a promotion; a slower
candidate fails the promote task. Failures and overrunning runs are alerted by drafter_support (the
deployment's `notifiers`).
The report (plots + report.html in runs/<run_id>/report/) is rendered however the run went; its
address is in the report task's log and its "Run report" link.
"""

from __future__ import annotations

import logging

from airflow.sdk import Asset, Param
from drafter_support import (
    DEPLOYMENT,
    configured,
    drafter_dag,
    notify_promotion,
    optional,
    pod_mount_paths,
    retrain_schedule,
    send_alert,
    show_report,
    stage_task,
    trigger_form,
    with_report_link,
    worker_task,
)

DATASET_ASSET = Asset(name="drafter_dataset", uri="drafter://datasets")


@drafter_dag(
    "drafter_train",
    schedule=retrain_schedule(DATASET_ASSET),
    params=trigger_form(
        "Run config YAML in the task pods' image or config volume; scheduled "
        "runs use this default (the deployment config's run_config)",
        "train.learning_rate=1e-4",
        dataset_uri=optional(
            "string", "Dataset URI", "Empty: the triggering dataset, else the newest one of the target"
        ),
        epochs=optional("integer", "Epochs", "Training epochs (empty: the config's)", minimum=1, maximum=100),
        init=Param(
            "auto",
            type="string",
            enum=["auto", "scratch", "warm"],
            title="Initialization",
            description="auto (scheduled and dataset-triggered runs): warm-start from the production "
            "drafter when it was trained on the same target or scores well enough on the new data, "
            "else scratch, and restart from scratch if the warm start stalls; or always scratch, or "
            "always warm",
        ),
        init_from=optional(
            "string",
            "Warm start from",
            "A drafter directory or registry:<alias> (warm; auto's default is the registry alias)",
        ),
        min_cond_acc_0=optional(
            "number",
            "Gate: min cond_acc_0",
            "Override the gate's minimum first-step acceptance",
            minimum=0,
            maximum=1,
        ),
        min_tau_simulated=optional(
            "number",
            "Gate: min acceptance length",
            "Override the gate's minimum simulated acceptance length",
            minimum=1,
        ),
    ),
)
def drafter_train():
    @worker_task()
    def plan(params=None, dag_run=None, triggering_asset_events=None) -> dict:
        from pipeline.tasks import plan_training

        extras = [event.extra for stream in (triggering_asset_events or {}).values() for event in stream]
        return plan_training(
            params, dag_run.run_id, extras, DEPLOYMENT.run_config, dag_run.run_type, DEPLOYMENT.retrain_cron
        )

    @stage_task("configure")
    def configure(request: dict, mount_paths: list | None, usage_table: dict) -> dict:
        from pipeline.tasks import configure_training

        return configure_training(request, mount_paths, usage_table)

    @stage_task("train")
    def train(run: dict) -> dict:
        from pipeline.tasks import run_configured_stage

        return run_configured_stage("train", run, dataset_uri=run["dataset_uri"])

    @stage_task("evaluate")
    def evaluate(run: dict, trained: dict) -> dict:
        from pipeline.tasks import run_configured_stage

        return run_configured_stage("evaluate", run, dataset_uri=run["dataset_uri"], train_uri=trained["uri"])

    # skips only its direct downstream (benchmark); promote follows by its trigger rule, report still runs
    @worker_task("gate", short_circuit=True, ignore_downstream_trigger_rules=False)
    def gate(run: dict, evaluation: dict):
        from pipeline.tasks import gate_decision, rejection_notice

        decision = gate_decision(run["config"], run["run_id"], rates=run["rates"], eval_uri=evaluation["uri"])
        if not decision["passed"]:
            logging.getLogger("drafter.gate").warning(
                "gate rejected the candidate:\n  %s\nnot promoting: benchmark and promote are skipped",
                "\n  ".join(decision["reasons"]),
            )
            send_alert(rejection_notice(run, decision))
            return None
        return decision

    @stage_task("benchmark")
    def benchmark(run: dict, trained: dict, evaluation: dict, gated: dict) -> dict:
        from pipeline.tasks import run_configured_stage

        inputs = {"train_uri": trained["uri"], "eval_uri": evaluation["uri"]}
        return run_configured_stage("benchmark", run, prompts_uri=run["prompts_uri"], **inputs)

    @stage_task("promote", on_success_callback=notify_promotion)
    def promote(run: dict, trained: dict, evaluation: dict, gated: dict, bench: dict) -> dict:
        from pipeline.tasks import promotion_outcome

        inputs = {"train_uri": trained["uri"], "eval_uri": evaluation["uri"], "gate_uri": gated["uri"]}
        return promotion_outcome(
            run["config"], run["run_id"], rates=run["rates"], bench_uri=bench["uri"], **inputs
        )

    @worker_task("report")
    def report(run: dict | None, ti=None) -> dict:
        from pipeline.tasks import run_configured_stage

        run = configured(run)
        return show_report(ti, run_configured_stage("report", run))

    # records what started the run; a cron run with nothing new (the production drafter's own dataset and
    # target) stops here: train and everything after it are skipped, and the log says why
    @worker_task(short_circuit=True)
    def triggered(run: dict):
        from pipeline.tasks import record_trigger

        skipped = record_trigger(run)
        if skipped:
            logging.getLogger("drafter.trigger").warning("%s", skipped)
            return None
        return run["trigger"]

    run = configure(plan(), pod_mount_paths(), DEPLOYMENT.usage_table())
    trained = train(run)
    triggered(run) >> trained
    evaluation = evaluate(run, trained)
    gated = gate(run, evaluation)
    bench = benchmark(run, trained, evaluation, gated)
    promoted = promote(run, trained, evaluation, gated, bench)
    # a teardown: it runs however the run went and does not decide the run's state
    promoted >> with_report_link(report(run)).as_teardown()


drafter_train()
