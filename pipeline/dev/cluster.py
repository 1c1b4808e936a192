"""A small Kubernetes cluster on this machine, for the production rehearsal.

It speaks the part of the Kubernetes API that Airflow's cncf provider uses to run a pod (create,
read, list and patch pods, their logs and events, exec into a container, delete), so the provider's
own code renders every pod spec, ships every task script and reads every return value; only the
transport to a cluster is replaced. A pod is run as the spec states it: each container's command
and args, its env, its volume mounts, in a container of its own (pipeline.dev.container: private
mount and PID namespaces, a root filesystem holding the image's files and the pod's volumes only).

What stands in for what:
- images: named local file sets (this project, its virtualenv and Python) with their env and workdir;
- the nodes: labels, taints and capacity of a CPU node and a tainted 8-GPU node; a pod whose node
  selector, tolerations or requests fit neither is not scheduled (FailedScheduling), as on a cluster;
- volumes: a PersistentVolumeClaim, ConfigMap or Secret is a local directory that exists once the
  manifest declaring it is applied (`apply`); a pod mounting one that does not exist fails to start
  (FailedMount); emptyDir is a fresh directory (medium Memory: a tmpfs);
- IAM roles for service accounts: for a service account annotated with a role ARN, the pod gets the
  web-identity env and token file that EKS's webhook injects, so boto3 assumes the role through STS;
  no pod ever holds access keys. AWS's endpoints (S3, STS) are one local server, named to every pod by
  the standard AWS_ENDPOINT_URL variable.
The containers run on this machine's CPUs: a GPU request is scheduled against the node's capacity
but no GPU exists, so DeepSpeed in a "GPU" pod finds no CUDA and uses its CPU accelerator.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

log = logging.getLogger(__name__)

IRSA_ROLE_ANNOTATION = "eks.amazonaws.com/role-arn"
IRSA_TOKEN_DIR = "/var/run/secrets/eks.amazonaws.com/serviceaccount"
VOLUME_KINDS = {"persistentVolumeClaim": "pvc", "configMap": "configmap", "secret": "secret"}


class ClusterError(RuntimeError):
    """A pod spec or manifest the local cluster cannot run as stated."""


@dataclass(frozen=True)
class LocalImage:
    """What a container image holds here: its files (path in the container -> host path, read-only),
    paths among them that are this machine's state rather than the image's (masked), env and workdir."""

    files: dict[str, str]
    workdir: str
    env: dict[str, str]
    masked: tuple[str, ...] = ()


@dataclass(frozen=True)
class LocalNode:
    name: str
    labels: dict[str, str]
    taints: tuple[dict[str, str], ...]
    capacity: dict[str, str]


def _quantity(value: str) -> float:
    """A Kubernetes quantity ("96", "500m", "1600Gi", "64G") as a number."""
    text = str(value)
    binary = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50}
    decimal = {"m": 1e-3, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    for suffix, factor in binary.items():
        if text.endswith(suffix):
            return float(text[:-2]) * factor
    if text and text[-1] in decimal:
        return float(text[:-1]) * decimal[text[-1]]
    return float(text)


def scheduling_problems(spec: dict[str, Any], node: LocalNode) -> list[str]:
    """Why a pod spec would not be scheduled on the node (empty: it fits)."""
    problems = []
    for key, value in (spec.get("nodeSelector") or {}).items():
        if node.labels.get(key) != value:
            problems.append(f"node selector {key}={value} does not match the node ({node.labels.get(key)!r})")
    tolerations = spec.get("tolerations") or []
    for taint in node.taints:
        if not any(_tolerates(toleration, taint) for toleration in tolerations):
            problems.append(f"the node's taint {taint['key']}:{taint['effect']} is not tolerated")
    requested: dict[str, float] = {}
    for container in spec.get("containers", []):
        for name, value in ((container.get("resources") or {}).get("requests") or {}).items():
            requested[name] = requested.get(name, 0.0) + _quantity(value)
    for name, amount in requested.items():
        if amount > _quantity(node.capacity.get(name, "0")):
            problems.append(f"insufficient {name}: requests {amount:g}, the node has {node.capacity.get(name, 0)}")
    return problems


def _tolerates(toleration: dict[str, Any], taint: dict[str, str]) -> bool:
    if toleration.get("effect") not in (None, taint["effect"]):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return toleration.get("key") in (None, taint["key"])
    return toleration.get("key") == taint["key"] and toleration.get("value") == taint.get("value")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _timestamp(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ContainerRun:
    """One container process (its own namespaces) and its timestamped log."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], spec_path: Path, log_path: Path):
        self.name, self.env, self.log_path = name, env, log_path
        self.started_at = _now()
        self.finished_at: dt.datetime | None = None
        self.exit_code: int | None = None
        launcher_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path)}
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
             sys.executable, "-m", "pipeline.dev.container", str(spec_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=launcher_env,
            start_new_session=True)
        self.argv = argv
        self._log_thread = threading.Thread(target=self._copy_log, daemon=True)
        self._log_thread.start()

    def _copy_log(self) -> None:
        assert self.process.stdout is not None
        with open(self.log_path, "a", encoding="utf-8") as out:
            for raw in self.process.stdout:
                out.write(f"{_timestamp(_now())} {raw.decode('utf-8', errors='backslashreplace')}")
                out.flush()
        self.exit_code = self.process.wait()
        self.finished_at = _now()

    @property
    def running(self) -> bool:
        return self.finished_at is None

    def init_pid(self) -> int:
        """The host PID of the container's first process (the child `unshare` forked)."""
        for _ in range(200):
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
            if children.exists() and children.read_text().split():
                return int(children.read_text().split()[0])
            time.sleep(0.01)
        raise ClusterError(f"container {self.name} has no running process to exec into")

    def kill(self) -> None:
        if self.running:
            try:
                os.killpg(self.process.pid, 9)
            except ProcessLookupError:
                pass
        self._log_thread.join(timeout=10)


