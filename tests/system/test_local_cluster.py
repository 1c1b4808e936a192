"""The rehearsal's local cluster (harness/cluster.py): pods see only their env, their volumes and
the image's files; scheduling follows selectors, taints and capacity; volumes exist only when applied;
IAM roles for service accounts reach the pod as web-identity env, never as keys. Its API server
(harness/cluster_api.py) answers pods' service accounts over TLS as RBAC allows; StatefulSets scale
to pods that have their own addresses, resolve each other by name and are ready as their probes say; Indexed
Jobs run a pod per index that has its hostname, its fields and its peers' names, and fail or complete as
their pods do; torchrun's nodes meet in them."""

import ipaddress
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from harness.cluster import (
    ImageUser,
    LocalCluster,
    LocalImage,
    LocalNode,
    expand_variables,
    scheduling_problems,
)
from pipeline.ops.kube_api import KubernetesApi
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.usefixtures("root")

GPU_NODE = LocalNode(
    "gpu",
    {"nvidia.com/gpu.product": "NVIDIA-H200"},
    ({"key": "nvidia.com/gpu", "effect": "NoSchedule"},),
    {"cpu": "192", "memory": "2048Gi", "nvidia.com/gpu": "8"},
)
SHELL = LocalImage({}, "/", {"PATH": "/usr/bin:/bin"})


def gpu_pod(**spec):
    base = {
        "containers": [
            {
                "name": "base",
                "resources": {"requests": {"cpu": "96", "memory": "1600Gi", "nvidia.com/gpu": "8"}},
            }
        ]
    }
    return {**base, **spec}


def test_gpu_pods_schedule_only_where_selector_taint_and_capacity_fit():
    fits = gpu_pod(
        nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H200"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    assert scheduling_problems(fits, GPU_NODE) == []
    assert any("taint" in p for p in scheduling_problems(gpu_pod(), GPU_NODE))
    wrong = {**fits, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    assert any("node selector" in p for p in scheduling_problems(wrong, GPU_NODE))
    big = {**fits, "containers": [{"name": "base", "resources": {"requests": {"nvidia.com/gpu": "16"}}}]}
    assert any("insufficient nvidia.com/gpu" in p for p in scheduling_problems(big, GPU_NODE))


@pytest.fixture
def cluster(tmp_path):
    manifest = tmp_path / "objects.yaml"
    manifest.write_text(
        yaml.safe_dump_all(
            [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}},
                {
                    "apiVersion": "v1",
                    "kind": "ServiceAccount",
                    "metadata": {
                        "name": "writer",
                        "namespace": "ns",
                        "annotations": {
                            "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/writer"
                        },
                    },
                },
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "metadata": {"name": "data", "namespace": "ns"},
                    "spec": {"accessModes": ["ReadWriteMany"]},
                },
            ]
        )
    )
    local = LocalCluster(
        tmp_path / "cluster",
        {"shell": SHELL},
        (LocalNode("cpu", {}, (), {"cpu": "8", "memory": "16Gi", "ephemeral-storage": "100Gi"}),),
        aws_endpoint="http://127.0.0.1:9",
    )
    local.apply(manifest)
    yield local
    local.shutdown()


def run_pod(
    cluster, script: str, volumes=(), mounts=(), account=None, name="p", image="shell", **spec_fields
):
    spec = {
        "containers": [
            {"name": "base", "image": image, "command": ["sh", "-c", script], "volumeMounts": list(mounts)}
        ],
        "volumes": list(volumes),
        **spec_fields,
    }
    if account:
        spec["serviceAccountName"] = account
    pod = cluster.create_pod({"metadata": {"name": name, "namespace": "ns"}, "spec": spec})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        pod.phase == "Pending" and not pod.containers or any(run.running for run in pod.containers.values())
    ):
        time.sleep(0.1)
    logs = "".join(path.read_text() for path in pod.directory.glob("*.log"))
    return pod, logs


def test_a_pod_sees_its_volumes_and_not_this_machines_files(cluster, tmp_path):
    secret = tmp_path / "host-only.txt"
    secret.write_text("visible only on the host")
    (cluster.volume_dir("pvc", "ns", "data") / "shared.txt").write_text("on the volume")
    pod, logs = run_pod(
        cluster,
        f"cat /data/shared.txt && echo written > /data/out.txt && cat {secret}",
        volumes=[{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}],
        mounts=[{"name": "v", "mountPath": "/data"}],
    )
    assert "on the volume" in logs
    assert (cluster.volume_dir("pvc", "ns", "data") / "out.txt").read_text() == "written\n"
    # the host's file is not in the pod: reading a path it does not mount fails there
    assert (
        "No such file" in logs and pod.current_phase() == "Failed" and pod.containers["base"].exit_code != 0
    )


