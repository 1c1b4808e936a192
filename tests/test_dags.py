"""The Airflow DAGs: integrity (parse without a database), params, schedule, per-task placement, the
Kubernetes pod specs they render (no cluster), and `dag.test` of both DAGs on the tiny target."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, storage_config, tiny_config_dict

DAGS = REPO / "dags"


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow-home")
    os.environ.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                       "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
                       "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
                       "DRAFTER_DEPLOYMENT": str(REPO / "configs/deployment/local.yaml")})
    if str(DAGS) not in sys.path:  # what Airflow's dag bundle does for the dags folder
        sys.path.insert(0, str(DAGS))
    return home


@pytest.fixture(scope="module")
def dagbag(airflow_home):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


PARSE = """
import sys
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
print(sorted(bag.dag_ids), bag.import_errors)
"""


def test_dags_import_without_a_database(tmp_path):
    # a database URL that cannot be opened and no connections: parsing must need neither
    env = dict(os.environ, AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{tmp_path}/missing/dir/airflow.db",
               DRAFTER_DEPLOYMENT=str(REPO / "configs/deployment/local.yaml"))
    out = subprocess.run([sys.executable, "-c", PARSE, str(DAGS)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['drafter_data', 'drafter_train'] {}"
    assert "missing/dir" not in out.stderr  # nothing tried to open the database


def test_schedules_mapping_and_asset(dagbag):
    train = dagbag.dags["drafter_train"]
    assert type(train.timetable).__name__ == "AssetOrTimeSchedule"
    assert [t.task_id for t in train.topological_sort()] == ["plan", "train", "evaluate", "gate", "benchmark",
                                                            "promote", "report"]
    report = train.get_task("report")
    # a teardown without setups runs once everything upstream is done, whatever its state
    assert report.is_teardown and report.trigger_rule == "all_done_setup_success"
    assert [link.name for link in report.operator_extra_links] == ["Run report"]
    assert train.get_task("gate").ignore_downstream_trigger_rules is False
    data = dagbag.dags["drafter_data"]
    assert type(data.get_task("generate_shard")).__name__ == "DecoratedMappedOperator"
    assert type(data.get_task("capture_shard")).__name__ == "DecoratedMappedOperator"
    assert [o.name for o in data.get_task("publish_dataset").outlets] == ["drafter_dataset"]


def test_tasks_get_retries_timeouts_pool_and_failure_callbacks(dagbag):
    train = dagbag.dags["drafter_train"].get_task("train")
    assert train.pool == "drafter_gpu" and train.retries == 1
    assert train.execution_timeout.total_seconds() == 120 * 60
    assert train.on_failure_callback
    assert dagbag.dags["drafter_train"].get_task("gate").pool == "default_pool"


def test_params_have_titles_and_validate(dagbag):
    from airflow.sdk.exceptions import ParamValidationError

    for dag_id in ("drafter_data", "drafter_train"):
        params = dagbag.dags[dag_id].params
        params.validate()  # the defaults are a valid trigger form
        for name in params:
            assert params.get_param(name).schema.get("title"), name
            assert params.get_param(name).description, name
        # the UI form marks a field required unless null is allowed: only these must be filled in
        required = {name for name in params if "null" not in params.get_param(name).schema.get("type", [])}
        assert required == ({"config", "init"} if dag_id == "drafter_train" else {"config"}), required
        params.get_param("overrides").resolve(["train.epochs=2"])
        with pytest.raises(ParamValidationError):
            params.get_param("overrides").resolve(["not an override"])
    train = dagbag.dags["drafter_train"].params
    with pytest.raises(ParamValidationError):
        train.get_param("init").resolve("pretrained")
    with pytest.raises(ParamValidationError):
        train.get_param("min_cond_acc_0").resolve(1.5)
    with pytest.raises(ParamValidationError):
        dagbag.dags["drafter_data"].params.get_param("num_samples").resolve(0)


KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: none, user: {token: none}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
"""

RENDER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag
from kubernetes.client import ApiClient
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
pods = {}
for dag_id, task_id in [("drafter_train", "train"), ("drafter_train", "promote"), ("drafter_data", "prompts")]:
    pods[task_id] = ApiClient().sanitize_for_serialization(bag.dags[dag_id].get_task(task_id).build_pod_request_obj())