@dataclass
class LocalPod:
    manifest: dict[str, Any]
    directory: Path
    phase: str = "Pending"
    reason: str | None = None
    containers: dict[str, ContainerRun] = field(default_factory=dict)
    events: list[dict[str, str]] = field(default_factory=list)
    created_at: dt.datetime = field(default_factory=_now)
    node: str | None = None

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    def current_phase(self) -> str:
        if self.phase in ("Pending", "Failed") and not self.containers:
            return self.phase
        if any(run.running for run in self.containers.values()):
            return "Running"
        return "Succeeded" if all(run.exit_code == 0 for run in self.containers.values()) else "Failed"


class LocalCluster:
    """The node, its applied objects (namespaces, service accounts, volumes) and the pods it ran."""

    def __init__(self, workspace: Path, images: dict[str, LocalImage], nodes: tuple[LocalNode, ...],
                 aws_endpoint: str | None = None, region: str = "us-east-1"):
        self.workspace = Path(workspace)
        self.images, self.nodes = images, nodes
        self.aws_endpoint, self.region = aws_endpoint, region
        self.namespaces: set[str] = {"default"}
        self.service_accounts: dict[tuple[str, str], dict[str, str]] = {}
        self.applied: list[str] = []
        self.pods: dict[tuple[str, str], LocalPod] = {}
        self.history: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.core_v1 = LocalCoreV1Api(self)

    # -- objects ---------------------------------------------------------------------------------
    def volume_dir(self, kind: str, namespace: str, name: str) -> Path:
        return self.workspace / "volumes" / namespace / kind / name

    def apply(self, path: Path) -> list[str]:
        """Create what a manifest declares (`kubectl apply -f`): namespaces, service accounts, claims,
        config maps and secrets become local state; other kinds are recorded as applied."""
        created = []
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc:
                continue
            kind, meta = doc["kind"], doc.get("metadata", {})
            namespace, name = meta.get("namespace", "default"), meta["name"]
            if kind == "Namespace":
                self.namespaces.add(name)
            elif kind == "ServiceAccount":
                self.service_accounts[(namespace, name)] = dict(meta.get("annotations") or {})
            elif kind == "PersistentVolumeClaim":
                self.volume_dir("pvc", namespace, name).mkdir(parents=True, exist_ok=True)
            elif kind in ("ConfigMap", "Secret"):
                directory = self.volume_dir(kind.lower(), namespace, name)
                directory.mkdir(parents=True, exist_ok=True)
                for key, value in (doc.get("data") or doc.get("stringData") or {}).items():
                    (directory / key).write_text(value)
            created.append(f"{kind}/{namespace}/{name}")
        self.applied += created
        return created

    # -- pods ------------------------------------------------------------------------------------
    def create_pod(self, manifest: dict[str, Any]) -> LocalPod:
        meta = manifest["metadata"]
        namespace, name = meta.get("namespace", "default"), meta["name"]
        if namespace not in self.namespaces:
            raise ClusterError(f"namespace {namespace!r} does not exist (apply its manifest first)")
        with self.lock:
            if (namespace, name) in self.pods:
                raise ClusterError(f"pod {namespace}/{name} already exists")
            directory = self.workspace / "pods" / f"{namespace}-{name}"
            directory.mkdir(parents=True)
            pod = self.pods[(namespace, name)] = LocalPod(manifest, directory)
        self._record(pod, "created")
        threading.Thread(target=self._start, args=(pod,), daemon=True).start()
        return pod

    def _fail(self, pod: LocalPod, reason: str, message: str) -> None:
        pod.phase, pod.reason = "Failed", reason
        pod.events.append({"type": "Warning", "reason": reason, "message": message})
        log.warning("pod %s: %s: %s", pod.name, reason, message)

    def _start(self, pod: LocalPod) -> None:
        spec = pod.manifest["spec"]
        problems = {node.name: scheduling_problems(spec, node) for node in self.nodes}
        fitting = [name for name, found in problems.items() if not found]
        if not fitting:
            self._fail(pod, "FailedScheduling", f"0/{len(self.nodes)} nodes are available: " + "; ".join(
                f"{name}: {', '.join(found)}" for name, found in problems.items()))
            return
        pod.node = fitting[0]
        pod.events.append({"type": "Normal", "reason": "Scheduled", "message": f"assigned to node {pod.node}"})
        try:
            volumes = self._volumes(pod)
            for container in spec.get("initContainers") or []:
                run = self._run_container(pod, container, volumes)
                run._log_thread.join()
                if run.exit_code != 0:
                    self._fail(pod, "InitContainerFailed", f"{container['name']} exited {run.exit_code}")
                    return
            for container in spec["containers"]:
                pod.containers[container["name"]] = self._run_container(pod, container, volumes)
        except ClusterError as err:
            for run in pod.containers.values():
                run.kill()
            pod.containers.clear()
            self._fail(pod, "FailedMount" if "volume" in str(err) else "CreateContainerError", str(err))

    def _volumes(self, pod: LocalPod) -> dict[str, dict[str, Any]]:
        namespace = pod.manifest["metadata"].get("namespace", "default")
        volumes = {}
        for volume in pod.manifest["spec"].get("volumes") or []:
            name = volume["name"]
            if "emptyDir" in volume:
                empty = volume["emptyDir"] or {}
                source = pod.directory / "volumes" / name
                source.mkdir(parents=True)
                size = empty.get("sizeLimit")
                volumes[name] = {"source": str(source), "tmpfs": empty.get("medium") == "Memory",
                                 "size": str(int(_quantity(size))) if size else None}
                continue
            kind = next((VOLUME_KINDS[key] for key in VOLUME_KINDS if key in volume), None)
            if kind is None:
                raise ClusterError(f"volume {name}: only persistentVolumeClaim, configMap, secret and emptyDir "
                                   f"volumes run here, not {sorted(set(volume) - {'name'})}")
            source_spec = volume[next(key for key in VOLUME_KINDS if key in volume)]
            claim = source_spec.get("claimName") or source_spec.get("name") or source_spec.get("secretName")
            source = self.volume_dir(kind, namespace, claim)
            if not source.is_dir():
                raise ClusterError(f"volume {name}: {kind} {namespace}/{claim} does not exist")
            volumes[name] = {"source": str(source), "tmpfs": False,
                             "read_only": bool(source_spec.get("readOnly")) or kind != "pvc"}
        return volumes

    def _image(self, container: dict[str, Any]) -> LocalImage:
        reference = container.get("image")
        if reference not in self.images:
            raise ClusterError(f"image {reference!r} cannot be pulled here; known images: {sorted(self.images)}")
        return self.images[reference]

    def _identity(self, pod: LocalPod) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """The env and token volume that EKS's pod identity webhook adds for an IRSA service account."""
        namespace = pod.manifest["metadata"].get("namespace", "default")
        account = pod.manifest["spec"].get("serviceAccountName") or "default"
        annotations = self.service_accounts.get((namespace, account))
        if annotations is None and account != "default":
            raise ClusterError(f"service account {namespace}/{account} does not exist")
        role = (annotations or {}).get(IRSA_ROLE_ANNOTATION)
        if not role:
            return {}, []
        token = pod.directory / "identity"
        token.mkdir(exist_ok=True)
        (token / "token").write_text(f"local-web-identity-token-{namespace}-{account}")
        env = {"AWS_ROLE_ARN": role, "AWS_WEB_IDENTITY_TOKEN_FILE": f"{IRSA_TOKEN_DIR}/token",
               "AWS_ROLE_SESSION_NAME": pod.name, "AWS_STS_REGIONAL_ENDPOINTS": "regional",
               "AWS_REGION": self.region, "AWS_DEFAULT_REGION": self.region}
        return env, [{"source": str(token), "target": IRSA_TOKEN_DIR, "read_only": True}]

    def _run_container(self, pod: LocalPod, container: dict[str, Any], volumes: dict[str, dict[str, Any]]):
        image = self._image(container)
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        if not argv:
            raise ClusterError(f"container {container['name']}: no command (the local images have no entrypoint)")
        identity_env, identity_mounts = self._identity(pod)
        # AWS's public endpoints are the local S3 (and STS) server here
        aws = {"AWS_ENDPOINT_URL": self.aws_endpoint} if self.aws_endpoint else {}
        env = {**image.env, "HOSTNAME": pod.name, **aws, **identity_env}
        for variable in container.get("env") or []:
            if "value" not in variable:
                raise ClusterError(f"container {container['name']}: env {variable['name']} uses valueFrom, "
                                   "which the local cluster does not resolve")
            env[variable["name"]] = variable["value"] or ""
        mounts = list(identity_mounts)
        for mount in container.get("volumeMounts") or []:
            if mount["name"] not in volumes:
                raise ClusterError(f"container {container['name']} mounts volume {mount['name']!r}, "
                                   "which the pod does not declare")
            if mount.get("subPath"):
                raise ClusterError(f"volume {mount['name']}: subPath mounts are not supported here")
            volume = volumes[mount["name"]]
            mounts.append({**volume, "target": mount["mountPath"],
                           "read_only": bool(mount.get("readOnly")) or volume.get("read_only", False)})
        spec_path = pod.directory / f"{container['name']}.json"
        spec_path.write_text(json.dumps({
            "name": f"{pod.name}/{container['name']}", "rootfs": str(pod.directory / "rootfs" / container["name"]),
            "image_files": image.files, "masked": list(image.masked), "mounts": mounts,
            "workdir": container.get("workingDir") or image.workdir, "env": env, "argv": argv}))
        pod.events.append({"type": "Normal", "reason": "Started", "message": f"started container {container['name']}"})
        return ContainerRun(container["name"], argv, env, spec_path, pod.directory / f"{container['name']}.log")

    def delete_pod(self, namespace: str, name: str) -> None:
        pod = self.pods.pop((namespace, name), None)
        if pod is None:
            return
        self._record(pod, "deleted")  # before the kill: a server still running was not a failure
        for run in pod.containers.values():
            run.kill()
        shutil.rmtree(pod.directory / "rootfs", ignore_errors=True)

    def _record(self, pod: LocalPod, what: str) -> None:
        labels = pod.manifest["metadata"].get("labels") or {}
        base = pod.containers.get(pod.manifest["spec"]["containers"][0]["name"])
        self.history.append({"event": what, "pod": pod.name, "task_id": labels.get("task_id"),
                             "dag_id": labels.get("dag_id"), "node": pod.node,
                             "exit_code": base.exit_code if base else None,
                             "exit_codes": {name: run.exit_code for name, run in pod.containers.items()},
                             "image": pod.manifest["spec"]["containers"][0].get("image")})

    def shutdown(self) -> None:
        for namespace, name in list(self.pods):
            self.delete_pod(namespace, name)

    def pods_run(self) -> list[dict[str, Any]]:
        """One row per pod that was deleted after running, in order."""
        return [row for row in self.history if row["event"] == "deleted"]