def test_a_container_runs_as_its_images_user_or_its_security_contexts_and_volumes_keep_their_modes(cluster):
    """The image's USER, with its home; a new volume is root's (0755), so that user cannot write it, while
    an emptyDir (0777) takes anyone's files; runAsUser over the image; runAsNonRoot refuses root."""
    cluster.images["app"] = LocalImage(
        {}, "/", {"PATH": "/usr/bin:/bin"}, user=ImageUser(50000, 0, "app", "/home/app")
    )
    volumes = [
        {"name": "v", "persistentVolumeClaim": {"claimName": "data"}},
        {"name": "scratch", "emptyDir": {}},
    ]
    mounts = [{"name": "v", "mountPath": "/data"}, {"name": "scratch", "mountPath": "/scratch"}]
    script = (
        'echo "who $(id -u):$(id -g) $HOME"; touch $HOME/own && echo home-written; '
        "touch /scratch/tmp && echo scratch-written; touch /data/new || echo volume-refused"
    )
    _, logs = run_pod(cluster, script, volumes, mounts, image="app", name="as-image-user")
    assert "who 50000:0 /home/app" in logs and "home-written" in logs and "scratch-written" in logs
    assert "volume-refused" in logs and not (cluster.volume_dir("pvc", "ns", "data") / "new").exists()
    root = {"securityContext": {"runAsUser": 0}}
    _, logs = run_pod(
        cluster,
        "id -u; touch /data/by-root && echo volume-written",
        volumes,
        mounts,
        image="app",
        name="as-root",
        **root,
    )
    assert (
        "volume-written" in logs and (cluster.volume_dir("pvc", "ns", "data") / "by-root").stat().st_uid == 0
    )
    refused, _ = run_pod(cluster, "true", name="refused", securityContext={"runAsNonRoot": True})
    assert refused.phase == "Failed" and refused.reason == "CreateContainerError"
    assert "runAsNonRoot" in refused.events[-1]["message"]


def test_a_pod_that_writes_past_its_local_storage_limits_is_evicted(cluster):
    """The kubelet's local-storage eviction: past the containers' ephemeral-storage limit (their writable
    layer and disk-backed emptyDirs together) or past an emptyDir's sizeLimit, the pod is killed and fails,
    reason Evicted; within them it runs to its end."""

    def write(name: str, where: str, megabytes: int, limit: str | None = None, size: str | None = None):
        script = f"head -c {megabytes * 2**20} /dev/zero > {where}/blob && sleep 4 && echo kept"
        pod = cluster.create_pod(
            {
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {
                    "containers": [
                        {
                            "name": "base",
                            "image": "shell",
                            "command": ["sh", "-c", script],
                            "resources": {"limits": {"ephemeral-storage": limit}} if limit else {},
                            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                        }
                    ],
                    "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": size} if size else {}}],
                },
            }
        )
        wait_for(lambda: pod.terminated(), timeout=60)
        return pod

    past_limit = write("past-limit", "/tmp", 3, limit="2Mi")
    past_size = write("past-size", "/scratch", 3, size="1Mi")
    within = write("within", "/scratch", 1, limit="4Mi", size="2Mi")
    for evicted in (past_limit, past_size):
        assert evicted.current_phase() == "Failed" and evicted.reason == "Evicted", evicted.events
        assert evicted.containers["base"].exit_code == 137
    assert "over its containers' limit" in past_limit.events[-1]["message"]
    assert "over its sizeLimit" in past_size.events[-1]["message"]
    assert within.current_phase() == "Succeeded" and within.reason is None


def test_a_node_short_of_disk_evicts_the_pod_furthest_past_its_storage_request(tmp_path):
    """Under node disk pressure (its pods holding more than its ephemeral-storage less the kubelet's 10%
    threshold) the pod past its ephemeral-storage request is evicted; the pod within its request runs on."""
    manifest = tmp_path / "ns.yaml"
    manifest.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: ns}\n")
    local = LocalCluster(
        tmp_path / "cluster",
        {"shell": SHELL},
        (LocalNode("small-disk", {}, (), {"cpu": "8", "ephemeral-storage": "40Mi"}),),
    )
    local.apply(manifest)

    def writer(name: str, megabytes: int, request: str | None):
        script = f"head -c {megabytes * 2**20} /dev/zero > /scratch/blob && sleep 6 && echo kept"
        resources = {"requests": {"ephemeral-storage": request}} if request else {}
        return local.create_pod(
            {
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {
                    "containers": [
                        {
                            "name": "base",
                            "image": "shell",
                            "command": ["sh", "-c", script],
                            "resources": resources,
                            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                        }
                    ],
                    "volumes": [{"name": "scratch", "emptyDir": {}}],
                },
            }
        )

    try:
        within = writer("within-request", 16, "20Mi")
        wait_for(lambda: within.running_since is not None, timeout=30)
        past = writer("no-request", 24, None)
        wait_for(lambda: within.terminated() and past.terminated(), timeout=60)
    finally:
        local.shutdown()
    assert past.current_phase() == "Failed" and past.reason == "Evicted", past.events
    assert "low on resource: ephemeral-storage" in past.events[-1]["message"]
    assert within.current_phase() == "Succeeded" and within.reason is None, within.events


def test_a_pod_starts_with_default_signals_even_when_the_cluster_was_started_ignoring_them(cluster):
    # a cluster started as a background job inherits SIGINT and SIGQUIT ignored; a container runtime starts
    # the pod's process with default dispositions, so the xcom sidecar's `trap "exit 0" INT` can end it
    ignored = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGQUIT)}
    try:
        pod, logs = run_pod(
            cluster,
            'trap "echo trapped; exit 0" INT; grep SigIgn /proc/self/status; '
            "kill -2 $$$$; sleep 5; echo untrapped",  # $$ is Kubernetes' escape for $
        )
    finally:
        for number, handler in ignored.items():
            signal.signal(number, handler)
    ignored_mask = int(logs.split("SigIgn:")[1].split()[0], 16)
    assert not ignored_mask & (1 << (signal.SIGINT - 1) | 1 << (signal.SIGQUIT - 1)), logs
    assert "trapped" in logs and "untrapped" not in logs and pod.current_phase() == "Succeeded", logs


def test_a_claim_nobody_applied_fails_the_pod_to_start(cluster):
    pod, _ = run_pod(
        cluster,
        "true",
        volumes=[{"name": "v", "persistentVolumeClaim": {"claimName": "missing"}}],
        mounts=[{"name": "v", "mountPath": "/data"}],
    )
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
    assert (
        "REHEARSAL_HOST_ONLY" not in env
        and "AWS_ACCESS_KEY_ID" not in env
        and "AWS_SECRET_ACCESS_KEY" not in env
    )
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


