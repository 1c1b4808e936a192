"""Production deployment files, checked without a cluster or a Docker engine: every image a config or
manifest names is built by a Dockerfile in docker/ at the project version, pinned versions agree with
pyproject.toml, every Kubernetes manifest parses into the kubernetes client's models with no unknown
field, the SGLang servers' flags satisfy the capture contract and match the run config, and the S3
bucket policy and lifecycle rules load into an S3 server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import KIMI_CONFIG, REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
MANIFESTS = sorted((REPO / "infra" / "k8s").glob("*.yaml"))
HELM_VALUES = yaml.safe_load((REPO / "infra" / "helm" / "airflow-values.yaml").read_text())
K8S_DEPLOYMENT = yaml.safe_load((REPO / "configs" / "deployment" / "kubernetes.yaml").read_text())
KIMI = yaml.safe_load((KIMI_CONFIG).read_text())
IMAGE = re.compile(r"^(?P<registry>[\w.-]+)/drafter/(?P<name>[a-z-]+):(?P<tag>[\w.-]+)$")


def _pin(requirements: list[str], package: str) -> str:
    found = [r for r in requirements if re.split(r"[=<>\[ ]", r, maxsplit=1)[0] == package]
    assert len(found) == 1, (package, requirements)
    return found[0]


def _documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def _workload(kind: str, name: str, namespace: str | None = None) -> dict:
    matches = [
        doc
        for _, doc in _documents()
        if doc["kind"] == kind
        and doc["metadata"]["name"] == name
        and namespace in (None, doc["metadata"].get("namespace"))
    ]
    assert len(matches) == 1, (kind, name, namespace)
    return matches[0]


def _referenced_images() -> dict[str, str]:
    images = {
        f"configs/deployment/kubernetes.yaml:{key}": ref
        for key, ref in K8S_DEPLOYMENT["kubernetes"]["images"].items()
    }
    airflow = HELM_VALUES["images"]["airflow"]
    images["infra/helm/airflow-values.yaml"] = f"{airflow['repository']}:{airflow['tag']}"
    for file, doc in _documents():
        for container in _containers(doc):
            images[f"infra/k8s/{file}:{doc['metadata']['name']}/{container['name']}"] = container["image"]
    return images


def test_every_referenced_image_is_built_from_docker_at_the_project_version():
    images = _referenced_images()
    assert len(images) >= 8
    for where, ref in images.items():
        match = IMAGE.match(ref)
        assert match, f"{where}: {ref} is not <registry>/drafter/<image>:<tag>"
        assert (REPO / "docker" / f"{match['name']}.Dockerfile").is_file(), (
            f"{where}: no docker/{match['name']}.Dockerfile"
        )
        assert match["tag"] == VERSION, f"{where}: tag {match['tag']} != project version {VERSION}"
    stage_images = {stage.get("image", "pipeline") for stage in K8S_DEPLOYMENT["stages"].values()}
    assert stage_images <= set(K8S_DEPLOYMENT["kubernetes"]["images"])


def _dockerfile(name: str) -> str:
    return (REPO / "docker" / f"{name}.Dockerfile").read_text()


def test_dockerfiles_pin_what_pyproject_pins():
    from pipeline.engines.sglang import SGLANG_VERSION

    dependencies = PYPROJECT["project"]["dependencies"]
    airflow_pin = _pin(PYPROJECT["project"]["optional-dependencies"]["airflow"], "apache-airflow").split(
        "=="
    )[1]
    torch_pin = _pin(dependencies, "torch")
    for path in sorted((REPO / "docker").glob("*.Dockerfile")):
        for base in re.findall(r"^FROM\s+(\S+)", path.read_text(), flags=re.M):
            assert ":" in base and not base.endswith(":latest"), f"{path.name}: unpinned base image {base}"

    pipeline = _dockerfile("pipeline")
    assert f"FROM apache/airflow:{airflow_pin}-python3.11" in pipeline
    assert f'"{torch_pin}"' in pipeline and '".[airflow]"' in pipeline
    # the triggerer imports the retraining watches' triggers from the installed package
    assert "COPY --chown=airflow drafter_triggers ./drafter_triggers" in pipeline
    assert {"drafter_triggers", "drafter_triggers.*"} <= set(
        PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    )
    assert HELM_VALUES["airflowVersion"] == airflow_pin

    trainer = _dockerfile("trainer")
    assert f'"{torch_pin}"' in trainer and "pip install --no-cache-dir ." in trainer
    # nodes start no one over SSH; the train stage creates the node Job from the manifest in the image
    assert not re.search(r"pdsh|openssh|sshd", trainer)
    assert "COPY infra/k8s/trainer-workers.yaml ./infra/k8s/trainer-workers.yaml" in trainer

    sglang = _dockerfile("sglang")
    assert re.search(rf"^ARG SGLANG_VERSION={re.escape(SGLANG_VERSION)}$", sglang, flags=re.M)
    decided = set(re.search(r'SGLANG_DECIDES="([^"]+)"', sglang).group(1).split())
    # what SGLang 0.5.23's wheel pins differently from pyproject (torch 2.14.1, transformers 5.19.0,
    # tokenizers 0.23.2), and deepspeed, which serving does not need
    assert decided == {"torch", "transformers", "tokenizers", "deepspeed"}
    assert "--no-deps ." in sglang and "pyproject.toml" in sglang
    assert all("==" in dependency for dependency in dependencies)  # the rest arrive pinned
    # SGLang's environment keeps its versions (numpy past a bound of one of SGLang's dependencies only
    # warned): ours are installed under a constraints file of it, and a conflict left fails the build
    last_install = sglang.rindex("pip install")
    assert "-c /tmp/sglang-environment.txt" in sglang and "pip check" in sglang[last_install:]
    assert sglang.index("pip list --format=freeze > /tmp/sglang-environment.txt") < last_install


def test_the_sglang_image_installs_only_what_sglangs_environment_lacks_at_our_pins():
    sys.path.insert(0, str(REPO / "docker"))
    try:
        from sglang_requirements import requirements
    finally:
        sys.path.remove(str(REPO / "docker"))
    dependencies = ["torch==2.13.*", "numpy==2.4.6", "tenacity==9.2.1", "mlflow-skinny==3.17.2"]
    assert requirements(dependencies, {"torch"}, {"torch", "numpy", "mlflow-skinny"}) == [
        "numpy",  # SGLang's environment has it: its version stays, under the constraints file
        "tenacity==9.2.1",  # it has not: our pin
        "mlflow-skinny",
    ]
    assert "sglang" not in PYPROJECT["project"]["optional-dependencies"]


def test_the_vllm_image_keeps_vllm_apart_at_the_version_the_pipeline_was_coded_to():
    from pipeline.engine_settings import VllmEngineConfig
    from pipeline.engines.vllm import VLLM_VERSION

    vllm = _dockerfile("vllm")
    assert re.search(rf"^ARG VLLM_VERSION={re.escape(VLLM_VERSION)}$", vllm, flags=re.M)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^VLLM_VERSION := {re.escape(VLLM_VERSION)}$", makefile, flags=re.M)
    # vLLM in its own virtualenv where benchmark.vllm.python's default finds it from the WORKDIR
    workdir = re.search(r"^WORKDIR (\S+)$", vllm, flags=re.M).group(1)
    assert f"{workdir}/{Path(VllmEngineConfig().python).parent.parent}" == "/opt/drafter/.venv-vllm"
    assert "python3.11 -m venv /opt/drafter/.venv-vllm" in vllm and '"vllm==${VLLM_VERSION}"' in vllm
    # the pipeline apart from it, with pyproject's torch pin (the CPU build: it never loads the target)
    torch_pin = _pin(PYPROJECT["project"]["dependencies"], "torch")
    assert f'"{torch_pin}" --index-url https://download.pytorch.org/whl/cpu' in vllm
    assert "python3.11 -m venv /opt/venv" in vllm and "pip install --no-cache-dir ." in vllm


MODELS = {
    "Namespace": "V1Namespace",
    "Service": "V1Service",
    "StatefulSet": "V1StatefulSet",
    "Deployment": "V1Deployment",
    "ConfigMap": "V1ConfigMap",
    "ServiceAccount": "V1ServiceAccount",
    "Job": "V1Job",
    "PersistentVolumeClaim": "V1PersistentVolumeClaim",
    "PersistentVolume": "V1PersistentVolume",
    "Role": "V1Role",
    "RoleBinding": "V1RoleBinding",
    "PodDisruptionBudget": "V1PodDisruptionBudget",
}


def _normalized(value):
    if isinstance(value, dict):
        return {k: _normalized(v) for k, v in value.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_parse_into_kubernetes_models_without_unknown_fields(path):
    from kubernetes.client import ApiClient

    client = ApiClient()
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
        assert doc["kind"] in MODELS, f"{path.name}: no model for kind {doc['kind']}"
        model = client._ApiClient__deserialize(
            doc, MODELS[doc["kind"]]
        )  # required fields and types checked here
        back = client.sanitize_for_serialization(model)
        # a field the model does not know is dropped on the way in: the round trip shows it
        assert _normalized(back) == _normalized(doc), f"{path.name}: {doc['kind']}/{doc['metadata']['name']}"


def _server_info(args: list[str]) -> dict:
    """SGLang launch flags as the resolved server args /server_info reports."""
    from pipeline.engines.sglang import SGLANG_VERSION

    info: dict = {"version": SGLANG_VERSION}
    key = None
    for token in args:
        if token.startswith("--"):
            key = token[2:].replace("-", "_")
            info[key] = True
            continue
        value = int(token) if re.fullmatch(r"-?\d+", token) else token
        if info[key] is True:
            info[key] = value
        else:
            info[key] = (info[key] if isinstance(info[key], list) else [info[key]]) + [value]
    return info


def _sglang_args(kind: str, name: str) -> list[str]:
    container = next(c for c in _containers(_workload(kind, name)) if c["name"] == "sglang")
    assert container["command"] == ["python", "-m", "sglang.launch_server"]
    return container["args"]


def test_capture_servers_start_with_the_capture_contracts_flags():
    from pipeline.engines.sglang import capture_server_problems

    info = _server_info(_sglang_args("StatefulSet", "sglang-capture-aux"))
    capture = KIMI["capture"]
    assert (
        capture_server_problems(
            info,
            capture["aux_layer_ids"],
            KIMI["target"]["num_layers"],
            capture["max_length"],
            aux_server=True,
            prompt_logprobs="topk" in capture["teacher"],
        )
        == []
    )
    assert (
        info["tp"] == KIMI["target"]["tensor_parallel"] and info["model_path"] == KIMI["target"]["model_path"]
    )
    # the generation servers are plain servers: no capture paths, same model
    generate = _server_info(_sglang_args("StatefulSet", "sglang-generate"))
    assert "enable_return_aux_hidden_states" not in generate and generate["model_path"] == info["model_path"]


@pytest.mark.parametrize(
    "section, statefulset", [("generate", "sglang-generate"), ("capture", "sglang-capture-aux")]
)
def test_config_urls_are_the_pods_of_the_fleet_the_dag_scales(section, statefulset):
    from pipeline.ops.deployment import load_deployment
    from pipeline.ops.fleets import ServerFleet, replicas_for

    workload = _workload("StatefulSet", statefulset)
    service = _workload("Service", workload["spec"]["serviceName"])
    namespace, port = workload["metadata"]["namespace"], service["spec"]["ports"][0]["port"]
    urls = KIMI[section]["sglang"]["urls"]
    assert urls == [
        f"http://{statefulset}-{i}.{service['metadata']['name']}.{namespace}.svc:{port}"
        for i in range(len(urls))
    ]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert workload["spec"]["replicas"] == 0  # no GPUs held between runs: the DAG scales it
    deployment = load_deployment(REPO / "configs" / "deployment" / "kubernetes.yaml")
    fleet = ServerFleet.model_validate(deployment.fleet(section))
    assert (fleet.namespace, fleet.statefulset) == (namespace, statefulset)
    assert replicas_for(urls, fleet, section) == len(urls)
    # a run's usage counts the GPUs each server pod requests
    [server] = workload["spec"]["template"]["spec"]["containers"]
    assert fleet.gpus_per_replica == int(server["resources"]["requests"]["nvidia.com/gpu"])
    # the pipeline's pods may scale exactly these StatefulSets
    role, binding = (
        _workload("Role", "drafter-fleet-scaler"),
        _workload("RoleBinding", "drafter-pipeline-scales-fleets"),
    )
    scale_rule = next(rule for rule in role["rules"] if rule["resources"] == ["statefulsets/scale"])
    assert statefulset in scale_rule["resourceNames"] and "patch" in scale_rule["verbs"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": K8S_DEPLOYMENT["kubernetes"]["service_account"],
            "namespace": K8S_DEPLOYMENT["kubernetes"]["namespace"],
        }
    ]


def test_serving_pulls_the_pinned_version_and_starts_with_the_flags_the_pull_wrote(tmp_path):
    """The init container pulls exactly the version DRAFTER_VERSION pins (`drafter pull --version`, which
    refuses an alias's name), never `production` as it is when the pod starts: a pod recreated after a
    later promotion serves what its replicas serve. Unpinned, it fails at once, saying what to run."""
    import shlex
    import subprocess

    from pipeline.config import load_config
    from pipeline.ops.registry import engine_server_flags, write_serving_flags

    serving = _workload("Deployment", "kimi-k2-5-eagle3")
    init = serving["spec"]["template"]["spec"]["initContainers"][0]
    assert init["name"] == "pull-drafter" and init["env"] == [{"name": "DRAFTER_VERSION", "value": ""}]
    pin = "kubectl -n sglang set env deployment/kimi-k2-5-eagle3 -c pull-drafter DRAFTER_VERSION=<version>"
    assert pin in (REPO / "docs" / "RUNBOOK.md").read_text()
    script = init["args"][0].replace("exec drafter", "printf '%s\\n' drafter")

    def init_run(version: str) -> subprocess.CompletedProcess:
        env = {"PATH": os.environ["PATH"], "DRAFTER_VERSION": version}
        return subprocess.run([*init["command"], script], capture_output=True, text=True, env=env)

    unpinned = init_run("")
    assert unpinned.returncode == 1 and "DRAFTER_VERSION pins no version: kubectl -n sglang set env" in (
        unpinned.stderr
    )
    pull = init_run("v0007").stdout.splitlines()
    assert pull[:2] == ["drafter", "pull"] and pull[pull.index("--version") + 1] == "v0007"
    assert "--alias" not in pull
    dest, flags_file = pull[pull.index("--dest") + 1], pull[pull.index("--flags-file") + 1]
    assert serving["spec"]["template"]["spec"]["serviceAccountName"] == "drafter-reader"
    # the server's command line, with the flags file the pull writes, is SGLang's plus exactly those flags
    sglang = next(c for c in _containers(serving) if c["name"] == "sglang")
    target = load_config(KIMI_CONFIG).target
    recorded = {"steps": 3, "topk": 1, "draft_tokens": 4, "max_running_requests": 48}
    flags = engine_server_flags("sglang", target, dest, recorded)
    assert flags[:3] == ["--tp", "8", "--trust-remote-code"]  # the target's own flags, from its run config
    assert flags[-2:] == ["--max-running-requests", "48"]  # the load every benchmark server ran at
    write_serving_flags(tmp_path / "serving-flags", flags)
    script = sglang["args"][0].replace(flags_file, str(tmp_path / "serving-flags"))
    script = script.replace("exec python", "printf '%s\\n'")
    # the commit the model store's download recorded is what the server is told it serves
    metadata = "/models/Kimi-K2.5/.cache/huggingface/download/config.json.metadata"
    assert metadata in script
    (tmp_path / "metadata").write_text('6f1c0ffee\n"etag"\n1764900000.0\n')
    script = script.replace(metadata, str(tmp_path / "metadata"))
    argv = subprocess.run(
        sglang["command"] + [script], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert argv[:3] == ["-m", "sglang.launch_server", "--model-path"] and argv[-len(flags) :] == flags
    assert argv[argv.index("--revision") + 1] == "6f1c0ffee"
    options = [arg for arg in argv if arg.startswith("--")]
    assert sorted(option for option in set(options) if options.count(option) > 1) == []  # none given twice
    assert shlex.split((tmp_path / "serving-flags").read_text()) == flags


def _trainer_job() -> tuple[dict, dict, dict]:
    job = _workload("Job", "drafter-trainer")
    pod = job["spec"]["template"]["spec"]
    return job, pod, next(c for c in pod["containers"] if c["name"] == "node")


def test_every_trainer_node_runs_the_same_torchrun_command_meeting_at_the_headless_service():
    from pipeline.config import load_config
    from pipeline.training.nodes import job_for_run

    job, pod, node = _trainer_job()
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["backoffLimit"] == 0
    service = _workload("Service", pod["subdomain"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    # pod 0 of the Job under the headless Service is where every node meets
    kimi = load_config(KIMI_CONFIG, ["train.nodes=4", "train.launcher=kubernetes"])
    namespace = job["metadata"]["namespace"]
    pod_0 = f"{job['metadata']['name']}-0.{service['metadata']['name']}.{namespace}.svc.cluster.local"
    assert kimi.train.rendezvous_endpoint == pod_0
    assert (
        kimi.train.rendezvous_port == service["spec"]["ports"][0]["port"] == node["ports"][0]["containerPort"]
    )
    # one command for every pod, the one the train settings make; the run fills in what differs per run
    run = job_for_run(job, kimi.train, "s3://drafter-pipeline/kimi/runs/r/train/worker_spec.json", "r")
    assert run["spec"]["completions"] == run["spec"]["parallelism"] == 4
    annotations = run["spec"]["template"]["metadata"]["annotations"]
    read = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in node["env"]}
    assert {name: annotations[path.split("'")[1]] for name, path in read.items()} == {
        "DRAFTER_RUN_ID": "r",
        "DRAFTER_WORKER_SPEC": "s3://drafter-pipeline/kimi/runs/r/train/worker_spec.json",
        "DRAFTER_NODES": "4",
    }
    assert all(f"$({name})" in node["args"] for name in read)
    # the train task's pod (the stage that creates the Job) may create it
    binding = _workload("RoleBinding", "drafter-train-task-launches-trainer-job")
    service_account = K8S_DEPLOYMENT["kubernetes"]["service_account"]
    assert binding["subjects"][0]["name"] == service_account == pod["serviceAccountName"]
    rules = _workload("Role", binding["roleRef"]["name"])["rules"]
    assert {"batch"} == set(rules[0]["apiGroups"]) and {"create", "get", "delete"} <= set(rules[0]["verbs"])


def test_trainer_nodes_start_no_ssh_and_get_eight_big_gpus_shared_memory_and_the_shared_checkpoints():
    from pipeline.ops.deployment import load_deployment

    objects = yaml.safe_dump(
        [doc for file, doc in _documents() if file.startswith("trainer-")]
    )  # no comments
    assert not re.search(r"ssh|pdsh|hostfile|2222", objects, flags=re.I)
    job, pod, node = _trainer_job()
    assert node["resources"]["limits"]["nvidia.com/gpu"] == str(KIMI["train"]["nproc"]) == "8"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}  # >= 140 GB per GPU
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in node["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # the checkpoints: storage.local_cache on the ReadWriteMany cache claim, mounted where the train task
    # has it
    placement = load_deployment(REPO / "configs" / "deployment" / "kubernetes.yaml").kubernetes
    cache = volumes[mounts[KIMI["storage"]["local_cache"]]]["persistentVolumeClaim"]["claimName"]
    assert cache == placement.cache_volume_claim and placement.cache_path == KIMI["storage"]["local_cache"]
    assert _workload("PersistentVolumeClaim", cache)["spec"]["accessModes"] == ["ReadWriteMany"]
    weights = [path for path in mounts if KIMI["target"]["model_path"].startswith(path + "/")]
    claim = volumes[mounts[weights[0]]]["persistentVolumeClaim"]
    assert claim["readOnly"] and _workload(
        "PersistentVolumeClaim", claim["claimName"], job["metadata"]["namespace"]
    )


def test_deployment_objects_and_roles_exist_in_the_manifests():
    names = {
        (doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]) for _, doc in _documents()
    }
    placement = K8S_DEPLOYMENT["kubernetes"]
    namespace = placement["namespace"]
    assert ("Namespace", None, namespace) in names
    assert ("ServiceAccount", namespace, placement["service_account"]) in names
    # every claim a task pod mounts exists in the pods' own namespace (a claim is namespaced)
    claims = [placement["config_volume_claim"], placement["cache_volume_claim"]]
    claims += [v["name"] for v in placement["volumes"] if v["kind"] == "pvc"]
    claims += [
        m["name"]
        for stage in K8S_DEPLOYMENT["stages"].values()
        for m in stage.get("mounts", [])
        if m["kind"] == "pvc"
    ]
    for claim in claims:
        assert ("PersistentVolumeClaim", namespace, claim) in names, claim
    binding = _workload("RoleBinding", "airflow-workers-launch-drafter-pods")
    assert binding["subjects"][0]["name"] == HELM_VALUES["workers"]["serviceAccount"]["name"]
    assert HELM_VALUES["executor"] == "KubernetesExecutor"
    env = {e["name"]: e["value"] for e in HELM_VALUES["env"]}
    assert env["DRAFTER_DEPLOYMENT"] == "/opt/drafter/configs/deployment/kubernetes.yaml"
    policy = json.loads((REPO / "infra" / "s3" / "bucket-policy.json").read_text())
    principals = {s["Principal"]["AWS"].split("/")[-1] for s in policy["Statement"]}
    role_of = {
        doc["metadata"]["name"]: doc["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].split("/")[-1]
        for _, doc in _documents()
        if doc["kind"] == "ServiceAccount"
    }
    assert role_of == {"drafter-pipeline": "drafter-pipeline-writer", "drafter-reader": "drafter-reader"}
    assert set(role_of.values()) == principals
    assert HELM_VALUES["workers"]["serviceAccount"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(
        "role/drafter-pipeline-writer"
    )


def test_bucket_policy_and_lifecycle_rules_load_into_s3(s3_endpoint):
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    bucket = "drafter-pipeline"
    s3.create_bucket(Bucket=bucket)
    policy = (REPO / "infra" / "s3" / "bucket-policy.json").read_text().replace("ACCOUNT_ID", "123456789012")
    s3.put_bucket_policy(Bucket=bucket, Policy=policy)
    assert json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"]) == json.loads(policy)
    lifecycle = json.loads((REPO / "infra" / "s3" / "lifecycle.json").read_text())
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration=lifecycle)
    rules = {rule["ID"]: rule for rule in s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
    root = KIMI["storage"]["root"].removeprefix(f"s3://{bucket}/")
    assert rules["captures-to-infrequent-access"]["Filter"]["Prefix"] == f"{root}/captures/"
    # datasets read their captures' shards where they are: nothing a dataset can name ever expires
    for kept in ("captures", "datasets", "responses"):
        assert not any(
            f"{root}/{kept}/".startswith(rule["Filter"].get("Prefix", "")) and "Expiration" in rule
            for rule in rules.values()
        ), kept
    assert rules["abandoned-multipart-uploads"]["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 7
    # the registry never expires: no rule reaches drafters/
    assert not any(
        rule["Filter"].get("Prefix", "x").startswith(f"{root}/drafters")
        or (rule["Filter"].get("Prefix") == "" and "Expiration" in rule)
        for rule in rules.values()
    )


def test_every_dockerfile_copies_what_the_pipeline_needs():
    for name in ("pipeline", "trainer", "sglang"):
        text = _dockerfile(name)
        for needed in ("COPY pyproject.toml", "pipeline ./pipeline", "configs ./configs"):
            assert needed in text.replace("--chown=airflow ", ""), (name, needed)
    assert "COPY --chown=airflow dags /opt/airflow/dags" in _dockerfile("pipeline")
    assert Path(REPO / "configs" / "deployment" / "kubernetes.yaml").is_file()


# GPU memory per product (GB): Kimi-K2.5 at TP 8 needs >= 140 GB per GPU (SGLang's Kimi-K2.5 recipe)
GPU_MEMORY_GB = {
    "NVIDIA-H100-80GB-HBM3": 80,
    "NVIDIA-A100-SXM4-80GB": 80,
    "NVIDIA-H200": 141,
    "NVIDIA-B200": 180,
}


def test_gpu_pods_fit_kimi_and_tolerate_gpu_taints():
    selectors = [K8S_DEPLOYMENT["kubernetes"]["node_selector_gpu"]]
    tolerations = [K8S_DEPLOYMENT["kubernetes"]["gpu_tolerations"]]
    for _, doc in _documents():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        if any(
            "nvidia.com/gpu" in (c.get("resources", {}).get("limits") or {})
            for c in spec.get("containers", [])
        ):
            selectors.append(spec.get("nodeSelector") or {})
            tolerations.append(spec.get("tolerations") or [])
    assert len(selectors) >= 4
    for selector in selectors:
        assert GPU_MEMORY_GB.get(selector.get("nvidia.com/gpu.product"), 0) >= 140, selector
    for toleration in tolerations:
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in toleration


def _rollout_fenceposts(deployment: dict) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) as Kubernetes resolves them for the Deployment's replicas: defaults 25%
    each, a percentage of surge rounded up and of unavailability rounded down, and 1 unavailable when both
    come to 0 (pkg/controller/deployment/util/deployment_util.go, ResolveFenceposts)."""
    import math

    replicas = deployment["spec"].get("replicas", 1)
    rolling = (deployment["spec"].get("strategy") or {}).get("rollingUpdate") or {}

    def resolve(value, round_up: bool) -> int:
        if isinstance(value, int):
            return value
        share = float(str(value).rstrip("%")) / 100 * replicas
        return math.ceil(share) if round_up else math.floor(share)

    surge = resolve(rolling.get("maxSurge", "25%"), True)
    unavailable = resolve(rolling.get("maxUnavailable", "25%"), False)
    return surge, 1 if surge == unavailable == 0 else unavailable


def test_a_serving_rollout_needs_no_node_beyond_its_replicas():
    serving = _workload("Deployment", "kimi-k2-5-eagle3")
    assert serving["spec"].get("strategy", {}).get("type", "RollingUpdate") == "RollingUpdate"
    surge, unavailable = _rollout_fenceposts(serving)
    assert surge == 0, "a rollout would start a replica on a spare 8-GPU node first"
    assert 1 <= unavailable < serving["spec"]["replicas"]  # one at a time: the others serve meanwhile
    assert _rollout_fenceposts({"spec": {"replicas": 2}}) == (1, 0)  # the default this replaces


def test_every_task_pod_knows_its_name_uid_and_timeout_for_what_it_starts_in_the_cluster():
    """The train task's pod owns the trainer Job it creates (deleted with the pod) and gives it its own
    timeout as the Job's deadline: the downward API names the pod, the task's timeout is in its env, and
    the role the task runs as may patch the Job (to disown a failed one, kept for its logs)."""
    from pipeline.ops.deployment import load_deployment
    from pipeline.task_pod import TASK_POD_NAME_ENV, TASK_POD_UID_ENV, TASK_TIMEOUT_ENV

    deployment = load_deployment(REPO / "configs/deployment/kubernetes.yaml")
    pod = deployment.pod_options("train")
    assert pod["env_vars"][TASK_TIMEOUT_ENV] == str(deployment.stage("train").timeout_minutes * 60)
    fields = {env.name: env.value_from.field_ref.field_path for env in pod["pod_runtime_info_envs"]}
    assert fields == {TASK_POD_NAME_ENV: "metadata.name", TASK_POD_UID_ENV: "metadata.uid"}
    role = next(
        doc
        for doc in yaml.safe_load_all((REPO / "infra/k8s/trainer-rendezvous.yaml").read_text())
        if doc and doc["kind"] == "Role"
    )
    assert {"create", "get", "patch", "delete"} <= set(role["rules"][0]["verbs"])


def test_capture_spills_to_scratch_it_requested_big_enough_for_a_batch():
    """The capture client spills each sample's float32 hidden states while its batch waits to be stored:
    the pod's TMPDIR is an emptyDir of the stage's scratch size, requested (and limited) as ephemeral
    storage, and that holds a batch of the run config's longest samples and a shard part besides."""
    from pipeline.config import load_config
    from pipeline.ops.deployment import load_deployment

    deployment = load_deployment(REPO / "configs/deployment/kubernetes.yaml")
    pod = deployment.pod_options("capture")
    scratch = next(volume for volume in pod["volumes"] if volume.name == "scratch")
    mount = next(m for m in pod["volume_mounts"] if m.name == "scratch")
    assert pod["env_vars"]["TMPDIR"] == mount.mount_path and scratch.empty_dir.medium is None
    resources = pod["container_resources"]
    size = scratch.empty_dir.size_limit
    assert resources.requests["ephemeral-storage"] == resources.limits["ephemeral-storage"] == size
    kimi = load_config(KIMI_CONFIG)
    capture = kimi.capture
    spilled = capture.batch_size * capture.max_length * 3 * kimi.target.hidden_size * 4
    assert spilled + capture.part_max_mib * 2**20 <= int(size.removesuffix("Gi")) * 2**30


def _claims_mounted() -> list[tuple[str, str, str]]:
    """(namespace, workload, claim) for every claim a manifest's pods mount."""
    found = []
    for _, doc in _documents():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for volume in spec.get("volumes") or []:
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                found.append((doc["metadata"]["namespace"], doc["metadata"]["name"], claim))
    return found


def test_every_mounted_claim_is_declared_and_the_weights_are_one_filesystem_in_both_namespaces():
    """A pod's claim must exist in its own namespace; the weights claims of both namespaces are bound
    (volumeName, no storage class: not provisioned as new, empty volumes) to volumes reserved for them that
    name one filesystem, the model store."""
    for namespace, workload, claim in _claims_mounted():
        assert _workload("PersistentVolumeClaim", claim, namespace), (workload, claim)
    filesystems = set()
    for namespace in ("drafter", "sglang"):
        claim = _workload("PersistentVolumeClaim", "kimi-k2-5-weights", namespace)
        assert claim["spec"]["storageClassName"] == "" and claim["spec"]["volumeName"]
        volume = _workload("PersistentVolume", claim["spec"]["volumeName"])
        assert volume["spec"]["claimRef"] == {"namespace": namespace, "name": "kimi-k2-5-weights"}
        filesystems.add((volume["spec"]["csi"]["driver"], volume["spec"]["csi"]["volumeHandle"]))
    assert len(filesystems) == 1


def test_every_pod_runs_as_the_task_pods_user():
    """What one pod writes on a shared volume another replaces: the task pods' run_as, the trainer Job's
    and the SGLang pods' securityContext and the images' USER are one uid and group, never root; only the
    volume owner runs as root, to give the cache's root to that user."""
    from harness.rehearsal import dockerfile_user
    from pipeline.ops.deployment import load_deployment

    placement = load_deployment(REPO / "configs/deployment/kubernetes.yaml").kubernetes
    run_as = placement.run_as
    expected = {"runAsUser": run_as.uid, "runAsGroup": run_as.gid, "runAsNonRoot": True}
    assert run_as.security_context() == expected and run_as.uid != 0
    for _, doc in _documents():
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if pod is not None and doc["metadata"]["name"] != "drafter-volume-owner":
            assert pod.get("securityContext") == expected, doc["metadata"]["name"]
    for name in ("pipeline", "trainer", "sglang", "vllm"):
        user = dockerfile_user(REPO / "docker" / f"{name}.Dockerfile")
        assert (user.uid, user.gid) == (run_as.uid, run_as.gid), name
    owner = _workload("Job", "drafter-volume-owner")
    script = owner["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert f"chown {run_as.uid}:{run_as.gid} {placement.cache_path}" in script


def test_the_local_clusters_images_have_airflow_where_their_dockerfiles_install_it(tmp_path):
    """The rehearsal's images take their third-party packages from this machine's virtualenv, which has
    Airflow; a pod of an image built without it (trainer, SGLang, vLLM) meets harness/image_without_airflow
    first on its PYTHONPATH, so `import airflow` fails there as in the built image and succeeds in the
    pipeline image's pods. Each runs its own image's Python, as its pods do."""
    from harness.rehearsal import _images, dockerfile_installs_airflow

    names = {ref: key for key, ref in K8S_DEPLOYMENT["kubernetes"]["images"].items()}
    has_airflow = {}
    for ref, image in _images(tmp_path).items():
        if ref not in names:  # the xcom sidecar: alpine, no Python
            continue
        inside = [entry for entry in image.env.get("PYTHONPATH", "").split(":") if entry]
        on_host = [image.files.get(entry, entry) for entry in inside]  # where each entry is bound from
        python = Path(image.env["PATH"].split(":")[0]) / "python"
        out = subprocess.run(
            [str(python), "-c", "import airflow.plugins_manager"],
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(on_host)},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        has_airflow[names[ref]] = out.returncode == 0
        if out.returncode != 0:
            assert "No module named 'airflow'" in out.stderr, out.stderr[-2000:]
    dockerfiles = {name: REPO / "docker" / f"{name}.Dockerfile" for name in has_airflow}
    expected = {name: dockerfile_installs_airflow(path) for name, path in dockerfiles.items()}
    assert expected == {"pipeline": True, "trainer": False, "sglang": False, "vllm": False}
    assert has_airflow == expected


def test_helm_upgrades_keep_the_secrets_running_tasks_hold():
    """The chart generates its JWT secret and API secret key anew on every install and upgrade unless named
    (chart/templates/_helpers.yaml: `jwt_secret`, key jwt-secret; `api_secret_key_secret`, key
    api-secret-key): a new JWT secret fails every running task's heartbeat and its pod is killed. Both are
    named, and the runbook makes each, with the key the chart reads, before it first installs the chart."""
    runbook = (REPO / "docs" / "RUNBOOK.md").read_text()
    install = runbook.index("helm upgrade --install airflow")
    for value, key in (("jwtSecretName", "jwt-secret"), ("apiSecretKeySecretName", "api-secret-key")):
        name = HELM_VALUES[value]
        made = runbook.find(f"create secret generic {name} --from-literal={key}=")
        assert 0 <= made < install, (value, name)


def test_the_install_applies_nothing_that_holds_gpus_and_serving_comes_after_a_promotion():
    """A pod holds the GPUs it requests from the moment it is scheduled, init containers included: the
    serving Deployment applied at install would hold 16 GPUs, its pull of `production` failing until the
    first promotion. The install's manifests run no GPU pod; serving is applied in §2 once `drafter list`
    shows a production version."""
    from harness.cluster import pod_requests
    from harness.rehearsal import runbook_commands

    held = {}
    for command in runbook_commands(section="1."):
        for path in re.findall(r"-f (\S+)", command) if command.startswith("kubectl apply") else ():
            for doc in (d for d in yaml.safe_load_all((REPO / path).read_text()) if d):
                if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
                    spec = doc["spec"]
                    pods = spec.get("parallelism", 1) if doc["kind"] == "Job" else spec.get("replicas", 1)
                    gpus = pods * pod_requests(spec["template"]["spec"]).get("nvidia.com/gpu", 0)
                    if gpus:
                        held[f"{path}: {doc['kind']}/{doc['metadata']['name']}"] = gpus
    assert held == {}
    first_run = runbook_commands(section="2.")
    serve = first_run.index("kubectl apply -f infra/k8s/sglang-serve.yaml")
    assert any(command.startswith("drafter list") for command in first_run[:serve])


def test_the_runbook_names_the_driver_each_images_cuda_needs():
    """A CUDA 13 image needs an R580+ driver on the node, CUDA 12.x R570+ (NVIDIA's CUDA compatibility
    table: 13.0 with 580.65.06, 12.8 with 570.26): the runbook says so for each CUDA the images are built
    on."""
    needs = {"13": "R580", "12": "R570"}
    runbook = (REPO / "docs" / "RUNBOOK.md").read_text()
    for dockerfile in sorted((REPO / "docker").glob("*.Dockerfile")):
        base = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)", dockerfile.read_text(), flags=re.M)
        if base:
            assert needs[base.group(1)] in runbook, (dockerfile.name, base.group(0))
            assert f"CUDA {base.group(1)}.{base.group(2)}" in runbook, dockerfile.name


def test_a_drain_never_takes_every_serving_replica_at_once():
    docs = [d for d in yaml.safe_load_all((REPO / "infra/k8s/sglang-serve.yaml").read_text()) if d]
    serving = next(d for d in docs if d["kind"] == "Deployment")
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert len(budgets) == 1 and budgets[0]["metadata"]["namespace"] == serving["metadata"]["namespace"]
    budget = budgets[0]["spec"]
    assert budget["selector"]["matchLabels"] == serving["spec"]["selector"]["matchLabels"]
    assert budget["maxUnavailable"] < serving["spec"]["replicas"]