class LogStream:
    """A container log as the API returns it with _preload_content=False: chunks of timestamped lines
    (following the file while the container runs)."""

    def __init__(self, run: ContainerRun | None, follow: bool, timestamps: bool, since_seconds: int | None):
        self.run, self.follow, self.timestamps = run, follow, timestamps
        self.since = _now() - dt.timedelta(seconds=since_seconds) if since_seconds else None

    def _lines(self) -> Iterator[str]:
        if self.run is None:
            return
        position = 0
        while True:
            finished = not self.run.running
            if self.run.log_path.exists():
                with open(self.run.log_path, encoding="utf-8") as handle:
                    handle.seek(position)
                    for line in iter(handle.readline, ""):
                        if not line.endswith("\n") and not finished:
                            break
                        position += len(line.encode("utf-8"))
                        yield line
            if finished or not self.follow:
                return
            time.sleep(0.2)

    def _kept(self, line: str) -> str | None:
        stamp, _, message = line.partition(" ")
        if self.since is not None and dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")) < self.since:
            return None
        return line if self.timestamps else message

    def stream(self, amt=None, decode_content=True) -> Iterator[bytes]:
        for line in self._lines():
            kept = self._kept(line)
            if kept is not None:
                yield kept.encode("utf-8")

    def __iter__(self) -> Iterator[bytes]:
        return self.stream()

    @property
    def data(self) -> bytes:
        return b"".join(self.stream())

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        pass


