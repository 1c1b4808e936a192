"""The Airflow DAGs: integrity (parse without a database), params, schedule, per-task placement, the
Kubernetes pod specs they render (no cluster), the watches' triggers. tests/system/test_dag_runs.py runs
both DAGs with `dag.test`."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import DAGS, KIMI_CONFIG, REPO, metered_ngram_standin, storage_config, tiny_config_dict

PARSE = """
import sys
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
print(sorted(bag.dag_ids), bag.import_errors)
"""


def _parse_env(home: Path, deployment: Path, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that parses the DAGs with this deployment, in Airflow home `home`."""
    return dict(
        os.environ,
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        DRAFTER_DEPLOYMENT=str(deployment),
        **extra,
    )


def test_dags_import_without_a_database(tmp_path):
    # a database URL that cannot be opened and no connections: parsing must need neither
    env = _parse_env(
        tmp_path,
        REPO / "configs/deployment/local.yaml",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{tmp_path}/missing/dir/airflow.db",
    )
    out = subprocess.run(
        [sys.executable, "-c", PARSE, str(DAGS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['drafter_data', 'drafter_train'] {}"
    assert "missing/dir" not in out.stderr  # nothing tried to open the database


ALERTS = """
import sys
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag
from airflow.serialization.serialized_objects import DagSerialization
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
for dag_id in ("drafter_data", "drafter_train"):
    dag = bag.dags[dag_id]
    DagSerialization.to_dict(dag)  # what the scheduler stores
    alerts = [(a.interval.total_seconds(), a.callback.path.rsplit(".", 1)[1]) for a in dag.deadline or []]
    print(dag_id, alerts)
promote = bag.dags["drafter_train"].get_task("promote")
print("promote", [f.__name__ for f in promote.on_success_callback])
"""


WATCHES = """
import sys
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag
from airflow.serialization.serialized_objects import DagSerialization
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
leaves = lambda c: [c] if hasattr(c, "watchers") else [a for o in c.objects for a in leaves(o)]
for dag_id in ("drafter_data", "drafter_train"):
    dag = bag.dags[dag_id]
    DagSerialization.to_dict(dag)  # what the scheduler stores, the watchers' triggers included
    assets = leaves(dag.timetable.asset_condition)
    named = lambda t: " via ".join(filter(None, [t.serialize()[0], t.serialize()[1].get("aws_conn_id")]))
    watched = sorted((a.name, [named(w.trigger) for w in a.watchers]) for a in assets)
    print(dag_id, type(dag.timetable).__name__, watched)
"""


def test_the_deployments_watches_schedule_data_and_training_runs(tmp_path):
    deployment = tmp_path / "deployment.yaml"
    watch = {
        "served_acceptance": {"metrics_urls": ["http://sglang-0:30000/metrics"], "floor": 2.5},
        "target_revision": {"server_info_url": "http://sglang-0:30000/server_info"},
    }
    deployment.write_text(yaml.safe_dump({"watch": watch, "aws_conn_id": "drafter_s3"}))
    out = subprocess.run(
        [sys.executable, "-c", WATCHES, str(DAGS)],
        env=_parse_env(tmp_path, deployment),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-2:] == [
        # another target revision served: new data first (captured from that revision), then training
        "drafter_data AssetTriggeredTimetable "
        "[('drafter_target_revision', ['drafter_triggers.TargetRevisionTrigger via drafter_s3'])]",
        # a published dataset, or the served acceptance under its floor, or the cron
        "drafter_train AssetOrTimeSchedule [('drafter_dataset', []), "
        "('drafter_served_acceptance', ['drafter_triggers.ServedAcceptanceTrigger via drafter_s3'])]",
    ]


def test_deadlines_and_alert_callbacks_follow_the_deployments_notifiers(tmp_path):
    deployment = tmp_path / "deployment.yaml"
    deployment.write_text(
        yaml.safe_dump(
            {
                "deadline_minutes": {"drafter_train": 90},
                "notifiers": [
                    {"kind": "slack", "conn_id": "alerts_slack", "events": ["deadline", "promotion"]},
                    {"kind": "webhook", "conn_id": "alerts_hook", "events": ["failure"]},
                    {
                        "kind": "email",
                        "conn_id": "alerts_mail",
                        "to": ["a@example.com"],
                        "events": ["deadline"],
                    },
                ],
            }
        )
    )
    env = _parse_env(tmp_path, deployment)
    out = subprocess.run(
        [sys.executable, "-c", ALERTS, str(DAGS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()[-3:]
    assert lines == [
        "drafter_data []",  # no deadline for data runs in this deployment
        "drafter_train [(5400.0, 'SlackWebhookNotifier'), (5400.0, 'SmtpNotifier')]",
        "promote ['notify_promotion']",
    ]


def test_schedules_mapping_and_asset(dagbag):
    train = dagbag.dags["drafter_train"]
    assert type(train.timetable).__name__ == "AssetOrTimeSchedule"
    assert [t.task_id for t in train.topological_sort()] == [
        "plan",
        "configure",
        "triggered",
        "train",
        "evaluate",
        "gate",
        "benchmark",
        "promote",
        "report",
    ]
    report = train.get_task("report")
    # a teardown without setups runs once everything upstream is done, whatever its state
    assert report.is_teardown and report.trigger_rule == "all_done_setup_success"
    assert [link.name for link in report.operator_extra_links] == ["Run report"]
    assert train.get_task("gate").ignore_downstream_trigger_rules is False
    data = dagbag.dags["drafter_data"]
    assert type(data.get_task("generate_shard")).__name__ == "DecoratedMappedOperator"
    assert type(data.get_task("capture_shard")).__name__ == "DecoratedMappedOperator"
    assert [o.name for o in data.get_task("publish_dataset").outlets] == ["drafter_dataset"]


def test_server_fleets_are_up_only_around_the_stages_that_call_them(dagbag):
    data = dagbag.dags["drafter_data"]
    for stage, first, last in (
        ("generate", "generate_shard", "responses"),
        ("capture", "parity", "captures"),
    ):
        up, down = data.get_task(f"{stage}_fleet_up"), data.get_task(f"{stage}_fleet_down")
        assert up.is_setup and down.is_teardown and down.trigger_rule == "all_done_setup_success"
        assert up.task_id in data.get_task(first).upstream_task_ids
        # scaled down once its last task is done however it ended, and a failed scale-down fails the run
        assert {last, up.task_id} <= down.upstream_task_ids and down._on_failure_fail_dagrun
    # the capture servers come up once generation is over: the two fleets do not hold GPUs at once
    assert "responses" in data.get_task("capture_fleet_up").upstream_task_ids


def test_tasks_get_retries_timeouts_pool_and_failure_callbacks(dagbag):
    train = dagbag.dags["drafter_train"].get_task("train")
    assert train.pool == "drafter_gpu" and train.retries == 1
    assert train.execution_timeout.total_seconds() == 120 * 60
    assert train.on_failure_callback
    assert dagbag.dags["drafter_train"].get_task("gate").pool == "default_pool"


def test_params_have_titles_and_validate(dagbag):
    from airflow.sdk.exceptions import ParamValidationError

    from pipeline.tasks import param_overrides

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
    # scheduled and dataset-triggered runs take the form's defaults: train.init auto
    assert train["init"] == "auto" and 'train.init="auto"' in param_overrides(train.dump())
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
tasks = [("drafter_train", "train"), ("drafter_train", "promote"), ("drafter_data", "prompts")]
for dag_id, task_id in tasks:
    operator = bag.dags[dag_id].get_task(task_id)
    pods[task_id] = ApiClient().sanitize_for_serialization(operator.build_pod_request_obj())
    pods[task_id]["waits"] = [operator.schedule_timeout_seconds, operator.startup_timeout_seconds]
# the pods of stages that follow the run's engine, as StagePodOperator places them when it runs: its
# execute up to the pod the provider would create, for the engines the configure step found
from drafter_support import DEPLOYMENT
from airflow.providers.cncf.kubernetes.decorators.kubernetes import _KubernetesDecoratedOperator
from pipeline.tasks import configure_run, plan_run
_KubernetesDecoratedOperator.execute = lambda self, context: self.build_pod_request_obj()
class Configured:
    def __init__(self, run):
        self.run = run
    def xcom_pull(self, task_ids):
        assert task_ids == "configure", task_ids
        return self.run
images = {}
# the vLLM servers' URLs are the operator's to set (a trigger form may not): added to the plan as a run
# config file's setting reaches it, past the form's refusal
servers = "generate.vllm_server.urls=[http://vllm-generate-0.vllm-generate.vllm.svc:8000]"
for engine in ("sglang", "vllm", "inprocess"):
    overrides = {
        "sglang": ["benchmark.engine=sglang", "generate.engine=sglang"],
        "vllm": ["benchmark.engine=vllm", "generate.engine=vllm"],
        "inprocess": ["capture.engine=inprocess"],
    }[engine]
    plan = plan_run({"config": "configs/kimi-k2.5.yaml", "overrides": overrides}, "r1", DEPLOYMENT.run_config)
    if engine == "vllm":
        plan["overrides"].append(servers)
    run = configure_run(plan, None)
    tasks = (("drafter_train", "benchmark"), ("drafter_data", "responses"), ("drafter_data", "captures"))
    for dag_id, task_id in tasks:
        operator = bag.dags[dag_id].get_task(task_id)
        pod = operator.execute({"ti": Configured(run)})
        container = pod.spec.containers[0]
        images[f"{engine} {task_id}"] = [
            container.image, container.resources.limits.get("nvidia.com/gpu"), bool(pod.spec.node_selector)
        ]
pods["engine_images"] = images
print(json.dumps(pods))
"""


def _kubernetes_env(tmp_path) -> dict:
    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    return dict(
        os.environ,
        KUBECONFIG=str(tmp_path / "kubeconfig"),
        AIRFLOW_HOME=str(tmp_path),
        DRAFTER_DEPLOYMENT=str(REPO / "configs/deployment/kubernetes.yaml"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
    )


def test_kubernetes_deployment_renders_valid_pod_specs(tmp_path):
    from kubernetes.client import ApiClient, V1Pod

    out = subprocess.run(
        [sys.executable, "-c", RENDER, str(DAGS)],
        env=_kubernetes_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pods = json.loads(out.stdout.strip().splitlines()[-1])
    deployment = yaml.safe_load((REPO / "configs/deployment/kubernetes.yaml").read_text())
    placement = deployment["kubernetes"]
    train = pods["train"]
    container = train["spec"]["containers"][0]
    assert train["kind"] == "Pod" and train["metadata"]["namespace"] == "drafter"
    assert train["spec"]["serviceAccountName"] == "drafter-pipeline"
    assert container["image"] == placement["images"]["trainer"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert train["spec"]["nodeSelector"] == placement["node_selector_gpu"]
    assert train["spec"]["tolerations"] == placement["gpu_tolerations"]
    shm = next(v for v in train["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": placement["gpu_shm_size"]}
    assert {"name": "DRAFTER_PERMANENT_EXIT_CODES", "value": "1"} in container["env"]
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/etc/drafter", "/dev/shm", "/data/drafter-cache"} | {
        v["path"] for v in placement["volumes"]
    } <= mounted
    # a GPU node scale-up or a multi-GB image pull takes longer than the provider's default 120 s
    assert train["waits"] == [placement["schedule_timeout_seconds"], placement["startup_timeout_seconds"]]
    assert min(train["waits"]) >= 900
    # one node needs no SSH key or hostfile: nothing the runbook does not create is mounted
    assert not any("secret" in volume or "configMap" in volume for volume in train["spec"]["volumes"])
    promote = pods["promote"]["spec"]
    assert promote["containers"][0]["image"] == placement["images"]["pipeline"]
    assert "nvidia.com/gpu" not in promote["containers"][0]["resources"]["limits"]
    assert not promote.get("nodeSelector") and not promote.get("tolerations")  # CPU pods go anywhere
    # the benchmark's, generation's and capture's pods run in the image and on the GPUs of the run's engine:
    # vLLM's image for engine vllm, the SGLang image on a GPU node for in-process capture
    images = placement["images"]
    assert pods.pop("engine_images") == {
        "sglang benchmark": [images["sglang"], "8", True],
        "sglang responses": [images["pipeline"], None, False],
        "sglang captures": [images["pipeline"], None, False],
        "vllm benchmark": [images["vllm"], "8", True],
        "vllm responses": [images["vllm"], None, False],
        "vllm captures": [images["pipeline"], None, False],
        "inprocess benchmark": [images["sglang"], "8", True],
        "inprocess responses": [images["pipeline"], None, False],
        "inprocess captures": [images["sglang"], "8", True],
    }
    for pod in pods.values():  # each renders back into the Kubernetes model without loss
        pod.pop("waits")

        class Response:
            data = json.dumps(pod)

        assert ApiClient().deserialize(Response, V1Pod).to_dict()["spec"]["containers"][0]["image"]
    assert not any("AWS_SECRET" in json.dumps(pod) for pod in pods.values())


SHIPPED = """
import ast, json, os, sys, tempfile, types
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag
from airflow.providers.cncf.kubernetes.python_kubernetes_script import write_python_script
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
shipped = {}
for dag_id in ("drafter_data", "drafter_train"):
    for task in bag.dags[dag_id].tasks:
        mapped = hasattr(task, "partial_kwargs")
        kind = task.operator_class if mapped else type(task)
        if "Pod" not in kind.__name__:
            continue
        callable_ = task.python_callable
        # the provider's own get_python_source, on the operator class the task was built with
        source = kind.get_python_source(types.SimpleNamespace(python_callable=callable_,
                                                              custom_operator_name=kind.custom_operator_name))
        path = os.path.join(tempfile.mkdtemp(), "script.py")
        # what the decorator's execute() renders into the pod, with the provider's own template
        jinja_context = {"op_args": [], "op_kwargs": {"run": {}}, "pickling_library": "pickle",
                         "python_callable": callable_.__name__, "python_callable_source": source,
                         "string_args_global": False}
        write_python_script(jinja_context=jinja_context, filename=path)
        shipped[f"{dag_id}.{task.task_id}"] = open(path).read()
print(json.dumps(shipped))
"""


def test_every_pod_task_ships_source_that_compiles_and_carries_no_decorator(tmp_path):
    import ast

    out = subprocess.run(
        [sys.executable, "-c", SHIPPED, str(DAGS)],
        env=_kubernetes_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    shipped = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {
        "drafter_data.configure",
        "drafter_data.prompts",
        "drafter_data.generate_shard",
        "drafter_data.generate_fleet_up",
        "drafter_data.generate_fleet_down",
        "drafter_data.capture_fleet_up",
        "drafter_data.capture_fleet_down",
        "drafter_data.responses",
        "drafter_data.parity",
        "drafter_data.capture_shard",
        "drafter_data.captures",
        "drafter_train.configure",
        "drafter_train.train",
        "drafter_train.evaluate",
        "drafter_train.benchmark",
        "drafter_train.promote",
    }
    assert set(shipped) == expected
    for task, script in shipped.items():
        tree = ast.parse(script, filename=task)
        functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
        assert len(functions) == 1 and functions[0].decorator_list == [], task
        assert "@" not in script, task
        # defining the function runs nothing but its (absent) decorators: no NameError in the pod
        definitions = ast.Module(
            body=[n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.Import, ast.ImportFrom))],
            type_ignores=[],
        )
        exec(compile(definitions, task, "exec"), {"__name__": "pod_script"})


def test_scheduled_runs_take_the_deployments_run_config():
    from pipeline.ops.deployment import load_deployment
    from pipeline.tasks import plan_training

    for name in ("local", "kubernetes"):
        deployment = load_deployment(REPO / "configs" / "deployment" / f"{name}.yaml")
        # a cron run has no trigger form: its params are the form's defaults, so the default is what it runs
        plan = plan_training(
            {"config": deployment.run_config},
            "scheduled__2026-12-06T04:00:00+00:00",
            [],
            deployment.run_config,
        )
        assert plan["config_path"] == deployment.run_config and plan["dataset_uri"] is None
    assert (
        load_deployment(REPO / "configs/deployment/kubernetes.yaml").run_config
        == "/etc/drafter/kimi-k2.5.yaml"
    )


def test_the_trigger_forms_default_is_the_deployments_run_config(dagbag):
    from pipeline.ops.deployment import load_deployment

    deployment = load_deployment(REPO / "configs/deployment/local.yaml")
    for dag_id in ("drafter_data", "drafter_train"):
        assert dagbag.dags[dag_id].params["config"] == deployment.run_config


def test_configure_refuses_local_paths_no_pod_mounts():
    from pipeline.config import ConfigError
    from pipeline.ops.deployment import load_deployment
    from pipeline.tasks import configure_run, plan_run

    deployment = load_deployment(REPO / "configs/deployment/kubernetes.yaml")
    mounts = [mount.path for mount in deployment.pod_mounts("configure")]
    plan = plan_run({"config": str(KIMI_CONFIG)}, "r1", deployment.run_config)
    run = configure_run(plan, mounts)  # the production config reads only mounted paths
    assert run["config"]["target"]["model_path"] == "/models/Kimi-K2.5" and "overrides" not in run
    moved = plan_run(
        {
            "config": str(KIMI_CONFIG),
            "overrides": ["train.deepspeed_config=/mnt/deepspeed/zero3.json"],
        },
        "r1",
        deployment.run_config,
    )
    with pytest.raises(ConfigError, match="/mnt/deepspeed/zero3.json"):
        configure_run(moved, mounts)
    configure_run(moved, None)  # tasks in the worker: nothing to check


def _written(path: Path, deployment: dict) -> Path:
    path.write_text(yaml.safe_dump(deployment))
    return path


def test_a_stages_engines_name_its_engines_and_known_images(tmp_path):
    from pipeline.config import ConfigError
    from pipeline.ops.deployment import load_deployment

    deployment = yaml.safe_load((REPO / "configs/deployment/kubernetes.yaml").read_text())
    loaded = load_deployment(REPO / "configs/deployment/kubernetes.yaml")
    following = {name for name in loaded.stages if loaded.follows_engine(name)}
    assert following == {"generate", "capture", "benchmark", "train"}
    capture = loaded.stage("capture")
    assert capture.for_engine("sglang") == capture and capture.for_engine(None) == capture
    inprocess = capture.for_engine("inprocess")
    assert (inprocess.image, inprocess.gpus, inprocess.retries) == ("sglang", 8, capture.retries)
    for stage, entry, message in (
        ("train", {"engines": {"vllm": {"image": "vllm"}}}, "unknown engines \\['vllm'\\]; train.launcher"),
        ("prompts", {"engines": {"vllm": {"image": "vllm"}}}, "only generate, parity, capture, bench"),
        ("benchmark", {"engines": {"tgi": {"image": "vllm"}}}, "unknown engines \\['tgi'\\]"),
        ("benchmark", {"engines": {"vllm": {"image": "tgi"}}}, "engines.vllm.image"),
        ("capture", {"engines": {"inprocess": {"gpus": -1}}}, "engines.inprocess.gpus"),
        ("capture", {"engines": {"inprocess": {"nodes": 2}}}, "engines.inprocess.nodes"),
    ):
        broken = copy.deepcopy(deployment)
        broken["stages"][stage].update(entry)
        with pytest.raises(ConfigError, match=message):
            load_deployment(_written(tmp_path / "deployment.yaml", broken))
    without_vllm = copy.deepcopy(deployment)
    del without_vllm["kubernetes"]["images"]["vllm"]
    with pytest.raises(ConfigError, match="runs in image 'vllm', which kubernetes.images does not name"):
        load_deployment(_written(tmp_path / "deployment.yaml", without_vllm))


def test_permanent_failures_fail_the_task_at_once(dagbag):
    from airflow.sdk.exceptions import AirflowFailException

    plan = dagbag.dags["drafter_data"].get_task("plan").python_callable

    class DagRun:
        run_id, run_type = "manual__1", "manual"

    with pytest.raises(AirflowFailException, match="not both"):  # a ConfigError: no retry can fix it
        plan(params={"config": "configs/local.yaml", "num_shards": 2, "shard_size": 3}, dag_run=DagRun())


POD_FAILURE = """
import sys
from pipeline.tasks import run_stage_task
run_stage_task(sys.argv[1], "configs/local.yaml", "r1", ["train.epochs=0"])
"""


@pytest.mark.parametrize("pod, code", [("1", 2), ("", 1)])
def test_a_pod_ends_a_permanent_failure_with_its_exit_code(pod, code):
    env = dict(os.environ, DRAFTER_PERMANENT_EXIT_CODES=pod)
    out = subprocess.run(
        [sys.executable, "-c", POD_FAILURE, "gate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == code, out.stderr[-2000:]
    assert "ConfigError" in out.stderr  # the traceback is still printed


def test_a_shard_count_becomes_a_shard_size():
    from pipeline.config import ConfigError
    from pipeline.tasks import configure_run, plan_run

    config = str(REPO / "configs" / "local.yaml")
    plan = plan_run(
        {"config": config, "num_samples": 48, "num_shards": 5},
        "manual__2026-11-30T00:00:00+00:00",
        "configs/local.yaml",
    )
    assert plan["run_id"].startswith("manual__2026-11-30T00-00-00")
    run = configure_run(plan)
    assert run["config"]["prompts"]["num_samples"] == 48 and run["config"]["prompts"]["shard_size"] == 10
    assert run["source"]["overrides"][-1] == "prompts.shard_size=10"
    with pytest.raises(ConfigError, match="not both"):
        plan_run({"config": config, "num_shards": 5, "shard_size": 10}, "r", "configs/local.yaml")


@pytest.fixture
def metered_ngram_server(tiny_target_dir):
    """A serving replica of revision r2 (tests.conftest.metered_ngram_standin)."""
    with metered_ngram_standin(tiny_target_dir, "r2") as url:
        yield url


def _next_event(trigger, timeout_s: float, traffic_url: str | None = None):
    """The trigger's first event within `timeout_s` (None: none), run as the triggerer runs it, while
    requests are sent to `traffic_url` (the fleet serving)."""
    import asyncio
    import threading

    import requests

    stop = threading.Event()

    def serve_traffic() -> None:
        while traffic_url and not stop.is_set():
            body = {"input_ids": [5, 6, 7, 5, 6, 7, 5, 6], "sampling_params": {"max_new_tokens": 16}}
            requests.post(f"{traffic_url}/generate", json=body, timeout=60)

    async def first():
        events = trigger.run()
        try:
            return await asyncio.wait_for(anext(events), timeout_s)
        except TimeoutError:
            return None
        finally:
            await events.aclose()

    sender = threading.Thread(target=serve_traffic, daemon=True)
    sender.start()
    try:
        return asyncio.run(first())
    finally:
        stop.set()
        sender.join(timeout=60)


def test_the_served_acceptance_trigger_fires_only_under_its_floor_and_not_again_after_a_restart(
    metered_ngram_server, tmp_path
):
    from drafter_triggers import ServedAcceptanceTrigger

    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config_dict(storage_config("file", tmp_path, None))))

    def watching(floor: float) -> ServedAcceptanceTrigger:
        watch = {
            "metrics_urls": [f"{metered_ngram_server}/metrics"],
            "floor": floor,
            "window_s": 1.0,
            "min_verify_calls": 5,
            "poll_s": 0.25,
        }
        trigger = ServedAcceptanceTrigger(watch=watch, run_config=str(config_path))
        classpath, kwargs = trigger.serialize()
        assert classpath == "drafter_triggers.ServedAcceptanceTrigger"
        assert kwargs == {"watch": watch, "run_config": str(config_path), "aws_conn_id": None}
        return trigger

    assert _next_event(watching(1.01), timeout_s=5, traffic_url=metered_ngram_server) is None
    # n-gram drafts on repeated text: well above 1 token per verify pass, far under 50
    event = _next_event(watching(50.0), timeout_s=60, traffic_url=metered_ngram_server)
    assert event is not None and event.payload["trigger"] == "served_acceptance"
    served = event.payload["accept_length"]
    assert 1.0 < served < 50.0 and event.payload["verify_calls"] >= 5
    assert event.payload["reason"].startswith(f"served acceptance length {served:.3f} under the floor 50.0")
    # a new trigger, as a restarted triggerer makes: the cooldown it fired into is in the store
    assert _next_event(watching(50.0), timeout_s=5, traffic_url=metered_ngram_server) is None


def test_the_target_revision_trigger_fires_once_the_fleet_serves_another_revision(
    metered_ngram_server, tmp_path
):
    from drafter_triggers import TargetRevisionTrigger
    from pipeline.config import load_config
    from pipeline.storage import open_store
    from tests.builders import production_drafter as _production

    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config_dict(storage_config("file", tmp_path, None))))
    config = load_config(config_path)
    watch = {"server_info_url": f"{metered_ngram_server}/server_info", "poll_s": 0.25}
    trigger = TargetRevisionTrigger(watch=watch, run_config=str(config_path))
    assert _next_event(trigger, timeout_s=3) is None  # nothing in production yet
    _production(open_store(config.storage), config.target.name, "r2", config.registry.alias)
    assert _next_event(trigger, timeout_s=3) is None  # the production drafter's own revision
    _production(open_store(config.storage), config.target.name, "r1", config.registry.alias, version="v2")
    event = _next_event(trigger, timeout_s=30)
    assert event is not None and event.payload["served_revision"] == "r2"
    assert (event.payload["drafter_revision"], event.payload["drafter_version"]) == ("r1", "v2")
    # a restarted triggerer's new trigger: the revision it fired on is in the store, not in its memory
    restarted = TargetRevisionTrigger(watch=watch, run_config=str(config_path))
    assert _next_event(restarted, timeout_s=3) is None
