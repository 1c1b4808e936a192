"""Production deployment files, checked without a cluster or a Docker engine: every image a config or
manifest names is built by a Dockerfile in docker/ at the project version, pinned versions agree with
pyproject.toml, every Kubernetes manifest parses into the kubernetes client's models with no unknown
field, the SGLang servers' flags satisfy the capture contract and match the run config, and the S3
bucket policy and lifecycle rules load into an S3 server."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
MANIFESTS = sorted((REPO / "infra" / "k8s").glob("*.yaml"))
HELM_VALUES = yaml.safe_load((REPO / "infra" / "helm" / "airflow-values.yaml").read_text())
K8S_DEPLOYMENT = yaml.safe_load((REPO / "configs" / "deployment" / "kubernetes.yaml").read_text())
KIMI = yaml.safe_load((REPO / "configs" / "kimi-k2.5.yaml").read_text())
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


def _workload(kind: str, name: str) -> dict:
    matches = [doc for _, doc in _documents() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, (kind, name)
    return matches[0]


def _referenced_images() -> dict[str, str]:
    images = {f"configs/deployment/kubernetes.yaml:{key}": ref for key, ref in K8S_DEPLOYMENT["kubernetes"]["images"].items()}
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
        assert (REPO / "docker" / f"{match['name']}.Dockerfile").is_file(), f"{where}: no docker/{match['name']}.Dockerfile"
        assert match["tag"] == VERSION, f"{where}: tag {match['tag']} != project version {VERSION}"
    stage_images = {stage.get("image", "pipeline") for stage in K8S_DEPLOYMENT["stages"].values()}
    assert stage_images <= set(K8S_DEPLOYMENT["kubernetes"]["images"])


def _dockerfile(name: str) -> str:
    return (REPO / "docker" / f"{name}.Dockerfile").read_text()


def test_dockerfiles_pin_what_pyproject_pins():
    from pipeline.engines.sglang import SGLANG_VERSION

    dependencies = PYPROJECT["project"]["dependencies"]
    airflow_pin = _pin(PYPROJECT["project"]["optional-dependencies"]["airflow"], "apache-airflow").split("==")[1]
    torch_pin = _pin(dependencies, "torch")
    for path in sorted((REPO / "docker").glob("*.Dockerfile")):
        for base in re.findall(r"^FROM\s+(\S+)", path.read_text(), flags=re.M):
            assert ":" in base and not base.endswith(":latest"), f"{path.name}: unpinned base image {base}"

    pipeline = _dockerfile("pipeline")
    assert f"FROM apache/airflow:{airflow_pin}-python3.11" in pipeline
    assert f'"{torch_pin}"' in pipeline and "\".[airflow]\"" in pipeline
    assert HELM_VALUES["airflowVersion"] == airflow_pin

    trainer = _dockerfile("trainer")
    assert f'"{torch_pin}"' in trainer and "pip install --no-cache-dir ." in trainer
    assert "pdsh" in trainer and "openssh-server" in trainer  # the multi-node workers' launcher path

    sglang = _dockerfile("sglang")
    assert re.search(rf"^ARG SGLANG_VERSION={re.escape(SGLANG_VERSION)}$", sglang, flags=re.M)
    decided = set(re.search(r'SGLANG_DECIDES="([^"]+)"', sglang).group(1).split())
    # what SGLang 0.5.23's wheel pins differently from pyproject (torch 2.14.1, transformers 5.19.0,
    # tokenizers 0.23.2), and deepspeed, which serving does not need
    assert decided == {"torch", "transformers", "tokenizers", "deepspeed"}
    assert "--no-deps ." in sglang and "pyproject.toml" in sglang
    assert all("==" in dependency for dependency in dependencies)  # the rest arrive pinned
    assert "sglang" not in PYPROJECT["project"]["optional-dependencies"]


MODELS = {"Namespace": "V1Namespace", "Service": "V1Service", "StatefulSet": "V1StatefulSet",
          "Deployment": "V1Deployment", "ConfigMap": "V1ConfigMap", "ServiceAccount": "V1ServiceAccount",
          "PersistentVolumeClaim": "V1PersistentVolumeClaim", "Role": "V1Role", "RoleBinding": "V1RoleBinding"}


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
        model = client._ApiClient__deserialize(doc, MODELS[doc["kind"]])  # required fields and types checked here
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
    assert capture_server_problems(info, capture["aux_layer_ids"], KIMI["target"]["num_layers"], capture["max_length"],
                                   aux_server=True, prompt_logprobs="topk" in capture["teacher"]) == []
    assert info["tp"] == KIMI["target"]["tensor_parallel"] and info["model_path"] == KIMI["target"]["model_path"]
    # the generation servers are plain servers: no capture paths, same model
    generate = _server_info(_sglang_args("StatefulSet", "sglang-generate"))
    assert "enable_return_aux_hidden_states" not in generate and generate["model_path"] == info["model_path"]


@pytest.mark.parametrize("section, statefulset", [("generate", "sglang-generate"), ("capture", "sglang-capture-aux")])
def test_config_urls_are_the_statefulset_pods(section, statefulset):
    workload = _workload("StatefulSet", statefulset)
    service = _workload("Service", workload["spec"]["serviceName"])
    namespace, port = workload["metadata"]["namespace"], service["spec"]["ports"][0]["port"]
    expected = [f"http://{statefulset}-{i}.{service['metadata']['name']}.{namespace}.svc:{port}"
                for i in range(workload["spec"]["replicas"])]
    assert KIMI[section]["sglang"]["urls"] == expected
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod


def test_serving_pulls_production_and_uses_the_promoted_flags():
    from pipeline.registry import sglang_flags

    serving = _workload("Deployment", "kimi-k2-5-eagle3")
    pull = serving["spec"]["template"]["spec"]["initContainers"][0]["command"]
    assert pull[:2] == ["drafter", "pull"] and pull[pull.index("--alias") + 1] == KIMI["registry"]["alias"]
    dest = pull[pull.index("--dest") + 1]
    bench = KIMI["benchmark"]["sglang"]
    flags = sglang_flags(dest, bench["steps"], bench["topk"], bench["draft_tokens"])
    args = _sglang_args("Deployment", "kimi-k2-5-eagle3")
    assert " ".join(flags) in " ".join(args)
    assert serving["spec"]["template"]["spec"]["serviceAccountName"] == "drafter-reader"


def test_trainer_hostfile_lists_every_worker_with_its_gpus():
    workers = _workload("StatefulSet", "drafter-trainer")
    hostfile = _workload("ConfigMap", "drafter-trainer-hostfile")["data"]["hostfile"].split("\n")
    gpus = workers["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    namespace = workers["metadata"]["namespace"]
    assert [line for line in hostfile if line] == [
        f"drafter-trainer-{i}.{workers['spec']['serviceName']}.{namespace}.svc slots={gpus}"
        for i in range(workers["spec"]["replicas"])]
    # the launcher (the train task's pod) mounts the hostfile, the SSH key and the same cache volume
    train = K8S_DEPLOYMENT["stages"]["train"]
    assert {m["name"] for m in train["mounts"]} == {"drafter-trainer-hostfile", "drafter-trainer-ssh"}
    cache_claims = {v["persistentVolumeClaim"]["claimName"] for v in workers["spec"]["template"]["spec"]["volumes"]
                    if "persistentVolumeClaim" in v}
    assert K8S_DEPLOYMENT["kubernetes"]["cache_volume_claim"] in cache_claims
    from pipeline.deployment import load_deployment

    placement = load_deployment(REPO / "configs" / "deployment" / "kubernetes.yaml").kubernetes
    assert placement.cache_path == KIMI["storage"]["local_cache"]
    mounts = workers["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "cache", "mountPath": placement.cache_path} in mounts


def test_deployment_objects_and_roles_exist_in_the_manifests():
    names = {(doc["kind"], doc["metadata"]["name"]) for _, doc in _documents()}
    placement = K8S_DEPLOYMENT["kubernetes"]
    assert ("Namespace", placement["namespace"]) in names
    assert ("ServiceAccount", placement["service_account"]) in names
    for claim in (placement["config_volume_claim"], placement["cache_volume_claim"]):
        assert ("PersistentVolumeClaim", claim) in names
    binding = _workload("RoleBinding", "airflow-workers-launch-drafter-pods")
    assert binding["subjects"][0]["name"] == HELM_VALUES["workers"]["serviceAccount"]["name"]
    assert HELM_VALUES["executor"] == "KubernetesExecutor"
    env = {e["name"]: e["value"] for e in HELM_VALUES["env"]}
    assert env["DRAFTER_DEPLOYMENT"] == "/opt/drafter/configs/deployment/kubernetes.yaml"
    policy = json.loads((REPO / "infra" / "s3" / "bucket-policy.json").read_text())
    principals = {s["Principal"]["AWS"].split("/")[-1] for s in policy["Statement"]}
    role_of = {doc["metadata"]["name"]: doc["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].split("/")[-1]
               for _, doc in _documents() if doc["kind"] == "ServiceAccount"}
    assert role_of == {"drafter-pipeline": "drafter-pipeline-writer", "drafter-reader": "drafter-reader"}
    assert set(role_of.values()) == principals
    assert HELM_VALUES["workers"]["serviceAccount"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(
        "role/drafter-pipeline-writer")


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
    assert rules["captures-to-infrequent-access-then-expire"]["Filter"]["Prefix"] == f"{root}/captures/"
    assert rules["abandoned-multipart-uploads"]["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 7
    # the registry never expires: no rule reaches drafters/
    assert not any(rule["Filter"].get("Prefix", "x").startswith(f"{root}/drafters") or
                   (rule["Filter"].get("Prefix") == "" and "Expiration" in rule) for rule in rules.values())


def test_every_dockerfile_copies_what_the_pipeline_needs():
    for name in ("pipeline", "trainer", "sglang"):
        text = _dockerfile(name)
        for needed in ("COPY pyproject.toml", "pipeline ./pipeline", "configs ./configs"):
            assert needed in text.replace("--chown=airflow ", ""), (name, needed)
    assert "COPY --chown=airflow dags /opt/airflow/dags" in _dockerfile("pipeline")
    assert Path(REPO / "configs" / "deployment" / "kubernetes.yaml").is_file()
