"""drafter_train: train -> evaluate -> gate -> benchmark -> promote.

Scheduled when drafter_data publishes a dataset (the `drafter_dataset` Asset) OR on the weekly
retraining cron (then it trains on the newest dataset of the target); also triggered from the UI.
A failing gate fails its task and nothing downstream (benchmark, promote) runs.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, Param, dag, task

DATASET_ASSET = Asset(name="drafter_dataset", uri="drafter://datasets")


@dag(
    dag_id="drafter_train",
    schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable("0 4 * * 0", timezone="UTC"),
                                 assets=[DATASET_ASSET]),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["drafter"],
    params={
        "config": Param("configs/local.yaml", type="string", title="Run config",
                        description="YAML run config (path on the workers)"),
        "overrides": Param([], type="array", items={"type": "string"}, title="Config overrides",
                           description="dotted overrides, e.g. train.epochs=3"),
        "dataset_uri": Param("", type="string", title="Dataset URI",
                             description="empty: the triggering dataset, else the newest one of the target"),
    },
)
def drafter_train():
    @task
    def resolve(params=None, **context) -> dict:
        from pipeline.ids import safe_id
        from pipeline.tasks import resolve_dataset

        events = context.get("triggering_asset_events") or {}
        extras = [event.extra for stream in events.values() for event in stream]
        chosen = params["dataset_uri"] or (extras[-1].get("dataset_uri") if extras else None)
        return {"run_id": safe_id(context["dag_run"].run_id),
                "dataset_uri": resolve_dataset(params["config"], params["overrides"], chosen)}

    @task
    def train(run: dict, params=None) -> dict:
        from pipeline.tasks import run_stage

        return run_stage("train", params["config"], run["run_id"], params["overrides"], dataset_uri=run["dataset_uri"])

    @task
    def evaluate(run: dict, trained: dict, params=None) -> dict:
        from pipeline.tasks import run_stage

        return run_stage("evaluate", params["config"], run["run_id"], params["overrides"],
                         dataset_uri=run["dataset_uri"], train_uri=trained["uri"])

    @task
    def gate(run: dict, evaluation: dict, params=None) -> dict:
        from pipeline.tasks import run_stage

        return run_stage("gate", params["config"], run["run_id"], params["overrides"], eval_uri=evaluation["uri"])

    @task
    def benchmark(run: dict, trained: dict, evaluation: dict, gated: dict, params=None) -> dict:
        from pipeline.tasks import prompts_uri_of, run_stage

        return run_stage("benchmark", params["config"], run["run_id"], params["overrides"], train_uri=trained["uri"],
                         eval_uri=evaluation["uri"], prompts_uri=prompts_uri_of(params["config"], params["overrides"],
                                                                                 run["dataset_uri"]))

    @task
    def promote(run: dict, trained: dict, evaluation: dict, gated: dict, bench: dict, params=None) -> dict:
        from pipeline.tasks import run_stage

        return run_stage("promote", params["config"], run["run_id"], params["overrides"], train_uri=trained["uri"],
                         eval_uri=evaluation["uri"], gate_uri=gated["uri"], bench_uri=bench["uri"])

    run = resolve()
    trained = train(run)
    evaluation = evaluate(run, trained)
    gated = gate(run, evaluation)
    bench = benchmark(run, trained, evaluation, gated)
    promote(run, trained, evaluation, gated, bench)


drafter_train()
