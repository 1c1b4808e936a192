"""drafter_data: prompts -> the target's own responses -> parity check -> hidden-state capture -> a dataset.

Triggered from the UI with a params form. Publishes the dataset as the `drafter_dataset` Asset, which
schedules drafter_train. Every task calls a pipeline stage; no pipeline logic lives here.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, Param, dag, task

DATASET_ASSET = Asset(name="drafter_dataset", uri="drafter://datasets")


@dag(
    dag_id="drafter_data",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["drafter"],
    params={
        "config": Param("configs/local.yaml", type="string", title="Run config",
                        description="YAML run config (path on the workers)"),
        "overrides": Param([], type="array", items={"type": "string"}, title="Config overrides",
                           description="dotted overrides, e.g. prompts.num_samples=2000"),
    },
)
def drafter_data():
    @task
    def snapshot_id(**context) -> str:
        from pipeline.ids import safe_id

        return safe_id(context["dag_run"].run_id)

    @task
    def prompts(snapshot: str, params=None) -> dict:
        from pipeline.tasks import run_stage

        return run_stage("prompts", params["config"], snapshot, params["overrides"])

    @task
    def generate(snapshot: str, prompt_set: dict, params=None) -> dict:
        from pipeline.tasks import run_stage

        return run_stage("generate", params["config"], snapshot, params["overrides"], prompts_uri=prompt_set["uri"])

    @task
    def parity(snapshot: str, responses: dict, params=None) -> dict:
        from pipeline.tasks import run_stage

        return run_stage("parity", params["config"], snapshot, params["overrides"], responses_uri=responses["uri"])

    @task
    def capture(snapshot: str, responses: dict, checked: dict, params=None) -> dict:
        from pipeline.tasks import run_stage

        return run_stage("capture", params["config"], snapshot, params["overrides"], responses_uri=responses["uri"])

    @task(outlets=[DATASET_ASSET])
    def publish_dataset(snapshot: str, captured: dict, params=None, outlet_events=None) -> dict:
        from pipeline.tasks import run_stage

        dataset = run_stage("dataset", params["config"], snapshot, params["overrides"], capture_uri=captured["uri"])
        outlet_events[DATASET_ASSET].extra = {"dataset_uri": dataset["uri"], "config": params["config"],
                                              "overrides": params["overrides"]}
        return dataset

    snapshot = snapshot_id()
    prompt_set = prompts(snapshot)
    responses = generate(snapshot, prompt_set)
    publish_dataset(snapshot, capture(snapshot, responses, parity(snapshot, responses)))


drafter_data()