# -- the API server, service accounts, StatefulSets, readiness, pod addresses and DNS ------------------
PROJECT = REPO
PYTHON_HOME = str(Path(sys.base_prefix).resolve())
PYTHON = LocalImage(
    {str(PROJECT): str(PROJECT), PYTHON_HOME: PYTHON_HOME},
    "/",
    {"PATH": f"{PROJECT / '.venv' / 'bin'}:/usr/bin:/bin"},
)
# answers every GET with its pod's name, on the pod's own address
HELLO = """
import http.server, os
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = os.environ["HOSTNAME"].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((os.environ["DRAFTER_LOCAL_POD_IP"], 8080), Hello).serve_forever()
"""
WEB = [
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}},
    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "scaler", "namespace": "ns"}},
    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "stranger", "namespace": "ns"}},
    {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "ns"},
        "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8080}]},
    },
    {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "web", "namespace": "ns"},
        "spec": {
            "serviceName": "web",
            "replicas": 0,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "containers": [
                        {
                            "name": "server",
                            "image": "python",
                            "command": ["python", "-c", HELLO],
                            "readinessProbe": {
                                "httpGet": {"path": "/", "port": 8080},
                                "periodSeconds": 1,
                            },
                        }
                    ]
                },
            },
        },
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "web-scaler", "namespace": "ns"},
        "rules": [
            {
                "apiGroups": ["apps"],
                "resources": ["statefulsets", "statefulsets/scale"],
                "verbs": ["get", "patch"],
            }
        ],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "scaler", "namespace": "ns"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "web-scaler"},
        "subjects": [{"kind": "ServiceAccount", "name": "scaler", "namespace": "ns"}],
    },
]
SCALE = "/apis/apps/v1/namespaces/ns/statefulsets/web/scale"


@pytest.fixture
def api(tmp_path):
    manifest = tmp_path / "web.yaml"
    manifest.write_text(yaml.safe_dump_all(WEB))
    local = LocalCluster(
        tmp_path / "cluster",
        {"python": PYTHON},
        (LocalNode("cpu", {}, (), {"cpu": "8"}),),
        dns_propagation_s=2.0,
    )
    local.apply(manifest)
    local.start_api()
    yield local
    local.shutdown()


def call(cluster, path, token, method="GET", body=None, content_type="application/merge-patch+json"):
    headers = {"Authorization": f"Bearer {token}", "Content-Type": content_type}
    return requests.request(
        method,
        cluster.api.url + path,
        headers=headers,
        data=json.dumps(body) if body else None,
        verify=str(cluster.api.ca_file),
        timeout=10,
    )


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # reaped before or while /proc was read
        return True
    return state in ("Z", "X")


def test_the_api_answers_only_known_tokens_and_what_their_roles_grant(api):
    assert call(api, SCALE, "not-a-token").status_code == 401
    no_token = requests.get(api.api.url + SCALE, verify=str(api.api.ca_file), timeout=10)
    assert no_token.status_code == 401 and no_token.json()["reason"] == "Unauthorized"
    denied = call(api, SCALE, api.service_account_token("ns", "stranger"), "PATCH", {"spec": {"replicas": 1}})
    assert denied.status_code == 403 and denied.json()["kind"] == "Status"
    assert denied.json()["message"] == (
        'statefulsets.apps "web" is forbidden: User "system:serviceaccount:ns:stranger"'
        ' cannot patch resource "statefulsets/scale" in API group "apps" in the '
        'namespace "ns"'
    )
    scaler = api.service_account_token("ns", "scaler")
    assert call(api, SCALE, scaler).json() | {"status": None} == {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {"name": "web", "namespace": "ns"},
        "spec": {"replicas": 0},
        "status": None,
    }
    assert call(api, "/apis/apps/v1/namespaces/ns/statefulsets/nope/scale", scaler).status_code == 404
    assert call(api, "/apis/apps/v1/namespaces/default/statefulsets/web", scaler).status_code == 403
    assert call(api, SCALE, scaler, "PATCH", {"spec": {"replicas": 1}}, "application/json").status_code == 415
    assert call(api, SCALE, scaler, "PATCH", {"spec": {"replicas": -1}}).status_code == 422
    assert api.statefulset_status("ns", "web")["replicas"] == 0 and not api.pods  # nothing refused was done


def test_the_api_is_served_over_tls_that_verifies_only_against_the_served_ca(api):
    assert call(api, SCALE, "x").status_code == 401  # verified against ca.crt, for https://127.0.0.1:<port>
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(api.api.url + SCALE, timeout=10)  # this machine's CAs do not know it


