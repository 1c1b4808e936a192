"""DAG integrity: both DAGs import without touching a database or connection, Params validate."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow-home")
    os.environ["AIRFLOW_HOME"] = str(home)
    # a database URL that cannot be opened: parsing must not need one
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{home}/missing/dir/airflow.db"
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_dags_import_cleanly(dagbag):
    assert dagbag.import_errors == {}
    assert {"drafter_data", "drafter_train"} <= set(dagbag.dag_ids)


def test_train_dag_is_scheduled_on_the_dataset_asset_or_a_cron(dagbag):
    dag = dagbag.dags["drafter_train"]
    assert type(dag.timetable).__name__ == "AssetOrTimeSchedule"
    assert [t.task_id for t in dag.topological_sort()] == ["resolve", "train", "evaluate", "gate", "benchmark",
                                                           "promote"]
    data = dagbag.dags["drafter_data"]
    publish = data.get_task("publish_dataset")
    assert [o.name for o in publish.outlets] == ["drafter_dataset"]


def test_params_have_titles_and_validate(dagbag):
    from airflow.sdk.exceptions import ParamValidationError

    for dag_id in ("drafter_data", "drafter_train"):
        params = dagbag.dags[dag_id].params
        for name in params:
            assert params.get_param(name).schema.get("title"), name
        params.get_param("overrides").resolve(["train.epochs=2"])
        with pytest.raises(ParamValidationError):
            params.get_param("overrides").resolve("train.epochs=2")
