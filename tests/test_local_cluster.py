"""The rehearsal's local cluster (pipeline/dev/cluster.py): pods see only their env, their volumes and
the image's files; scheduling follows selectors, taints and capacity; volumes exist only when applied;
IAM roles for service accounts reach the pod as web-identity env, never as keys."""

import os
import time
from pathlib import Path

import pytest
import yaml

from pipeline.dev.cluster import LocalCluster, LocalImage, LocalNode, scheduling_problems

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (mount and PID namespaces)")

GPU_NODE = LocalNode("gpu", {"nvidia.com/gpu.product": "NVIDIA-H200"}, ({"key": "nvidia.com/gpu",
                                                                        "effect": "NoSchedule"},),
                     {"cpu": "192", "memory": "2048Gi", "nvidia.com/gpu": "8"})
SHELL = LocalImage({}, "/", {"PATH": "/usr/bin:/bin"})


def gpu_pod(**spec):
    base = {"containers": [{"name": "base", "resources": {"requests": {"cpu": "96", "memory": "1600Gi",
                                                                       "nvidia.com/gpu": "8"}}}]}
    return {**base, **spec}


def test_gpu_pods_schedule_only_where_selector_taint_and_capacity_fit():
    fits = gpu_pod(nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H200"},
                   tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    assert scheduling_problems(fits, GPU_NODE) == []
    assert any("taint" in p for p in scheduling_problems(gpu_pod(), GPU_NODE))
    wrong = {**fits, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    assert any("node selector" in p for p in scheduling_problems(wrong, GPU_NODE))
    big = {**fits, "containers": [{"name": "base", "resources": {"requests": {"nvidia.com/gpu": "16"}}}]}
    assert any("insufficient nvidia.com/gpu" in p for p in scheduling_problems(big, GPU_NODE))


@pytest.fixture
def cluster(tmp_path):
    manifest = tmp_path / "objects.yaml"
    manifest.write_text(yaml.safe_dump_all([
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
            "name": "writer", "namespace": "ns",
            "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/writer"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data", "namespace": "ns"},
         "spec": {"accessModes": ["ReadWriteMany"]}},
    ]))
    local = LocalCluster(tmp_path / "cluster", {"shell": SHELL},
                         (LocalNode("cpu", {}, (), {"cpu": "8", "memory": "16Gi"}),),
                         aws_endpoint="http://127.0.0.1:9")
    local.apply(manifest)
    yield local
    local.shutdown()


def run_pod(cluster, script: str, volumes=(), mounts=(), account=None, name="p"):
    spec = {"containers": [{"name": "base", "image": "shell", "command": ["sh", "-c", script],
                            "volumeMounts": list(mounts)}], "volumes": list(volumes)}
    if account:
        spec["serviceAccountName"] = account
    pod = cluster.create_pod({"metadata": {"name": name, "namespace": "ns"}, "spec": spec})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (pod.phase == "Pending" and not pod.containers
                                           or any(run.running for run in pod.containers.values())):
        time.sleep(0.1)
    logs = "".join(path.read_text() for path in pod.directory.glob("*.log"))
    return pod, logs


def test_a_pod_sees_its_volumes_and_not_this_machines_files(cluster, tmp_path):
    secret = tmp_path / "host-only.txt"
    secret.write_text("visible only on the host")
    (cluster.volume_dir("pvc", "ns", "data") / "shared.txt").write_text("on the volume")
    pod, logs = run_pod(cluster, f"cat /data/shared.txt && echo written > /data/out.txt && cat {secret}",
                        volumes=[{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}],
                        mounts=[{"name": "v", "mountPath": "/data"}])
    assert "on the volume" in logs
    assert (cluster.volume_dir("pvc", "ns", "data") / "out.txt").read_text() == "written\n"
    # the host's file is not in the pod: reading a path it does not mount fails there
    assert "No such file" in logs and pod.current_phase() == "Failed" and pod.containers["base"].exit_code != 0


def test_a_claim_nobody_applied_fails_the_pod_to_start(cluster):
    pod, _ = run_pod(cluster, "true", volumes=[{"name": "v", "persistentVolumeClaim": {"claimName": "missing"}}],
                     mounts=[{"name": "v", "mountPath": "/data"}])
    assert pod.phase == "Failed" and pod.reason == "FailedMount" and not pod.containers
    assert "missing" in pod.events[-1]["message"]


def test_the_env_is_the_pods_and_iam_roles_arrive_as_web_identity(cluster):
    os.environ["REHEARSAL_HOST_ONLY"] = "1"
    try:
        _, logs = run_pod(cluster, "env | sort; cat $AWS_WEB_IDENTITY_TOKEN_FILE", account="writer")
    finally:
        del os.environ["REHEARSAL_HOST_ONLY"]
    env = dict(line.split(" ", 1)[1].split("=", 1) for line in logs.splitlines() if "=" in line)
    assert env["AWS_ROLE_ARN"] == "arn:aws:iam::123456789012:role/writer"
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"
    assert "REHEARSAL_HOST_ONLY" not in env and "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert "local-web-identity-token-ns-writer" in logs


def test_a_missing_service_account_or_image_does_not_start(cluster):
    pod, _ = run_pod(cluster, "true", account="nobody")
    assert pod.phase == "Failed" and "nobody" in pod.events[-1]["message"]
    spec = {"containers": [{"name": "base", "image": "registry.example.com/unknown:1", "command": ["true"]}]}
    pod = cluster.create_pod({"metadata": {"name": "q", "namespace": "ns"}, "spec": spec})
    deadline = time.monotonic() + 10
    while pod.phase == "Pending" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pod.phase == "Failed" and "cannot be pulled" in pod.events[-1]["message"]
    assert Path(pod.directory).exists()
