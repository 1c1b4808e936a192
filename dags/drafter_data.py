"""drafter_data: prompts -> the target's own responses (mapped over shards) -> parity check ->
hidden-state capture (mapped over shards) -> a dataset snapshot, published as the `drafter_dataset`
Asset that schedules drafter_train. The SGLang fleets generation and capture call are scaled up before
their stage and back to 0 after it by setup/teardown tasks (pipeline.ops.fleets; a teardown runs however
its stage ended). Every task calls a pipeline function; no pipeline logic lives here."""

from __future__ import annotations

from airflow.sdk import Asset
from drafter_support import (
    DEPLOYMENT,
    data_schedule,
    drafter_dag,
    optional,
    pod_mount_paths,
    stage_task,
    trigger_form,
    worker_task,
)

DATASET_ASSET = Asset(name="drafter_dataset", uri="drafter://datasets")


@drafter_dag(
    "drafter_data",
    schedule=data_schedule(),
    params=trigger_form(
        "Run config YAML in the task pods' image or config volume "
        "(e.g. configs/kimi-k2.5.yaml or /etc/drafter/kimi-k2.5.yaml)",
        "generate.max_new_tokens=512",
        num_samples=optional(
            "integer", "Conversations", "How many conversations to keep (empty: the config's)", minimum=1
        ),
        shard_size=optional(
            "integer",
            "Conversations per shard",
            "Shard size; each shard is one generate and one capture task",
            minimum=1,
        ),
        num_shards=optional(
            "integer",
            "Shards",
            "Split the conversations into about this many shards (held-out ones get their own)",
            minimum=1,
            maximum=10000,
        ),
        sources=optional(
            "array",
            "Prompt sources",
            '[{"kind": "jsonl", "path": "s3://bucket/prompts.jsonl", "weight": 1}] (empty: the config\'s)',
            items={
                "type": "object",
                "required": ["kind"],
                "properties": {
                    "kind": {"enum": ["demo", "jsonl", "json", "parquet", "arrow"]},
                    "path": {"type": "string"},
                    "weight": {"type": "number", "exclusiveMinimum": 0},
                },
            },
        ),
    ),
)
def drafter_data():
    @worker_task()
    def plan(params=None, dag_run=None, triggering_asset_events=None) -> dict:
        from pipeline.tasks import plan_data

        extras = [event.extra for stream in (triggering_asset_events or {}).values() for event in stream]
        return plan_data(params, dag_run.run_id, dag_run.run_type, extras, DEPLOYMENT.run_config)

    @stage_task("configure")
    def configure(request: dict, mount_paths: list | None, usage_table: dict) -> dict:
        from pipeline.tasks import configure_run

        return configure_run(request, mount_paths, usage_table)

    @stage_task("prompts")
    def prompts(run: dict) -> dict:
        from pipeline.tasks import run_configured_stage

        return run_configured_stage("prompts", run)

    @worker_task()
    def shards_of(prompt_set: dict) -> list:
        return prompt_set["shards"]

    @stage_task("generate")
    def generate_shard(run: dict, shard: str) -> dict:
        from pipeline.tasks import run_shard

        return run_shard("generate", run["config"], run["run_id"], shard, rates=run["rates"])

    @stage_task("generate")
    def responses(run: dict) -> dict:
        from pipeline.tasks import run_configured_stage

        return run_configured_stage("generate", run)

    @stage_task("fleet")
    def fleet_up(run: dict, stage: str, fleet: dict | None) -> dict:
        from pipeline.tasks import scale_fleet_up

        return scale_fleet_up(run["config"], stage, fleet)

    @stage_task("fleet")
    def fleet_down(stage: str, fleet: dict | None, run: dict, scaled: dict) -> dict:
        from pipeline.tasks import scale_fleet_down

        return scale_fleet_down(stage, fleet, run, scaled)

    @stage_task("parity")
    def parity(run: dict, regenerated: dict) -> dict:
        from pipeline.tasks import run_configured_stage

        return run_configured_stage("parity", run, responses_uri=regenerated["uri"])

    @stage_task("capture")
    def capture_shard(run: dict, checked: dict, shard: str) -> dict:
        from pipeline.tasks import run_shard

        return run_shard("capture", run["config"], run["run_id"], shard, rates=run["rates"])

    @stage_task("capture")
    def captures(run: dict) -> dict:
        from pipeline.tasks import run_configured_stage

        return run_configured_stage("capture", run)

    @worker_task("dataset", outlets=[DATASET_ASSET])
    def publish_dataset(run: dict, captured: dict, outlet_events=None) -> dict:
        from pipeline.tasks import run_configured_stage

        dataset = run_configured_stage("dataset", run, capture_uris=[captured["uri"]])
        outlet_events[DATASET_ASSET].extra = {
            "dataset_uri": dataset["uri"],
            **run["source"],
            "trigger": run["trigger"],
        }
        return dataset

    run = configure(plan(), pod_mount_paths(), DEPLOYMENT.usage_table())
    shards = shards_of(prompts(run))
    # the generation servers load while the prompts stage runs
    generate_fleet = fleet_up.override(task_id="generate_fleet_up")(
        run, "generate", DEPLOYMENT.fleet("generate")
    )
    # the shard tasks' outputs are not passed on (a pod's arguments are pickled, a lazy sequence of
    # mapped results is not): the whole stage reads what the shards published
    generated = generate_shard.partial(run=run).expand(shard=shards)
    generate_fleet >> generated
    regenerated = responses(run)
    generated >> regenerated
    regenerated >> fleet_down.override(task_id="generate_fleet_down")(
        "generate", DEPLOYMENT.fleet("generate"), run, generate_fleet
    ).as_teardown(setups=generate_fleet, on_failure_fail_dagrun=True)
    capture_fleet = fleet_up.override(task_id="capture_fleet_up")(run, "capture", DEPLOYMENT.fleet("capture"))
    regenerated >> capture_fleet
    checked = parity(run, regenerated)
    capture_fleet >> checked
    captured_shards = capture_shard.partial(run=run, checked=checked).expand(shard=shards)
    captured = captures(run)
    captured_shards >> captured
    captured >> fleet_down.override(task_id="capture_fleet_down")(
        "capture", DEPLOYMENT.fleet("capture"), run, capture_fleet
    ).as_teardown(setups=capture_fleet, on_failure_fail_dagrun=True)
    publish_dataset(run, captured)


drafter_data()
