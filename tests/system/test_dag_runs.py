"""Both DAGs run end to end with `dag.test` on the tiny target, in this process against a migrated
SQLite database: the data DAG publishes, the training DAG trains and promotes, the lineage chain reaches the
drafter version, and a cron run with nothing new trains nothing."""

import json
from pathlib import Path

import yaml

from tests.conftest import storage_config, tiny_config_dict


def test_both_dags_run_end_to_end_with_dag_test(
    migrated_db, dagbag, tmp_path_factory, tiny_target_dir, monkeypatch
):
    import drafter_support  # what the parsed DAGs imported

    tmp = tmp_path_factory.mktemp("dag-test")
    data = tiny_config_dict(storage_config("file", tmp, None))
    data["benchmark"]["num_prompts"] = 2
    config_path = tmp / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    # the deployment's run config: a trigger form may name only the deployment's run configs
    monkeypatch.setattr(drafter_support.DEPLOYMENT, "run_config", str(config_path))
    run = dagbag.dags["drafter_data"].test(
        run_conf={"config": str(config_path), "num_samples": 48, "shard_size": 16}
    )
    assert run.state == "success"
    store_root = Path(data["storage"]["root"])
    datasets = list((store_root / "datasets" / "tiny-test").glob("*/manifest.json"))
    assert len(datasets) == 1
    capture = json.loads(next((store_root / "captures" / "tiny-test").glob("*/manifest.json")).read_text())
    prompt_set = json.loads(next((store_root / "prompts").glob("*/manifest.json")).read_text())
    assert len(capture["shards"]) == len(prompt_set["shards"]) > 1  # one capture shard per mapped task
    run = dagbag.dags["drafter_train"].test(run_conf={"config": str(config_path), "epochs": 2})
    assert run.state == "success"
    assert {ti.task_id: ti.state for ti in run.get_task_instances()}["report"] == "success"
    from pipeline.ids import safe_id

    report_dir = store_root / "runs" / safe_id(run.run_id) / "report"
    assert {p.name for p in report_dir.iterdir()} >= {
        "report.html",
        "training.png",
        "throughput.png",
        "manifest.json",
    }
    report_ti = next(ti for ti in run.get_task_instances() if ti.task_id == "report")
    assert report_ti.xcom_pull(task_ids="report", key="report_link") == f"file://{report_dir}/report.html"
    # what the UI's "Run report" extra link shows, stored by the worker when the task finished
    assert (
        report_ti.xcom_pull(task_ids="report", key="_link_RunReportLink")
        == f"file://{report_dir}/report.html"
    )
    alias_path = store_root / "drafters" / "tiny-test" / "aliases" / "production.json"
    alias = json.loads(alias_path.read_text())
    assert (store_root / "drafters" / "tiny-test" / "versions" / alias["version"] / "manifest.json").exists()
    _lineage_runs_from_prompts_to_the_drafter_version(migrated_db / "openlineage.jsonl", store_root, alias)

    # a candidate the gate rejects: benchmark and promote are skipped, production stays where it was
    run = dagbag.dags["drafter_train"].test(
        run_conf={"config": str(config_path), "epochs": 1, "min_tau_simulated": 50}
    )
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert states == {
        "plan": "success",
        "configure": "success",
        "triggered": "success",
        "train": "success",
        "evaluate": "success",
        "gate": "success",
        "benchmark": "skipped",
        "promote": "skipped",
        "report": "success",
    }
    assert run.state == "success"
    page = (store_root / "runs" / safe_id(run.run_id) / "report" / "report.html").read_text()
    assert "gate rejected" in page and "FAIL" in page
    decision = json.loads((store_root / "runs" / safe_id(run.run_id) / "gate" / "gate.json").read_text())
    assert decision["passed"] is False and any(
        "tau_simulated" in r and "< 50" in r for r in decision["reasons"]
    )
    assert json.loads(alias_path.read_text()) == alias
    _a_cron_run_with_nothing_new_trains_nothing_and_says_so(dagbag, config_path, store_root, alias)


def _a_cron_run_with_nothing_new_trains_nothing_and_says_so(dagbag, config_path, store_root, alias):
    """The production drafter was trained on the newest dataset, of this target: the cron run stops after
    recording why, and `drafter status` lists it with the reason."""
    from harness.rehearsal import scheduled_run
    from pipeline.config import load_config
    from pipeline.ids import safe_id
    from pipeline.ops.report import status_table
    from pipeline.storage import open_store

    train = dagbag.dags["drafter_train"]
    default = train.params["config"]
    train.params["config"] = str(config_path)  # the deployment's run config, which scheduled runs take
    try:
        run = scheduled_run(train, "0 4 * * 0")
    finally:
        train.params["config"] = default
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert run.state == "success" and run.run_id.startswith("scheduled__")
    assert {task: state for task, state in states.items() if state != "skipped"} == {
        "plan": "success",
        "configure": "success",
        "triggered": "success",
        "report": "success",  # its page says why nothing was trained
    }
    page = (store_root / "runs" / safe_id(run.run_id) / "report" / "report.html").read_text()
    assert "skipped: nothing new" in page and "the retraining cron (0 4 * * 0)" in page
    record = json.loads((store_root / "runs" / safe_id(run.run_id) / "trigger.json").read_text())
    assert record["trigger"] == {"kind": "cron", "reason": "the retraining cron (0 4 * * 0)"}
    assert record["skipped"].startswith(f"nothing new since production drafter {alias['version']}: ")
    assert not (store_root / "runs" / safe_id(run.run_id) / "train").exists()
    config = load_config(config_path)
    table = status_table(open_store(config.storage), config.target.name, limit=100)
    assert f"{safe_id(run.run_id)[:43]}" in table and "skipped: nothing new" in table
    assert "      triggered by: cron: the retraining cron (0 4 * * 0)" in table
    assert "      triggered by: manual: triggered by hand (trigger form or REST API)" in table


def _lineage_runs_from_prompts_to_the_drafter_version(events_file: Path, store_root: Path, alias: dict):
    """What the OpenLineage provider emitted for the two runs: each stage task's inputs are the outputs
    of the task before it, from the prompt snapshot to the promoted drafter version."""
    from pipeline.ops.lineage import LINEAGE_CHAIN as chain
    from pipeline.ops.lineage import completed_datasets

    jobs = completed_datasets(events_file)

    def names(job: str, side: str) -> set[str]:
        assert job in jobs, sorted(jobs)
        datasets = jobs[job][side]
        assert {namespace for namespace, _ in datasets} <= {"file"}, datasets
        return {name for _, name in datasets}

    for before, after in zip(chain, chain[1:], strict=False):
        assert names(before, "outputs") & names(after, "inputs"), (before, after)
    assert {
        f"{store_root}/prompts",
        f"{store_root}/responses/tiny-test",
        f"{store_root}/captures/tiny-test",
        f"{store_root}/datasets/tiny-test",
    } == {name.rsplit("/", 1)[0] for job in chain[:4] for name in names(job, "outputs")}
    assert f"{store_root}/drafters/tiny-test/versions/{alias['version']}" in names(
        "drafter_train.promote", "outputs"
    )