def test_scaling_runs_ready_pods_that_resolve_each_other_and_scaling_down_removes_them(api):
    scaler = api.service_account_token("ns", "scaler")
    patched = call(api, SCALE, scaler, "PATCH", {"spec": {"replicas": 2}})
    assert patched.status_code == 200 and patched.json()["spec"]["replicas"] == 2
    statefulset = "/apis/apps/v1/namespaces/ns/statefulsets/web"
    wait_for(lambda: call(api, statefulset, scaler).json()["status"].get("readyReplicas") == 2)
    assert sorted(name for _, name in api.pods) == ["web-0", "web-1"]
    pod = api.core_v1.read_namespaced_pod("web-0", "ns")
    assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "True"
    assert pod.status.container_statuses[0].ready and ipaddress.ip_address(
        pod.status.pod_ip
    ) in ipaddress.ip_network(f"{api.network}/16")
    # a ready pod's record comes a little later (the Service does not publish not-ready addresses)
    assert api.address_of("web-0.web.ns.svc") is None
    wait_for(lambda: None not in {api.address_of(f"{name}.web.ns.svc") for name in ("web-0", "web-1")})
    addresses = {name: api.address_of(f"{name}.web.ns.svc") for name in ("web-0", "web-1")}
    assert len(set(addresses.values())) == 2 and pod.status.pod_ip == addresses["web-0"]
    # from inside web-0, through its /etc/hosts: web-1's own server, at web-1's own address
    session = api.core_v1.connect_get_namespaced_pod_exec(
        "web-0",
        "ns",
        command=[
            "python",
            "-c",
            "import socket, urllib.request; name = 'web-1.web.ns.svc'; print(socket.gethostname(),"
            " socket.gethostbyname(name), urllib.request.urlopen(f'http://{name}:8080/').read().decode())",
        ],
    )
    session.run_forever(timeout=30)
    assert session.read_stdout().split() == ["web-0", addresses["web-1"], "web-1"]
    pids = [run.init_pid() for p in list(api.pods.values()) for run in p.containers.values()]
    assert call(api, SCALE, scaler, "PATCH", {"spec": {"replicas": 0}}).status_code == 200
    wait_for(lambda: api.statefulset_status("ns", "web")["replicas"] == 0)
    assert all(gone(pid) for pid in pids) and api.address_of("web-1.web.ns.svc") is None
    assert "web-0" not in api.hosts_file.read_text()
    api.scale_statefulset("ns", "web", 1)  # and up again: web-0 anew
    wait_for(lambda: api.statefulset_status("ns", "web")["readyReplicas"] == 1)
    wait_for(lambda: "web-0.web.ns.svc" in api.hosts_file.read_text())


def test_a_pod_calls_the_api_as_its_service_account_and_can_opt_out(api):
    script = """
import os, requests
directory = "/var/run/secrets/kubernetes.io/serviceaccount"
if not os.path.exists(directory + "/token"):
    print("no token", os.environ.get("KUBERNETES_SERVICE_HOST"))
else:
    url = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
    token = open(directory + "/token").read()
    answer = requests.get(url + "/apis/apps/v1/namespaces/ns/statefulsets/web",
                          headers={"Authorization": "Bearer " + token}, verify=directory + "/ca.crt",
                          timeout=10)
    print(open(directory + "/namespace").read(), answer.status_code, answer.json()["status"]["replicas"])
"""
    outputs = []
    for name, extra in (("caller", {}), ("opted-out", {"automountServiceAccountToken": False})):
        pod = api.create_pod(
            {
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {
                    "serviceAccountName": "scaler",
                    **extra,
                    "containers": [{"name": "base", "image": "python", "command": ["python", "-c", script]}],
                },
            }
        )
        wait_for(lambda pod=pod: pod.current_phase() in ("Succeeded", "Failed"))
        outputs.append((pod.directory / "base.log").read_text().split(" ", 1)[1].strip())
    assert outputs == ["ns 200 0", "no token None"]


def test_a_pod_with_a_readiness_probe_is_ready_only_while_the_probe_answers(api):
    def pod(name, **container):
        spec = {"containers": [{"name": "base", "image": "python", "command": ["sleep", "30"], **container}]}
        return api.create_pod({"metadata": {"name": name, "namespace": "ns"}, "spec": spec})

    # a port nothing on this machine listens on (a pod of an earlier test may still be going away)
    port = free_port()
    unanswered = pod(
        "unanswered", readinessProbe={"httpGet": {"path": "/", "port": port}, "periodSeconds": 1}
    )
    unprobed = pod("unprobed")
    wait_for(lambda: unprobed.ready() and unanswered.current_phase() == "Running")
    time.sleep(1.5)  # the probe has asked at least once, and nothing listens at the pod's address
    status = api.core_v1.read_namespaced_pod("unanswered", "ns").status
    assert not unanswered.ready() and not status.container_statuses[0].ready
    assert {c.type: c.status for c in status.conditions}["Ready"] == "False"


SLOW_HELLO = HELLO.replace(
    "    def do_GET(self):\n", "    def do_GET(self):\n        import time; time.sleep(1.3)\n"
)


def test_a_probe_is_timed_as_the_kubelet_times_it(api):
    """An answer later than timeoutSeconds (default 1 s) is a failure however often it comes; the pod is
    ready only once a probe with room for the answer has run, no sooner than initialDelaySeconds."""

    def pod(name, **probe):
        container = {"name": "base", "image": "python", "command": ["python", "-c", SLOW_HELLO]}
        container["readinessProbe"] = {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1, **probe}
        spec = {"containers": [container]}
        return api.create_pod({"metadata": {"name": name, "namespace": "ns"}, "spec": spec})

    defaults, patient = pod("defaults"), pod("patient", timeoutSeconds=5, initialDelaySeconds=4)
    started = time.monotonic()
    wait_for(patient.ready, timeout=60)
    assert time.monotonic() - started >= 4  # not before initialDelaySeconds
    assert defaults.current_phase() == "Running" and not defaults.ready()  # it answers each GET 1.3 s late


# -- Indexed Jobs: the multi-node trainer's pods, their env, hostnames and names --------------------------
JOBS = "/apis/batch/v1/namespaces/ns/jobs"
LAUNCHER = [
    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "launcher", "namespace": "ns"}},
    {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "workers", "namespace": "ns"},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "workers"}},
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "job-launcher", "namespace": "ns"},
        "rules": [
            {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "patch", "delete"]}
        ],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "launcher", "namespace": "ns"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "job-launcher"},
        "subjects": [{"kind": "ServiceAccount", "name": "launcher", "namespace": "ns"}],
    },
]


@pytest.fixture
def batch(api, tmp_path):
    manifest = tmp_path / "launcher.yaml"
    manifest.write_text(yaml.safe_dump_all(LAUNCHER))
    api.apply(manifest)
    return api