class ExecSession:
    """`kubectl exec` into a running container, shaped like the kubernetes client's WSClient."""

    def __init__(self, run: ContainerRun, command: list[str], stdin: bool):
        self.process = subprocess.Popen(
            ["nsenter", "--target", str(run.init_pid()), "--mount", "--pid", "--root", "--wd", "--", *command],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=run.env)
        self._out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [threading.Thread(target=self._read, args=(channel,), daemon=True)
                         for channel in self._out]
        for reader in self._readers:
            reader.start()

    def _read(self, channel: str) -> None:
        stream = getattr(self.process, channel)
        for raw in iter(lambda: stream.read1(65536), b""):
            self._out[channel].append(raw.decode("utf-8", errors="backslashreplace"))

    def is_open(self) -> bool:
        return self.process.poll() is None

    def update(self, timeout: float = 0) -> None:
        try:
            self.process.wait(timeout=min(timeout or 0.05, 1.0))
        except subprocess.TimeoutExpired:
            pass

    def run_forever(self, timeout: float | None = None) -> None:
        self.process.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=5)

    def _take(self, channel: str) -> str:
        data, self._out[channel] = "".join(self._out[channel]), []
        return data

    def peek_stdout(self, timeout: float = 0) -> bool:
        return bool(self._out["stdout"])

    def peek_stderr(self, timeout: float = 0) -> bool:
        return bool(self._out["stderr"])

    def read_stdout(self, timeout: float | None = None) -> str:
        return self._take("stdout")

    def read_stderr(self, timeout: float | None = None) -> str:
        return self._take("stderr")

    def read_all(self) -> str:
        return self._take("stdout")

    def write_stdin(self, data: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data.encode())
        self.process.stdin.flush()

    def close(self, **kwargs) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _label_selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class LocalCoreV1Api:
    """The CoreV1Api methods Airflow's pod operator and pod manager call, answered by the local cluster."""

    def __init__(self, cluster: LocalCluster):
        from kubernetes.client import ApiClient

        self.cluster = cluster
        self.api_client = ApiClient()

    def _model(self, data: Any, kind: str):
        class Response:  # the client's own deserializer takes an HTTP response
            def __init__(self, payload):
                self.data = json.dumps(payload, default=str)

        return self.api_client.deserialize(Response(data), kind)

    def _pod(self, namespace: str, name: str) -> LocalPod:
        from kubernetes.client.rest import ApiException

        pod = self.cluster.pods.get((namespace, name))
        if pod is None:
            raise ApiException(status=404, reason=f"pods {name!r} not found")
        return pod

    def _status(self, pod: LocalPod) -> dict[str, Any]:
        statuses = []
        for container in pod.manifest["spec"]["containers"]:
            run = pod.containers.get(container["name"])
            if run is None:
                continue
            state = ({"running": {"startedAt": _timestamp(run.started_at)}} if run.running else
                     {"terminated": {"exitCode": run.exit_code, "reason": "Completed" if run.exit_code == 0 else
                                     "Error", "startedAt": _timestamp(run.started_at),
                                     "finishedAt": _timestamp(run.finished_at)}})
            statuses.append({"name": container["name"], "image": container.get("image"), "imageID": "",
                             "ready": run.running, "restartCount": 0, "started": run.running, "state": state})
        status: dict[str, Any] = {"phase": pod.current_phase(), "startTime": _timestamp(pod.created_at),
                                  "conditions": [] if pod.reason == "FailedScheduling" else
                                  [{"type": "PodScheduled", "status": "True"}]}
        if pod.reason:
            status["reason"] = pod.reason
        if statuses:
            status["containerStatuses"] = statuses
        return status

    def _pod_model(self, pod: LocalPod):
        return self._model({**pod.manifest, "status": self._status(pod)}, "V1Pod")

    def create_namespaced_pod(self, namespace: str, body: Any, **kwargs):
        manifest = body if isinstance(body, dict) else self.api_client.sanitize_for_serialization(body)
        manifest = json.loads(json.dumps(manifest))
        manifest.setdefault("metadata", {}).setdefault("namespace", namespace)
        manifest["metadata"].setdefault("uid", str(uuid.uuid4()))
        return self._pod_model(self.cluster.create_pod(manifest))

    def read_namespaced_pod(self, name: str, namespace: str, **kwargs):
        return self._pod_model(self._pod(namespace, name))

    def list_namespaced_pod(self, namespace: str, label_selector: str | None = None, **kwargs):
        pods = [self._pod_model(pod) for (ns, _), pod in list(self.cluster.pods.items())
                if ns == namespace and _label_selector_matches(label_selector, pod.manifest["metadata"].get("labels")
                                                               or {})]
        return self._model({"items": [self.api_client.sanitize_for_serialization(p) for p in pods]}, "V1PodList")

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any], **kwargs):
        pod = self._pod(namespace, name)
        labels = (body.get("metadata") or {}).get("labels") or {}
        pod.manifest["metadata"].setdefault("labels", {}).update(labels)
        return self._pod_model(pod)

    def delete_namespaced_pod(self, name: str, namespace: str, **kwargs):
        self._pod(namespace, name)
        self.cluster.delete_pod(namespace, name)

    def read_namespaced_pod_log(self, name: str, namespace: str, container: str | None = None, follow: bool = False,
                                timestamps: bool = False, since_seconds: int | None = None, **kwargs):
        pod = self._pod(namespace, name)
        run = pod.containers.get(container or pod.manifest["spec"]["containers"][0]["name"])
        stream = LogStream(run, follow, timestamps, since_seconds)
        if kwargs.get("_preload_content", True):
            return stream.data.decode("utf-8")
        return stream

    def list_namespaced_event(self, namespace: str, field_selector: str | None = None, **kwargs):
        name = (field_selector or "").partition("involvedObject.name=")[2]
        pod = self.cluster.pods.get((namespace, name))
        items = [{"metadata": {"name": f"{name}.{i}", "uid": f"{name}-{i}", "resourceVersion": str(i)},
                  "involvedObject": {"kind": "Pod", "name": name, "namespace": namespace},
                  "reason": event["reason"], "message": event["message"], "type": event["type"]}
                 for i, event in enumerate(pod.events if pod else [])]
        return self._model({"items": items, "metadata": {}}, "CoreV1EventList")

    def connect_get_namespaced_pod_exec(self, name: str, namespace: str, container: str | None = None,
                                        command: list[str] | None = None, stdin: bool = False, **kwargs):
        pod = self._pod(namespace, name)
        run = pod.containers.get(container or pod.manifest["spec"]["containers"][0]["name"])
        if run is None or not run.running:
            raise ClusterError(f"container {container} of pod {name} is not running")
        return ExecSession(run, list(command or ["/bin/sh"]), stdin)


def use_local_cluster(cluster: LocalCluster) -> None:
    """Point Airflow's pod operator at the local cluster: its Kubernetes hook hands out the local API
    instead of a client for a cluster's API server. Everything above the client (pod specs, scripts,
    log following, XCom extraction, cleanup) is the provider's own code."""
    from functools import cached_property

    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from airflow.providers.cncf.kubernetes.operators import pod as pod_operator

    class LocalClusterHook(KubernetesHook):
        @cached_property
        def core_v1_client(self):
            return cluster.core_v1

        @cached_property
        def conn_extras(self):  # no kubernetes connection: the in-cluster defaults
            return {}

        @property
        def is_in_cluster(self) -> bool:
            return True

    pod_operator.KubernetesHook = LocalClusterHook