print(json.dumps(pods))
"""


def test_kubernetes_deployment_renders_valid_pod_specs(tmp_path):
    from kubernetes.client import ApiClient, V1Pod

    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    env = dict(os.environ, KUBECONFIG=str(tmp_path / "kubeconfig"), AIRFLOW_HOME=str(tmp_path),
               DRAFTER_DEPLOYMENT=str(REPO / "configs/deployment/kubernetes.yaml"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False")
    out = subprocess.run([sys.executable, "-c", RENDER, str(DAGS)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    pods = json.loads(out.stdout.strip().splitlines()[-1])
    deployment = yaml.safe_load((REPO / "configs/deployment/kubernetes.yaml").read_text())
    train = pods["train"]
    container = train["spec"]["containers"][0]
    assert train["kind"] == "Pod" and train["metadata"]["namespace"] == "drafter"
    assert train["spec"]["serviceAccountName"] == "drafter-pipeline"
    assert container["image"] == deployment["kubernetes"]["images"]["trainer"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert train["spec"]["nodeSelector"] == deployment["kubernetes"]["node_selector_gpu"]
    assert {"name": "DS_ACCELERATOR", "value": "cuda"} in container["env"]
    assert any(m["mountPath"] == "/etc/drafter" for m in container["volumeMounts"])
    promote = pods["promote"]["spec"]["containers"][0]
    assert promote["image"] == deployment["kubernetes"]["images"]["pipeline"]
    assert "nvidia.com/gpu" not in promote["resources"]["limits"]
    for pod in pods.values():  # each renders back into the Kubernetes model without loss
        class Response:
            data = json.dumps(pod)
        assert ApiClient().deserialize(Response, V1Pod).to_dict()["spec"]["containers"][0]["image"]
    assert not any("AWS_SECRET" in json.dumps(pod) for pod in pods.values())


@pytest.fixture(scope="module")
def migrated_db(airflow_home, dagbag):
    from airflow.utils import db

    db.initdb()
    from airflow.models.pool import Pool

    Pool.create_or_update_pool("drafter_gpu", slots=1, description="GPU-bound drafter tasks", include_deferred=False)
    return airflow_home


def test_both_dags_run_end_to_end_with_dag_test(migrated_db, dagbag, tmp_path_factory, tiny_target_dir):
    tmp = tmp_path_factory.mktemp("dag-test")
    data = tiny_config_dict(storage_config("file", tmp, None))
    data["benchmark"]["num_prompts"] = 2
    config_path = tmp / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    run = dagbag.dags["drafter_data"].test(run_conf={"config": str(config_path), "num_samples": 48, "shard_size": 16})
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
    assert {p.name for p in report_dir.iterdir()} >= {"report.html", "training.png", "throughput.png", "manifest.json"}
    report_ti = next(ti for ti in run.get_task_instances() if ti.task_id == "report")
    assert report_ti.xcom_pull(task_ids="report", key="report_link") == f"file://{report_dir}/report.html"
    # what the UI's "Run report" extra link shows, stored by the worker when the task finished
    assert report_ti.xcom_pull(task_ids="report", key="_link_RunReportLink") == f"file://{report_dir}/report.html"
    alias_path = store_root / "drafters" / "tiny-test" / "aliases" / "production.json"
    alias = json.loads(alias_path.read_text())
    assert (store_root / "drafters" / "tiny-test" / "versions" / alias["version"] / "manifest.json").exists()

    # a candidate the gate rejects: benchmark and promote are skipped, production stays where it was
    run = dagbag.dags["drafter_train"].test(run_conf={"config": str(config_path), "epochs": 1,
                                                      "min_tau_simulated": 50})
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert states == {"plan": "success", "train": "success", "evaluate": "success", "gate": "success",
                      "benchmark": "skipped", "promote": "skipped", "report": "success"}
    assert run.state == "success"
    page = (store_root / "runs" / safe_id(run.run_id) / "report" / "report.html").read_text()
    assert "gate rejected" in page and "FAIL" in page
    decision = json.loads((store_root / "runs" / safe_id(run.run_id) / "gate" / "gate.json").read_text())
    assert decision["passed"] is False and any("tau_simulated" in r and "< 50" in r for r in decision["reasons"])
    assert json.loads(alias_path.read_text()) == alias


def test_a_shard_count_becomes_a_shard_size():
    from pipeline.config import ConfigError
    from pipeline.tasks import plan_run

    config = str(REPO / "configs" / "local.yaml")
    run = plan_run({"config": config, "num_samples": 48, "num_shards": 5}, "manual__2026-11-30T00:00:00+00:00")
    assert "prompts.num_samples=48" in run["overrides"] and run["overrides"][-1] == "prompts.shard_size=10"
    assert run["run_id"].startswith("manual__2026-11-30T00-00-00")
    with pytest.raises(ConfigError, match="not both"):
        plan_run({"config": config, "num_shards": 5, "shard_size": 10}, "r")