def indexed_job(
    name: str, command: list[str], args: list[str] = (), env: list[dict] = (), backoff_limit: int = 6
) -> dict:
    """An Indexed Job of two pods under the headless Service workers, annotated drafter/run-id: run-7."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": backoff_limit,
            "template": {
                "metadata": {"labels": {"app": "workers"}, "annotations": {"drafter/run-id": "run-7"}},
                "spec": {
                    "subdomain": "workers",
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "node",
                            "image": "python",
                            "command": command,
                            "args": list(args),
                            "env": list(env),
                        }
                    ],
                },
            },
        },
    }


def last_line(pod) -> str:
    return (pod.directory / "node.log").read_text().strip().splitlines()[-1].split(" ", 1)[1]


def running(pod) -> bool:
    return "node" in pod.containers and pod.containers["node"].running


def running_pods(cluster, job: str, count: int) -> list:
    wait_for(lambda: len(pods := cluster.job_pods("ns", job)) == count and all(map(running, pods)))
    return cluster.job_pods("ns", job)


def test_expansion_follows_kubernetes_rules():
    defined = {"A": "x", "B": "$(A)"}
    assert [
        expand_variables(text, defined)
        for text in ("$(A)-$(B)", "$$(A)", "$$$(A)", "$(C)", "$(A", "$A $", "$$", "a$(A)b", "$()")
    ] == ["x-$(A)", "$(A)", "$x", "$(C)", "$(A", "$A $", "$", "axb", "$()"]


# what each pod reports: its index, hostname and the address it resolves to, fields, expanded args; pod 0
# waits on its own address for pod 1, which reaches it by its DNS name
REPORT = """
import json, os, socket, sys, time
index, port = int(os.environ["JOB_COMPLETION_INDEX"]), int(os.environ["PORT"])
seen = {"index": index, "hostname": socket.gethostname(), "own": socket.gethostbyname(socket.gethostname()),
        "argv": sys.argv[1:],
        **{key: os.environ[key] for key in ("RUN_ID", "POD_NAME", "TAGGED", "LABEL", "NODE")}}
if index == 0:
    with socket.create_server((os.environ["DRAFTER_LOCAL_POD_IP"], port)) as server:
        server.accept()[0].close()
else:  # pod 0's name resolves only once cluster DNS lists it: retried, as a real client retries
    for _ in range(600):
        try:
            seen["peer"] = socket.gethostbyname("work-0.workers")
            socket.create_connection(("work-0.workers", port), timeout=5).close()
            break
        except (socket.gaierror, ConnectionRefusedError):
            time.sleep(0.1)
print(json.dumps(seen))
"""


def test_an_indexed_job_runs_a_pod_per_index_that_knows_its_index_name_and_fields(batch):
    def field(path):
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = [
        {"name": "PORT", "value": str(free_port())},
        {"name": "RUN_ID", **field("metadata.annotations['drafter/run-id']")},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "TAGGED", "value": "run=$(RUN_ID)"},
        {"name": "LABEL", **field("metadata.labels['batch.kubernetes.io/job-completion-index']")},
        {"name": "NODE", **field("spec.nodeName")},
    ]
    job = indexed_job(
        "work", ["python", "-c", REPORT], ["$(RUN_ID)", "$$(RUN_ID)", "$(UNDEFINED)", "$(POD_NAME)-x"], env
    )
    created = call(
        batch, JOBS, batch.service_account_token("ns", "launcher"), "POST", job, "application/json"
    )
    assert created.status_code == 201 and created.json()["metadata"]["uid"]
    launcher = batch.service_account_token("ns", "launcher")
    wait_for(lambda: "conditions" in call(batch, f"{JOBS}/work", launcher).json()["status"])
    status = call(batch, f"{JOBS}/work", launcher).json()["status"]
    assert status["conditions"][0]["type"] == "Complete" and status["conditions"][0]["status"] == "True"
    assert status["succeeded"] == 2 and "active" not in status and "failed" not in status
    assert status["completionTime"] >= status["startTime"]
    pods = batch.job_pods("ns", "work")
    seen = [json.loads(last_line(pod)) for pod in pods]
    for index, (pod, report) in enumerate(zip(pods, seen, strict=True)):
        assert re.fullmatch(rf"work-{index}-[a-z]{{5}}", pod.name)
        assert pod.manifest["metadata"]["labels"]["batch.kubernetes.io/job-name"] == "work"
        assert pod.manifest["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == str(
            index
        )
        assert report | {"peer": None} == {
            "index": index,
            "hostname": f"work-{index}",
            "own": pod.ip,
            "RUN_ID": "run-7",
            "POD_NAME": pod.name,
            "TAGGED": "run=run-7",
            "LABEL": str(index),
            "NODE": "cpu",
            "peer": None,
            "argv": ["run-7", "$(RUN_ID)", "$(UNDEFINED)", f"{pod.name}-x"],
        }
    assert seen[1]["peer"] == pods[0].ip != pods[1].ip
    assert "work-0" not in batch.hosts_file.read_text()  # terminated pods have no DNS name


def test_a_job_replaces_a_lost_pod_until_its_backoff_limit_then_fails_and_stops_its_other_pods(batch):
    job = batch.create_job(indexed_job("lossy", ["sleep", "60"], backoff_limit=1))
    first, other = running_pods(batch, "lossy", 2)
    batch.kill_pod("ns", first.name)  # a lost node: one failure, within the backoff limit
    wait_for(lambda: len(batch.job_pods("ns", "lossy")) == 3)
    assert first.current_phase() == "Failed" and first.containers["node"].exit_code == 137
    replaced = batch.job_pods("ns", "lossy")[1]
    wait_for(lambda: running(replaced))
    assert replaced.name != first.name and replaced.hostname == "lossy-0" and job.condition is None
    pid = other.containers["node"].init_pid()
    batch.kill_pod("ns", replaced.name)  # a second failure: more than backoffLimit
    wait_for(lambda: job.condition is not None)
    assert job.condition["type"] == "Failed" and job.condition["reason"] == "BackoffLimitExceeded"
    wait_for(lambda: gone(pid))
    assert ("ns", other.name) not in batch.pods and ("ns", first.name) in batch.pods
    assert (
        job.status()["failed"] == 3 and "completionTime" not in job.status() and "active" not in job.status()
    )


def test_the_api_creates_jobs_as_rbac_allows_refuses_duplicates_and_deletes_them_with_their_pods(
    batch, tmp_path
):
    job = indexed_job("held", ["sleep", "60"])
    denied = call(batch, JOBS, batch.service_account_token("ns", "stranger"), "POST", job, "application/json")
    assert denied.status_code == 403 and denied.json()["message"] == (
        'jobs.batch is forbidden: User "system:serviceaccount:ns:stranger" cannot create resource "jobs" '
        'in API group "batch" in the namespace "ns"'
    )
    launcher = batch.service_account_token("ns", "launcher")
    not_indexed = {**job, "spec": {**job["spec"], "completionMode": "NonIndexed"}}
    assert call(batch, JOBS, launcher, "POST", not_indexed, "application/json").status_code == 422
    assert not batch.jobs
    assert call(batch, JOBS, launcher, "POST", job, "application/json").status_code == 201
    duplicate = call(batch, JOBS, launcher, "POST", job, "application/json")
    assert duplicate.status_code == 409 and duplicate.json()["reason"] == "AlreadyExists"
    pids = [pod.containers["node"].init_pid() for pod in running_pods(batch, "held", 2)]
    token = tmp_path / "token"
    token.write_text(launcher)
    client = KubernetesApi(batch.api.url, token, batch.api.ca_file)  # the train task's client
    assert client.create_job("ns", job) is False and client.read_job("ns", "held")["status"]["active"] == 2
    client.delete_job("ns", "held")  # propagationPolicy Background
    assert call(batch, f"{JOBS}/held", launcher).status_code == 404
    assert batch.job_pods("ns", "held") == [] and all(gone(pid) for pid in pids)
    deleted = call(batch, f"{JOBS}/held", launcher, "DELETE")
    assert deleted.status_code == 404 and deleted.json()["reason"] == "NotFound"
    # without a propagationPolicy a Job's pods are orphaned: they run on
    assert call(batch, JOBS, launcher, "POST", job, "application/json").status_code == 201
    orphans = running_pods(batch, "held", 2)
    deleted = call(batch, f"{JOBS}/held", launcher, "DELETE")
    assert deleted.status_code == 200 and deleted.json()["details"]["kind"] == "jobs" and not batch.jobs
    assert batch.job_pods("ns", "held") == orphans and all(map(running, orphans))


# every rank adds rank + 1: with two nodes of one rank each, 1 + 2
ALL_REDUCE = """
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(total)
print("all_reduce", socket.gethostname(), os.environ["RANK"], total.item(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize(
    ("endpoint", "outcome", "timeout_s"),
    [("train-0.workers.ns.svc.cluster.local", "Complete", 60), ("train-0.workers", "Failed", 10)],
    ids=["full-name", "short-name"],
)
def test_torchrun_nodes_of_a_job_meet_at_pod_0_by_its_full_name(batch, endpoint, outcome, timeout_s):
    """c10d makes the node whose own full name (its /etc/hosts, as the kubelet writes it) or address is the
    endpoint's the host of its store. Pod 0 knows itself by its full name at once; by the short name it
    must ask the cluster's DNS, which lists it only seconds after it runs: then no node hosts the store and
    every node waits out the rendezvous timeout (pytorch/pytorch#73682)."""
    # DNS lists pod 0 later than its torchrun decides whether it hosts the store, even on a busy machine, and
    # sooner than the full name's join timeout: pod 1 waits for the record, as on a cluster
    batch.dns_propagation_s = 20.0
    port = free_port()
    args = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{endpoint}:{port}",
        "--rdzv-id",
        "$(RUN_ID)",
        "--rdzv-conf",
        f"join_timeout={timeout_s},read_timeout={timeout_s}",
        "--no-python",
        "python",
        "-c",
        ALL_REDUCE,
    ]
    env = [
        {"name": "RUN_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['drafter/run-id']"}}}
    ]
    job = batch.create_job(
        indexed_job("train", ["python", "-m", "torch.distributed.run"], args, env, backoff_limit=0)
    )
    wait_for(lambda: job.condition is not None, timeout=120)
    logs = {pod.hostname: (pod.directory / "node.log").read_text() for pod in batch.job_pods("ns", "train")}
    assert job.condition["type"] == outcome, logs
    if outcome == "Failed":
        return
    results = sorted(
        line.split()[1:]
        for text in logs.values()
        for line in text.splitlines()
        if line.split()[1:2] == ["all_reduce"]
    )
    assert [(host, total) for _, host, _, total in results] == [("train-0", "3.0"), ("train-1", "3.0")]


def test_clusters_side_by_side_hold_network_blocks_of_their_own_until_shut_down(tmp_path):
    """Two live clusters never hand out the same pod address; a shut-down cluster's block is free again."""
    import fcntl

    from harness.cluster import NETWORK_LOCKS

    node = (LocalNode("cpu", {}, (), {"cpu": "8"}),)
    first = LocalCluster(tmp_path / "first", {"python": PYTHON}, node)
    second = LocalCluster(tmp_path / "second", {"python": PYTHON}, node)
    try:
        blocks = [ipaddress.ip_network(f"{cluster.network}/16") for cluster in (first, second)]
        assert not blocks[0].overlaps(blocks[1])
        lock = NETWORK_LOCKS / f"{second.network.packed[1]}.lock"
        with open(lock) as held:
            with pytest.raises(BlockingIOError):
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        second.shutdown()
        with open(lock) as freed:
            fcntl.flock(freed, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other holder: the block is free
    finally:
        second.shutdown()
        first.shutdown()


GPU_TOLERATION = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def serving_deployment(replicas: int, init_script: str, rolling=None) -> dict:
    """A Deployment of GPU pods as infra/k8s/sglang-serve.yaml makes them: an init container first (there,
    the pull of `production`), then a long-running server, each pod requesting a whole node's GPUs."""
    spec = gpu_pod(
        nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H200"},
        tolerations=GPU_TOLERATION,
        initContainers=[{"name": "pull", "image": "shell", "command": ["sh", "-c", init_script]}],
    )
    spec["containers"][0].update(image="shell", command=["sh", "-c", "exec sleep 600"])
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "serve", "namespace": "ns"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "serve"}},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": rolling or {"maxSurge": 0, "maxUnavailable": 1},
            },
            "template": {"metadata": {"labels": {"app": "serve"}}, "spec": spec},
        },
    }


@pytest.fixture
def gpu_cluster(tmp_path):
    namespace = tmp_path / "ns.yaml"
    namespace.write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}})
    )
    local = LocalCluster(tmp_path / "cluster", {"shell": SHELL}, (GPU_NODE,), crash_backoff_s=0.2)
    local.apply(namespace)
    yield local
    local.shutdown()


def apply_doc(cluster, tmp_path, doc, name="doc.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return cluster.apply(path)


def test_a_deployment_whose_init_container_fails_holds_its_gpus_and_leaves_other_gpu_pods_pending(
    gpu_cluster, tmp_path
):
    """An applied Deployment creates its pods; an init container that keeps failing (serving's pull before
    anything is promoted) restarts with back-off while its pod stays Pending on its node, holding all 8
    GPUs, so a capture server created after it is not scheduled until the Deployment is gone."""
    apply_doc(gpu_cluster, tmp_path, serving_deployment(1, "exit 1"))
    wait_for(lambda: len(gpu_cluster.deployment_pods("ns", "serve")) == 1)
    serving = gpu_cluster.deployment_pods("ns", "serve")[0]
    assert serving.name.startswith("serve-") and serving.manifest["metadata"]["labels"]["app"] == "serve"
    wait_for(lambda: serving.init_restarts.get("pull", 0) >= 2)
    assert serving.current_phase() == "Pending" and serving.node == "gpu"
    assert gpu_cluster.gpus_held() == {"gpu": 8.0}
    assert any(event["reason"] == "BackOff" for event in serving.events)

    capture = gpu_cluster.create_pod(
        {
            "metadata": {"name": "capture-0", "namespace": "ns"},
            "spec": {
                **gpu_pod(nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H200"}, tolerations=GPU_TOLERATION),
                "restartPolicy": "Never",
            }
            | {"containers": [{**gpu_pod()["containers"][0], "image": "shell", "command": ["sleep", "600"]}]},
        }
    )
    wait_for(lambda: any(event["reason"] == "FailedScheduling" for event in capture.events))
    scheduled = gpu_cluster.core_v1._status(capture)["conditions"]
    assert capture.node is None and scheduled == [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    ]
    assert "insufficient nvidia.com/gpu: requests 8, 0 of 8 free" in capture.events[-1]["message"]

    apply_doc(gpu_cluster, tmp_path, serving_deployment(0, "exit 1"))  # scaled to 0: its pod goes
    wait_for(lambda: capture.node == "gpu" and capture.current_phase() == "Running")
    assert not gpu_cluster.deployment_pods("ns", "serve")


def test_a_rollout_restart_replaces_one_replica_at_a_time_in_place(tmp_path):
    """maxSurge 0, maxUnavailable 1 (infra/k8s/sglang-serve.yaml): never more pods than replicas, so two
    8-GPU replicas on two nodes roll without a third node; a failed pod is replaced."""
    two_nodes = (GPU_NODE, LocalNode("gpu-b", GPU_NODE.labels, GPU_NODE.taints, GPU_NODE.capacity))
    cluster = LocalCluster(tmp_path / "cluster", {"shell": SHELL}, two_nodes, crash_backoff_s=0.2)
    try:
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}
        apply_doc(cluster, tmp_path, namespace, "ns.yaml")
        apply_doc(cluster, tmp_path, serving_deployment(2, "true"))
        wait_for(lambda: sum(pod.ready() for pod in cluster.deployment_pods("ns", "serve")) == 2)
        before = {pod.name for pod in cluster.deployment_pods("ns", "serve")}
        assert {pod.node for pod in cluster.deployment_pods("ns", "serve")} == {"gpu", "gpu-b"}
        most = [0]

        def rolled() -> bool:
            pods = cluster.deployment_pods("ns", "serve")
            most[0] = max(most[0], len(pods))
            return len(pods) == 2 and all(pod.ready() for pod in pods) and not before & {p.name for p in pods}

        new_hash = cluster.rollout_restart("ns", "serve")
        wait_for(rolled, timeout=60)
        assert most[0] == 2
        assert {
            pod.manifest["metadata"]["labels"]["pod-template-hash"]
            for pod in cluster.deployment_pods("ns", "serve")
        } == {new_hash}

        lost = cluster.deployment_pods("ns", "serve")[0]
        cluster.kill_pod("ns", lost.name)
        wait_for(
            lambda: (
                len(cluster.deployment_pods("ns", "serve")) == 2
                and lost not in cluster.deployment_pods("ns", "serve")
            )
        )
    finally:
        cluster.shutdown()


def test_set_env_pins_what_the_init_container_pulls_and_a_recreated_pod_keeps_the_pin(gpu_cluster, tmp_path):
    """`kubectl set env -c pull-drafter DRAFTER_VERSION=...` (docs/RUNBOOK.md §2.6): the init container's
    env in the template, rolled out; a pod that is lost later is recreated from the same template, so it
    pulls the pinned version whatever was promoted since. Unpinned, the pod fails its init container."""
    from harness.cluster import ClusterError

    doc = serving_deployment(1, 'test -n "$DRAFTER_VERSION"')
    doc["spec"]["template"]["spec"]["initContainers"][0]["env"] = [{"name": "DRAFTER_VERSION", "value": ""}]
    apply_doc(gpu_cluster, tmp_path, doc)
    wait_for(lambda: any(pod.init_restarts for pod in gpu_cluster.deployment_pods("ns", "serve")))

    def pinned_pods() -> list:
        return [
            pod
            for pod in gpu_cluster.deployment_pods("ns", "serve")
            if pod.manifest["metadata"]["labels"]["pod-template-hash"] == pinned and pod.ready()
        ]

    pinned = gpu_cluster.set_env("ns", "serve", "pull", {"DRAFTER_VERSION": "v0002"})
    wait_for(lambda: len(pinned_pods()) == 1 and len(gpu_cluster.deployment_pods("ns", "serve")) == 1)
    first = pinned_pods()[0]
    assert first.manifest["spec"]["initContainers"][0]["env"] == [
        {"name": "DRAFTER_VERSION", "value": "v0002"}
    ]
    assert gpu_cluster.set_env("ns", "serve", "pull", {"DRAFTER_VERSION": "v0002"}) == pinned  # nothing rolls

    gpu_cluster.delete_pod("ns", first.name)  # a drain's eviction
    wait_for(lambda: len(pinned_pods()) == 1 and first not in pinned_pods())
    again = pinned_pods()[0]
    assert again.manifest["spec"]["initContainers"][0]["env"] == [
        {"name": "DRAFTER_VERSION", "value": "v0002"}
    ]
    with pytest.raises(ClusterError, match="no container named 'pul'"):
        gpu_cluster.set_env("ns", "serve", "pul", {"DRAFTER_VERSION": "v0003"})


def test_a_job_owned_by_its_task_pod_goes_with_it_unless_disowned_and_stops_at_its_deadline(batch, tmp_path):
    """The trainer Job (pipeline.training.nodes): owned by the train task's pod, it is deleted with its pods,
    in the background, once that pod is deleted (the task killed); one its task disowned (a failed Job kept
    for its logs) stays; one naming an owner that does not exist is collected at once, as the garbage
    collector does; and one active past activeDeadlineSeconds fails and stops its pods."""
    from pipeline.task_pod import TASK_POD_NAME_ENV, TASK_POD_UID_ENV, task_pod_owner

    launcher = batch.service_account_token("ns", "launcher")
    token = tmp_path / "token"
    token.write_text(launcher)
    client = KubernetesApi(batch.api.url, token, batch.api.ca_file)
    task = batch.create_pod(
        {
            "metadata": {"name": "task", "namespace": "ns"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "base", "image": "python", "command": ["sleep", "600"]}],
            },
        }
    )
    wait_for(lambda: "base" in task.containers)
    owner = task_pod_owner({TASK_POD_NAME_ENV: "task", TASK_POD_UID_ENV: task.manifest["metadata"]["uid"]})

    def owned(name: str, by: dict) -> dict:
        job = indexed_job(name, ["sleep", "60"])
        job["metadata"]["ownerReferences"] = [by]
        return job

    assert client.create_job("ns", owned("owned", owner)) and client.create_job("ns", owned("kept", owner))
    pids = [pod.containers["node"].init_pid() for pod in running_pods(batch, "owned", 2)]
    client.set_job_owners("ns", "kept", None)
    assert "ownerReferences" not in client.read_job("ns", "kept")["metadata"]
    refused = call(batch, f"{JOBS}/kept", launcher, "PATCH", {"spec": {"parallelism": 1}})
    assert refused.status_code == 422 and "only metadata.ownerReferences" in refused.json()["message"]
    assert client.create_job("ns", owned("stray", {**owner, "uid": "another-pods-uid"}))
    wait_for(lambda: ("ns", "stray") not in batch.jobs and not batch.job_pods("ns", "stray"))

    batch.delete_pod("ns", "task")  # the task killed: its pod deleted
    wait_for(lambda: ("ns", "owned") not in batch.jobs and not batch.job_pods("ns", "owned"))
    assert all(gone(pid) for pid in pids)
    assert client.read_job("ns", "kept")["status"]["active"] == 2  # disowned: nothing collects it
    client.delete_job("ns", "kept")

    timed = indexed_job("timed", ["sleep", "60"])
    timed["spec"]["activeDeadlineSeconds"] = 1
    assert client.create_job("ns", timed)
    pids = [pod.containers["node"].init_pid() for pod in running_pods(batch, "timed", 2)]
    wait_for(lambda: "conditions" in client.read_job("ns", "timed")["status"])
    status = client.read_job("ns", "timed")["status"]
    assert [(c["type"], c["reason"]) for c in status["conditions"]] == [("Failed", "DeadlineExceeded")]
    assert "active" not in status and status["failed"] == 2
    wait_for(lambda: not batch.job_pods("ns", "timed") and all(gone(pid) for pid in pids))
