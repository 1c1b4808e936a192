"""A small Kubernetes cluster on this machine, for the production rehearsal.

It speaks the part of the Kubernetes API that Airflow's cncf provider uses to run a pod (create,
read, list and patch pods, their logs and events, exec into a container, delete), so the provider's
own code renders every pod spec, ships every task script and reads every return value; only the
transport to a cluster is replaced. A pod is run as the spec states it: each container's command
and args (`$(NAME)` expanded from its env, as Kubernetes expands it), its env (values, and fieldRefs of
the downward API: metadata.name, metadata.namespace, metadata.uid, metadata.annotations['KEY'],
metadata.labels['KEY'], status.podIP, spec.nodeName, spec.serviceAccountName), its volume mounts, in a
container of its own (harness.container: private mount, UTS and PID namespaces, a root filesystem holding
the image's files and the pod's volumes only, and the pod's hostname: spec.hostname, else its name).

What stands in for what:
- images: named local file sets with their env, workdir and user (the rehearsal's: each as its Dockerfile
  builds it, harness/image_build);
- the nodes: labels, taints and capacity (the rehearsal's: a CPU node and tainted 8-GPU nodes). A pod is
  bound to the first node whose selector and taints it fits and whose capacity holds its requests
  (pod_requests: a limit stands for a missing request; init containers count) beside those of every pod
  already bound there and not terminated: a pod holds what it requests from binding on, whatever it
  does. One that fits only once others go stays Pending, unbound (a FailedScheduling event), until they
  do; one that no node could hold even empty fails at once (FailedScheduling), where a cluster would
  keep it Pending;
- Deployments (apps/v1): applying one runs `replicas` pods of its template, `<name>-<template hash>-<5
  random>` owned by the ReplicaSet `<name>-<template hash>`, and replaces any that terminates. A new
  template (`rollout_restart`, `set_env`, a re-apply) rolls out as its strategy says: RollingUpdate within
  maxSurge / maxUnavailable (25% each by default), or Recreate. An init container that fails is run again
  after a back-off doubling from 10 s to 300 s (Init:CrashLoopBackOff) in a pod whose restartPolicy is
  not Never, the pod Pending and holding its requests meanwhile; main containers are not restarted;
- volumes: a PersistentVolumeClaim, ConfigMap or Secret is a local directory that exists once the
  manifest declaring it is applied (`apply`), owned by root with mode 0755 as a new filesystem is; a
  pod mounting one that does not exist fails to start (FailedMount); emptyDir is a fresh directory of
  mode 0777, as the kubelet makes it (medium Memory: a tmpfs). fsGroup is a supplementary group of the
  pod's processes but changes no volume's ownership: the CSI drivers of the shared ReadWriteMany
  volumes (EFS, FSx for Lustre) do not apply it;
- users: each container runs as its image's USER (`LocalImage.user`, from its Dockerfile), or as its
  securityContext's runAsUser / runAsGroup, container over pod (`run_as`); runAsNonRoot refuses root.
  Files it writes are that user's, and the kernel decides what it may read and write;
- IAM roles for service accounts: for a service account annotated with a role ARN, the pod gets the
  web-identity env and token file that EKS's webhook injects, so boto3 assumes the role through STS;
  no pod ever holds access keys. AWS's endpoints (S3, STS) are one local server, named to every pod by
  the standard AWS_ENDPOINT_URL variable.
- the API server, for clients inside pods (`start_api`, harness.cluster_api): HTTPS on 127.0.0.1 with
  a certificate made at start. Every pod created after it started gets, as on a cluster, its service
  account's token (random, one per account; the namespace's `default` account always exists), ca.crt and
  namespace read-only at /var/run/secrets/kubernetes.io/serviceaccount and KUBERNETES_SERVICE_HOST,
  KUBERNETES_SERVICE_PORT and KUBERNETES_SERVICE_PORT_HTTPS naming the server (none of it when the pod
  spec sets automountServiceAccountToken: false). Requests are authorized by the applied Roles,
  ClusterRoles and RoleBindings, default deny;
- StatefulSets and their headless Services: applying one, or scaling it through the API, runs its pods
  `<name>-0` .. `<name>-(replicas-1)` from its template (hostname the pod name, subdomain its
  serviceName) and deletes those at or above replicas, highest first, all at once as with
  podManagementPolicy Parallel; a changed template reaches only pods created after it, a failed pod
  stays failed (nothing restarts). A container's readinessProbe.httpGet is probed at the pod's address
  with the probe's own timing, Kubernetes' defaults where it sets none (ProbeTiming: a GET unanswered
  within timeoutSeconds, default 1 s, fails), and makes the pod ready after successThreshold successes
  in a row, not ready after failureThreshold failures; a container without one is ready while it runs;
- Jobs (batch/v1, through the API or `create_job`): Indexed ones only (job_problems says what else is
  refused), restartPolicy Never. Their controller runs up to parallelism pods at once, one per index not yet
  succeeded, `<job>-<index>-<5 random letters>` with hostname `<job>-<index>` (the template's subdomain),
  the job-name and completion-index labels, the index annotation and JOB_COMPLETION_INDEX; a failed pod's
  index gets a new pod at once (no backoff delay) until more pods failed than backoffLimit: then the Job
  is Failed (BackoffLimitExceeded) and its pods still running are deleted. It is Complete once every index
  succeeded. A pod that cannot start (no node could hold it, FailedMount) counts as failed here, where a
  cluster would keep it Pending; ttlSecondsAfterFinished is not acted on. A Job active longer than its
  activeDeadlineSeconds fails (DeadlineExceeded) and its running pods are deleted. Deleting a Job deletes its
  pods too (propagationPolicy Background or Foreground) or leaves them running (Orphan). A Job whose
  ownerReferences name pods (kind Pod, the only owners modeled) is deleted with its pods, as the garbage
  collector deletes it in the background, once none of its owners exists (deleted, or never there: a uid
  that no pod of that name has); a merge patch can drop its owners. `kill_pod` kills a pod's containers as
  losing its node does (exit code 137; the pod stays, Failed);
- the pod network: all pods share this machine's network namespace, so each pod has its own loopback
  address 127.B.0.N (N from 10 up, in the cluster's own block B: Linux routes all of 127.0.0.0/8 to lo)
  standing in for its own network namespace: status.podIP, and DRAFTER_LOCAL_POD_IP in every container,
  where a server that a manifest starts on 0.0.0.0 listens (harness.sglang_standin does); a port bound
  on 0.0.0.0 is bound on every pod's address at once. Cluster DNS is hosts files, replaced whole as pods
  come and go: each pod's own /etc/hosts holds, as the kubelet writes it, localhost and the pod's
  address by its hostname (and full name, with a subdomain), so its hostname resolves to its own
  address; then the records of the headless Services of its namespace (`_dns_records`): a pod whose
  subdomain is one, by `<hostname>.<subdomain>.<namespace>.svc` and `.svc.cluster.local` (and
  `<hostname>.<subdomain>` in its own namespace, through the search domains), and a Service that selects
  pods by its own name, one address per pod. A pod is listed only once it runs and, unless the Service
  publishes not-ready addresses, is ready, and only DNS_PROPAGATION_S after that, as endpoint controllers
  and DNS catch up on a cluster: a pod that looks itself up by its Service's name as it starts finds
  nothing. `hosts_file` holds every listed pod's full names; `address_of` resolves them on this machine.
The containers run on this machine's CPUs: a GPU request is scheduled against the node's capacity
but no GPU exists, so DeepSpeed in a "GPU" pod finds no CUDA and uses its CPU accelerator.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import shutil
import string
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from harness.cluster_api import ApiServer, ClusterError, Rbac
from pipeline.storage import atomic_write

log = logging.getLogger(__name__)

IRSA_ROLE_ANNOTATION = "eks.amazonaws.com/role-arn"
IRSA_TOKEN_DIR = "/var/run/secrets/eks.amazonaws.com/serviceaccount"
# how long after a pod becomes listable its headless Service's DNS record appears (LocalCluster._dns_records)
DNS_PROPAGATION_S = 8.0
# the kubelet's back-off before it reruns a failed container: 10 s, doubling up to 300 s
CRASH_BACKOFF_S = 10.0
# how often a Pending pod is tried again for a node with room (the scheduler retries as pods come and go)
SCHEDULING_RETRY_S = 0.5
DEPLOYMENT_PERIOD_S = 0.5  # the Deployment controller's look at each Deployment's pods
RESTARTED_AT = "kubectl.kubernetes.io/restartedAt"  # what `kubectl rollout restart` sets on the template
# the kubelet's default hard eviction threshold for the node's filesystem: nodefs.available<10%
NODEFS_EVICTION_THRESHOLD = 0.10
VOLUME_KINDS = {"persistentVolumeClaim": "pvc", "configMap": "configmap", "secret": "secret"}
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
FIRST_POD_ADDRESS = 10  # a cluster's pods get 127.N.0.10, 127.N.0.11, ... in its network block N
# Each cluster on this machine holds a network block of its own (127.N.0.0/16, N from 1), reserved by an
# exclusive lock on a file while it lives, so clusters of tests that run side by side never share an address.
NETWORK_BLOCKS = range(1, 255)
NETWORK_LOCKS = Path(tempfile.gettempdir()) / "drafter-local-cluster-networks"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
JOB_INDEX_KEY = "batch.kubernetes.io/job-completion-index"  # a label and an annotation of every Job pod
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
POD_NAME_CHARACTERS = "bcdfghjklmnpqrstvwxz"  # a Job pod's random name suffix: lowercase, no vowels, no words
GC_PERIOD_S = 0.5  # how often the garbage collector looks for a Job's owners
UNSUPPORTED_JOB_FIELDS = (
    "suspend",
    "podFailurePolicy",
    "backoffLimitPerIndex",
    "successPolicy",
)


@dataclass(frozen=True)
class ImageUser:
    """The user an image's processes run as (its Dockerfile's last USER), as its /etc/passwd has it."""

    uid: int = 0
    gid: int = 0
    name: str = "root"
    home: str = "/root"


@dataclass(frozen=True)
class LocalImage:
    """What a container image holds here: its files (path in the container -> host path, read-only),
    paths among them that are this machine's state rather than the image's (masked), env, workdir and
    the user it runs as."""

    files: dict[str, str]
    workdir: str
    env: dict[str, str]
    masked: tuple[str, ...] = ()
    user: ImageUser = ImageUser()


@dataclass(frozen=True)
class RunAs:
    """Who a container's processes are: uid, primary gid and supplementary groups, and the passwd entry
    and HOME the container runtime gives them."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    name: str
    home: str


def run_as(pod_spec: dict[str, Any], container: dict[str, Any], image: LocalImage) -> RunAs:
    """The identity Kubernetes runs a container with: the container's securityContext over the pod's,
    over the image's USER; runAsGroup, else the image user's group when it is that user, else 0; fsGroup
    and supplementalGroups as supplementary groups. runAsNonRoot refuses a container that would be root
    (the kubelet's CreateContainerConfigError). The runtime's HOME is the passwd home of the uid, "/" for
    a uid the image does not know."""
    pod_context = pod_spec.get("securityContext") or {}
    context = {**pod_context, **(container.get("securityContext") or {})}
    uid = int(context.get("runAsUser", image.user.uid))
    known = uid == image.user.uid
    gid = int(context.get("runAsGroup", image.user.gid if known else 0))
    if context.get("runAsNonRoot") and uid == 0:
        raise ClusterError(f"container {container['name']} has runAsNonRoot and would run as root (uid 0)")
    groups = [pod_context["fsGroup"]] if "fsGroup" in pod_context else []
    groups += list(pod_context.get("supplementalGroups") or [])
    return RunAs(
        uid,
        gid,
        tuple(int(group) for group in groups),
        image.user.name if known else f"uid{uid}",
        image.user.home if known else "/",
    )


@dataclass(frozen=True)
class LocalNode:
    name: str
    labels: dict[str, str]
    taints: tuple[dict[str, str], ...]
    capacity: dict[str, str]


def _quantity(value: str) -> float:
    """A Kubernetes quantity ("96", "500m", "1600Gi", "64G") as a number."""
    text = str(value)
    binary = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
    decimal = {"m": 1e-3, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    for suffix, factor in binary.items():
        if text.endswith(suffix):
            return float(text[:-2]) * factor
    if text and text[-1] in decimal:
        return float(text[:-1]) * decimal[text[-1]]
    return float(text)


def pod_requests(spec: dict[str, Any]) -> dict[str, float]:
    """What the scheduler counts a pod as holding: each resource's request (its limit where a container sets
    no request for it, as the API server defaults it), summed over the containers, or the largest of any one
    init container's where that is more (they run one at a time, before the others)."""

    def of(container: dict[str, Any]) -> dict[str, float]:
        resources = container.get("resources") or {}
        amounts = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {name: _quantity(value) for name, value in amounts.items()}

    total: dict[str, float] = {}
    for container in spec.get("containers", []):
        for name, amount in of(container).items():
            total[name] = total.get(name, 0.0) + amount
    for container in spec.get("initContainers") or []:
        for name, amount in of(container).items():
            total[name] = max(total.get(name, 0.0), amount)
    return total


def scheduling_problems(spec: dict[str, Any], node: LocalNode) -> list[str]:
    """Why a pod spec would not be scheduled on the node even with nothing else on it (empty: it fits)."""
    problems = []
    for key, value in (spec.get("nodeSelector") or {}).items():
        if node.labels.get(key) != value:
            problems.append(f"node selector {key}={value} does not match the node ({node.labels.get(key)!r})")
    tolerations = spec.get("tolerations") or []
    for taint in node.taints:
        if not any(_tolerates(toleration, taint) for toleration in tolerations):
            problems.append(f"the node's taint {taint['key']}:{taint['effect']} is not tolerated")
    for name, amount in pod_requests(spec).items():
        if amount > _quantity(node.capacity.get(name, "0")):
            problems.append(
                f"insufficient {name}: requests {amount:g}, the node has {node.capacity.get(name, 0)}"
            )
    return problems


def allocation_problems(spec: dict[str, Any], node: LocalNode, held: dict[str, float]) -> list[str]:
    """Why the pod does not fit beside what the node's scheduled pods hold (`held`, from pod_requests)."""
    problems = []
    for name, amount in pod_requests(spec).items():
        capacity = _quantity(node.capacity.get(name, "0"))
        if amount + held.get(name, 0.0) > capacity:
            free = max(capacity - held.get(name, 0.0), 0.0)
            problems.append(f"insufficient {name}: requests {amount:g}, {free:g} of {capacity:g} free")
    return problems


def _template_hash(template: dict[str, Any]) -> str:
    """The pod-template-hash of a Deployment's template (a digest of it: Kubernetes hashes it too)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _pod_template_hash(pod: LocalPod) -> str | None:
    return (pod.manifest["metadata"].get("labels") or {}).get("pod-template-hash")


def _rollout_bounds(rolling: dict[str, Any], replicas: int) -> tuple[int, int]:
    """maxSurge and maxUnavailable as counts: a percentage of replicas, surge rounded up and unavailable
    down (Kubernetes' rounding); defaults 25% each. Both 0 is refused, as the API server refuses it."""

    def count(value: Any, round_up: bool) -> int:
        if isinstance(value, str) and value.endswith("%"):
            share = replicas * float(value[:-1]) / 100
            return math.ceil(share) if round_up else math.floor(share)
        return int(value)

    surge = count(rolling.get("maxSurge", "25%"), True)
    unavailable = count(rolling.get("maxUnavailable", "25%"), False)
    if surge == 0 and unavailable == 0:
        raise ClusterError("a RollingUpdate with maxSurge 0 and maxUnavailable 0 can never progress")
    return surge, unavailable


def _unavailable(problems: dict[str, list[str]]) -> str:
    return f"0/{len(problems)} nodes are available: " + "; ".join(
        f"{name}: {', '.join(found)}" for name, found in problems.items()
    )


def _tolerates(toleration: dict[str, Any], taint: dict[str, str]) -> bool:
    if toleration.get("effect") not in (None, taint["effect"]):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return toleration.get("key") in (None, taint["key"])
    return toleration.get("key") == taint["key"] and toleration.get("value") == taint.get("value")


@dataclass(frozen=True)
class ProbeTiming:
    """A probe's timing fields with Kubernetes' defaults (the kubelet's prober; the API's Probe type):
    initialDelaySeconds 0, periodSeconds 10, timeoutSeconds 1 (an HTTP probe with no answer within it
    fails: pkg/probe/http/http.go), successThreshold 1, failureThreshold 3."""

    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def of(cls, probe: dict[str, Any]) -> ProbeTiming:
        return cls(
            float(probe.get("initialDelaySeconds", 0)),
            float(probe.get("periodSeconds", 10)),
            float(probe.get("timeoutSeconds", 1)),
            int(probe.get("successThreshold", 1)),
            int(probe.get("failureThreshold", 3)),
        )


def _http_probe(container: dict[str, Any]) -> dict[str, Any] | None:
    return (container.get("readinessProbe") or {}).get("httpGet")


def _required_http_probe(container: dict[str, Any]) -> dict[str, Any]:
    probe = _http_probe(container)
    if probe is None:
        raise ClusterError(f"container {container['name']}: no readinessProbe.httpGet")
    return probe


def _probe_port(container: dict[str, Any]) -> int:
    """The port of a container's readinessProbe.httpGet: a number, or the name of one of its ports."""
    port = _required_http_probe(container)["port"]
    if isinstance(port, int):
        return port
    named = {entry.get("name"): entry["containerPort"] for entry in container.get("ports") or []}
    if port not in named:
        raise ClusterError(
            f"container {container['name']}: readinessProbe port {port!r} is none of its ports"
        )
    return named[port]


def _answers(host: str, port: int, path: str, timeout: float) -> bool:
    """Whether an HTTP GET succeeds as a Kubernetes probe counts success: a status from 200 to 399, all
    of it within `timeout` from the start (the kubelet's http.Client Timeout bounds the whole exchange,
    where a socket's timeout here would bound each read alone)."""
    started = time.monotonic()
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", path)
        status = connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()
    return 200 <= status < 400 and time.monotonic() - started <= timeout


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _timestamp(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_REFERENCE = re.compile(r"\$(?:\((?P<name>[^)]*)\)|(?P<other>.))", re.DOTALL)


def expand_variables(text: str, defined: Mapping[str, str]) -> str:
    """Kubernetes' expansion of a container's command, args and env values: `$(NAME)` is NAME's value where
    NAME is defined, else left as it is; `$$` is a literal `$` (so `$$(NAME)` is `$(NAME)`); any other `$`
    stays."""

    def replace(found: re.Match[str]) -> str:
        if found["name"] is not None:
            return defined.get(found["name"], found[0])
        return "$" if found["other"] == "$" else found[0]

    return _REFERENCE.sub(replace, text)


_SUBSCRIPTED_FIELD = re.compile(r"metadata\.(annotations|labels)\['([^']*)'\]")


def job_problems(job: dict[str, Any]) -> list[str]:
    """Why the local Job controller would not run a Job as stated (empty: it runs)."""
    spec = job.get("spec") or {}
    problems = [] if (job.get("metadata") or {}).get("name") else ["metadata.name is required"]
    if spec.get("completionMode") != "Indexed":
        problems.append("only Indexed Jobs run here (spec.completionMode: Indexed)")
    if "completions" not in spec:
        problems.append("spec.completions is required for an Indexed Job")
    for key in ("completions", "parallelism", "backoffLimit"):
        value = spec.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            problems.append(f"spec.{key} must be a whole number >= 0, not {value!r}")
    deadline = spec.get("activeDeadlineSeconds", 1)
    if not isinstance(deadline, int) or isinstance(deadline, bool) or deadline < 1:
        problems.append(f"spec.activeDeadlineSeconds must be a whole number > 0, not {deadline!r}")
    problems += owner_problems((job.get("metadata") or {}).get("ownerReferences"))
    template = (spec.get("template") or {}).get("spec") or {}
    if not template.get("containers"):
        problems.append("spec.template.spec.containers is required")
    if template.get("restartPolicy") != "Never":
        problems.append("spec.template.spec.restartPolicy must be Never (nothing restarts a container here)")
    return problems + [
        f"spec.{key} is not supported here"
        for key in UNSUPPORTED_JOB_FIELDS
        if spec.get(key) not in (None, False)
    ]


def owner_problems(owners: Any) -> list[str]:
    """Why the local garbage collector would not act on these ownerReferences as Kubernetes does (empty:
    it does): a list of {apiVersion, kind, name, uid}, each a pod of the dependent's namespace."""
    if owners is None:
        return []
    if not isinstance(owners, list):
        return [f"metadata.ownerReferences must be a list, not {owners!r}"]
    problems = []
    for owner in owners:
        missing = [key for key in ("apiVersion", "kind", "name", "uid") if not (owner or {}).get(key)]
        if missing:
            problems.append(f"metadata.ownerReferences: {', '.join(missing)} required in {owner!r}")
        elif (owner["apiVersion"], owner["kind"]) != ("v1", "Pod"):
            problems.append(
                f"metadata.ownerReferences: only pods (apiVersion v1, kind Pod) own here, not "
                f"{owner['apiVersion']} {owner['kind']}"
            )
    return problems


class ContainerRun:
    """One container process (its own namespaces), its timestamped log, and on_exit, called once it ended."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        spec_path: Path,
        log_path: Path,
        on_exit: Callable[[], None],
        user: RunAs | None = None,
    ):
        self.name, self.env, self.log_path, self._on_exit = name, env, log_path, on_exit
        self.user = user or RunAs(0, 0, (), "root", "/root")
        self.started_at = _now()
        self.finished_at: dt.datetime | None = None
        self.exit_code: int | None = None
        launcher_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path)}
        self.process = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--uts",
                "--pid",
                "--fork",
                "--kill-child",
                "--propagation",
                "private",
                sys.executable,
                "-m",
                "harness.container",
                str(spec_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=launcher_env,
            start_new_session=True,
        )
        self.argv = argv
        self._log_thread = threading.Thread(target=self._copy_log, daemon=True)
        self._log_thread.start()

    def _copy_log(self) -> None:
        assert self.process.stdout is not None
        with open(self.log_path, "a", encoding="utf-8") as out:
            for raw in self.process.stdout:
                out.write(f"{_timestamp(_now())} {raw.decode('utf-8', errors='backslashreplace')}")
                out.flush()
        code = self.process.wait()
        self.exit_code = (
            128 - code if code < 0 else code
        )  # killed by signal N: 128 + N, as Kubernetes reports it
        self.finished_at = _now()
        self._on_exit()

    @property
    def running(self) -> bool:
        return self.finished_at is None

    def first_pid(self) -> int | None:
        """The host PID of the container's first process (the child `unshare` forked) now; None while
        `unshare` has not forked it yet, and once it has exited (before `running` turns false: that waits
        for `unshare` itself to be reaped)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        try:
            listed = children.read_text().split()
        except OSError:  # `unshare` has exited too
            return None
        return int(listed[0]) if listed else None

    def init_pid(self) -> int:
        """The first process's host PID, waiting up to 2 s for a starting container's (what exec enters)."""
        for _ in range(200):
            pid = self.first_pid()
            if pid is not None:
                return pid
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
    ip: str = ""
    probed: dict[str, bool] = field(default_factory=dict)  # container -> its readiness probe's last answer
    running_since: float | None = None  # when its containers had all started (time.monotonic())
    volumes: dict[str, dict[str, Any]] = field(default_factory=dict)  # as _volumes made them for it
    init_restarts: dict[str, int] = field(default_factory=dict)  # init container -> restarts after failing

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.manifest["metadata"].get("namespace", "default")

    @property
    def hostname(self) -> str:
        """spec.hostname, else the pod's name as the kubelet cuts it (63 characters, no trailing - or .)."""
        return self.manifest["spec"].get("hostname") or self.name[:63].rstrip("-.")

    def field_value(self, path: str) -> str:
        """A fieldRef of the downward API: metadata.name, metadata.namespace, metadata.uid,
        metadata.annotations['KEY'], metadata.labels['KEY'] (empty if absent), status.podIP, spec.nodeName or
        spec.serviceAccountName."""
        meta, spec = self.manifest["metadata"], self.manifest["spec"]
        fields = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": str(meta.get("uid") or ""),
            "status.podIP": self.ip,
            "spec.nodeName": self.node or "",
            "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        }
        if path in fields:
            return fields[path]
        if found := _SUBSCRIPTED_FIELD.fullmatch(path):
            return str((meta.get(found[1]) or {}).get(found[2], ""))
        raise ClusterError(f"pod {self.name}: fieldRef {path!r} is not one the local cluster resolves")

    def terminated(self) -> bool:
        return self.current_phase() in ("Succeeded", "Failed")

    def container_ready(self, name: str) -> bool:
        run = self.containers.get(name)
        return run is not None and run.running and self.probed.get(name, True)

    def ready(self) -> bool:
        return all(
            self.container_ready(container["name"]) for container in self.manifest["spec"]["containers"]
        )

    def current_phase(self) -> str:
        runs = list(self.containers.values())  # a copy: the pod's start may be adding to them
        if self.phase in ("Pending", "Failed") and not runs:
            return self.phase
        if any(run.running for run in runs):
            return "Running"
        return "Succeeded" if all(run.exit_code == 0 for run in runs) else "Failed"


@dataclass
class LocalJob:
    """An Indexed Job and what its controller counted: the pod of each index that has one running, the
    indexes that succeeded, the pods that failed and, once the Job finished, its Complete or Failed
    condition."""

    manifest: dict[str, Any]
    active: dict[int, LocalPod] = field(default_factory=dict)
    succeeded: set[int] = field(default_factory=set)
    failed: int = 0
    started_at: dt.datetime = field(default_factory=_now)
    completed_at: dt.datetime | None = None
    condition: dict[str, str] | None = None

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.manifest["metadata"]["namespace"]

    def finish(self, kind: str, reason: str, message: str) -> None:
        """Set the Complete or Failed condition; a Job that completed has a completionTime, a failed one
        not."""
        moment = _now()
        self.condition = {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastProbeTime": _timestamp(moment),
            "lastTransitionTime": _timestamp(moment),
        }
        if kind == "Complete":
            self.completed_at = moment

    def status(self) -> dict[str, Any]:
        """Its status as the API returns it (counts of zero left out, as Kubernetes leaves them out)."""
        counts = {"active": len(self.active), "succeeded": len(self.succeeded), "failed": self.failed}
        status: dict[str, Any] = {
            "startTime": _timestamp(self.started_at),
            **{key: count for key, count in counts.items() if count},
        }
        if self.condition:
            status["conditions"] = [self.condition]
        if self.completed_at:
            status["completionTime"] = _timestamp(self.completed_at)
        return status


class LocalCluster:
    """The node, its applied objects (namespaces, service accounts, volumes, RBAC, StatefulSets and
    Services), its Jobs, the pods it ran and, once started, its API server."""

    def __init__(
        self,
        workspace: Path,
        images: dict[str, LocalImage],
        nodes: tuple[LocalNode, ...],
        aws_endpoint: str | None = None,
        region: str = "us-east-1",
        dns_propagation_s: float = DNS_PROPAGATION_S,
        crash_backoff_s: float = CRASH_BACKOFF_S,
    ):
        self.workspace = Path(workspace)
        self.dns_propagation_s, self.crash_backoff_s = dns_propagation_s, crash_backoff_s
        self._scheduling = threading.Lock()
        self.images, self.nodes = images, nodes
        self.aws_endpoint, self.region = aws_endpoint, region
        self.namespaces: set[str] = {"default"}
        self.service_accounts: dict[tuple[str, str], dict[str, str]] = {}
        self.applied: list[str] = []
        self.pods: dict[tuple[str, str], LocalPod] = {}
        self.history: list[dict[str, Any]] = []
        self.statefulsets: dict[tuple[str, str], dict[str, Any]] = {}
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.persistent_volumes: dict[str, dict[str, Any]] = {}
        self.jobs: dict[tuple[str, str], LocalJob] = {}
        self.deployments: dict[tuple[str, str], dict[str, Any]] = {}
        self.rbac = Rbac()
        self.api: ApiServer | None = None
        self.lock = threading.Lock()
        self._tokens: dict[tuple[str, str], str] = {}
        self._addresses: set[str] = set()
        self._network_lock, self.network = _reserve_network_block()
        self._reconciling = threading.Lock()
        self._closed = False
        self._hosts_lock = threading.Lock()
        self._listed_since: dict[tuple[str, ...], float] = {}
        self._written_records: list[tuple[str, str, list[str], bool]] | None = None
        self._written_records_state: tuple | None = None
        self.hosts_file = self.workspace / "hosts"
        self.workspace.mkdir(parents=True, exist_ok=True)
        self._write_hosts()
        threading.Thread(target=self._sync_dns, daemon=True).start()
        threading.Thread(target=self._relieve_disk_pressure, daemon=True).start()
        self.core_v1 = LocalCoreV1Api(self)

    # -- objects ---------------------------------------------------------------------------------
    def volume_dir(self, kind: str, namespace: str, name: str) -> Path:
        return self.workspace / "volumes" / namespace / kind / name

    def _claim(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        """A claim's volume: with spec.volumeName, the PersistentVolume of that name (declared before, and
        reserved for this claim by its claimRef), whose filesystem every volume naming the same CSI
        volumeHandle or NFS export shares; without, a new empty volume (dynamic provisioning)."""
        claim = self.volume_dir("pvc", namespace, name)
        volume_name = spec.get("volumeName")
        if volume_name is None:
            claim.mkdir(parents=True, exist_ok=True)
            return
        volume = self.persistent_volumes.get(volume_name)
        if volume is None:
            raise ClusterError(f"claim {namespace}/{name} names volume {volume_name}, which is not declared")
        reserved = volume["spec"].get("claimRef") or {}
        if reserved and (reserved.get("namespace"), reserved.get("name")) != (namespace, name):
            raise ClusterError(
                f"volume {volume_name} is reserved for claim {reserved}, not {namespace}/{name}"
            )
        store = self.workspace / "volumes" / "filesystems" / _filesystem(volume)
        store.mkdir(parents=True, exist_ok=True)
        claim.parent.mkdir(parents=True, exist_ok=True)
        if not claim.is_symlink():
            claim.symlink_to(store)

    def apply(self, path: Path) -> list[str]:
        """Create or update what a manifest declares (`kubectl apply -f`): namespaces, service accounts,
        claims, config maps, secrets, RBAC objects, Services, StatefulSets and Deployments (whose pods then
        follow their replicas) and Jobs become local state; other kinds are recorded as applied."""
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
            elif kind == "PersistentVolume":
                self.persistent_volumes[name] = doc
            elif kind == "PersistentVolumeClaim":
                self._claim(namespace, name, doc.get("spec") or {})
            elif kind in ("ConfigMap", "Secret"):
                directory = self.volume_dir(kind.lower(), namespace, name)
                directory.mkdir(parents=True, exist_ok=True)
                for key, value in (doc.get("data") or doc.get("stringData") or {}).items():
                    (directory / key).write_text(value)
            elif kind in ("Role", "ClusterRole", "RoleBinding"):
                self.rbac.record(doc)
            elif kind == "Service":
                self.services[(namespace, name)] = doc
            elif kind == "StatefulSet":
                self.statefulsets[(namespace, name)] = doc
                self._reconcile_later(namespace, name)
            elif kind == "Deployment":
                self._apply_deployment(namespace, name, doc)
            elif kind == "Job":  # created once: a Job's spec cannot change, and applying it again is a no-op
                self.create_job(doc)
            created.append(f"{kind}/{namespace}/{name}")
        self.applied += created
        self._write_hosts()  # a Service gives names to the pods of its subdomain
        return created

    # -- the API server and service accounts -----------------------------------------------------
    def start_api(self) -> str:
        """Serve the Kubernetes API to pods (harness.cluster_api); pods created from now on get their
        service account's token, the CA and the KUBERNETES_SERVICE_* env. Returns its base URL."""
        if self.api is None:
            self.api = ApiServer(self, self.workspace / "api")
        return self.api.url

    def service_account_token(self, namespace: str, account: str) -> str:
        """A service account's bearer token (made on first use), the one its pods find in their token file."""
        if namespace not in self.namespaces or (
            account != "default" and (namespace, account) not in self.service_accounts
        ):
            raise ClusterError(f"service account {namespace}/{account} does not exist")
        with self.lock:
            return self._tokens.setdefault((namespace, account), secrets.token_urlsafe(32))

    def authenticate(self, token: str) -> tuple[str, str] | None:
        """The service account (namespace, name) whose token this is; None for a token the cluster never
        issued."""
        for account, known in list(self._tokens.items()):
            if hmac.compare_digest(known.encode(), token.encode()):
                return account
        return None

    def _api_access(self, pod: LocalPod) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """The env and token volume that let a pod call the API server as its service account."""
        if self.api is None or pod.manifest["spec"].get("automountServiceAccountToken") is False:
            return {}, []
        account = pod.manifest["spec"].get("serviceAccountName") or "default"
        directory = pod.directory / "serviceaccount"
        directory.mkdir(exist_ok=True)
        (directory / "token").write_text(self.service_account_token(pod.namespace, account))
        (directory / "namespace").write_text(pod.namespace)
        shutil.copyfile(self.api.ca_file, directory / "ca.crt")
        port = str(self.api.port)
        env = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
        }
        return env, [{"source": str(directory), "target": SERVICE_ACCOUNT_DIR, "read_only": True}]

    # -- StatefulSets ----------------------------------------------------------------------------
    def scale_statefulset(self, namespace: str, name: str, replicas: int) -> None:
        """Set a StatefulSet's replicas; its pods are created and deleted in the background."""
        self._statefulset(namespace, name)["spec"]["replicas"] = replicas
        self._reconcile_later(namespace, name)

    def statefulset_status(self, namespace: str, name: str) -> dict[str, int]:
        """replicas (its pods that exist), readyReplicas and availableReplicas (those ready)."""
        self._statefulset(namespace, name)
        pods = self._stateful_pods(namespace, name).values()
        ready = sum(pod.ready() for pod in pods)
        return {"replicas": len(pods), "readyReplicas": ready, "availableReplicas": ready}

    def _statefulset(self, namespace: str, name: str) -> dict[str, Any]:
        statefulset = self.statefulsets.get((namespace, name))
        if statefulset is None:
            raise ClusterError(f"statefulset {namespace}/{name} does not exist")
        return statefulset

    def _stateful_pods(self, namespace: str, name: str) -> dict[int, LocalPod]:
        ordinal = re.compile(rf"{re.escape(name)}-(0|[1-9][0-9]*)")
        return {
            int(found[1]): pod
            for (pod_namespace, pod_name), pod in list(self.pods.items())
            if pod_namespace == namespace and (found := ordinal.fullmatch(pod_name))
        }

    def _reconcile_later(self, namespace: str, name: str) -> None:
        threading.Thread(target=self._reconcile, args=(namespace, name), daemon=True).start()

    def _reconcile(self, namespace: str, name: str) -> None:
        """The StatefulSet controller: pods for the missing ordinals below replicas, and none at or above."""
        with self._reconciling:
            if self._closed:
                return
            statefulset = self.statefulsets[(namespace, name)]
            replicas = statefulset["spec"].get("replicas", 1)
            present = self._stateful_pods(namespace, name)
            try:
                for ordinal in range(replicas):
                    if ordinal not in present:
                        self.create_pod(self._stateful_pod(statefulset, ordinal))
            except ClusterError as err:
                log.warning("statefulset %s/%s: %s", namespace, name, err)
            for ordinal in sorted((o for o in present if o >= replicas), reverse=True):
                self.delete_pod(namespace, f"{name}-{ordinal}")

    @staticmethod
    def _stateful_pod(statefulset: dict[str, Any], ordinal: int) -> dict[str, Any]:
        meta, spec = statefulset["metadata"], statefulset["spec"]
        template = json.loads(json.dumps(spec["template"]))
        name = f"{meta['name']}-{ordinal}"
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": meta.get("namespace", "default"),
                "uid": str(uuid.uuid4()),
                "labels": (template.get("metadata") or {}).get("labels") or {},
            },
            "spec": {**template["spec"], "hostname": name, "subdomain": spec.get("serviceName")},
        }

    # -- Deployments (apps/v1) --------------------------------------------------------------------
    def _apply_deployment(self, namespace: str, name: str, doc: dict[str, Any]) -> None:
        strategy = (doc["spec"].get("strategy") or {}).get("type", "RollingUpdate")
        if strategy not in ("RollingUpdate", "Recreate"):
            raise ClusterError(f"deployment {namespace}/{name}: strategy {strategy!r} is not a Deployment's")
        first = (namespace, name) not in self.deployments
        self.deployments[(namespace, name)] = json.loads(json.dumps(doc))
        if first:
            threading.Thread(target=self._control_deployment, args=(namespace, name), daemon=True).start()

    def rollout_restart(self, namespace: str, name: str) -> str:
        """`kubectl rollout restart deployment/NAME`: a new template (its restartedAt annotation), which the
        controller rolls out as the strategy says. Returns the new template's hash."""
        doc = self._deployment(namespace, name)
        template_meta = doc["spec"]["template"].setdefault("metadata", {})
        template_meta.setdefault("annotations", {})[RESTARTED_AT] = _timestamp(_now())
        return _template_hash(doc["spec"]["template"])

    def set_env(self, namespace: str, name: str, container: str, values: dict[str, str]) -> str:
        """`kubectl set env deployment/NAME -c CONTAINER KEY=VALUE...`: the env of the template's container
        of that name (init containers too, as kubectl selects them), which the controller rolls out as the
        strategy says; an unchanged template rolls nothing. Returns the template's hash."""
        with self._reconciling:
            doc = self._deployment(namespace, name)
            spec = doc["spec"]["template"]["spec"]
            named = [
                entry
                for entry in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
                if entry.get("name") == container
            ]
            if not named:
                raise ClusterError(f"deployment {namespace}/{name} has no container named {container!r}")
            for entry in named:
                env = entry.setdefault("env", [])
                for key, value in values.items():
                    env[:] = [variable for variable in env if variable.get("name") != key]
                    env.append({"name": key, "value": value})
            return _template_hash(doc["spec"]["template"])

    def deployment_template_hash(self, namespace: str, name: str) -> str:
        return _template_hash(self._deployment(namespace, name)["spec"]["template"])

    def delete_deployment(self, namespace: str, name: str) -> None:
        """`kubectl delete deployment`: the Deployment and its pods (no-op for one that does not exist)."""
        with self._reconciling:
            if self.deployments.pop((namespace, name), None) is None:
                return
            pods = self.deployment_pods(namespace, name)
        for pod in pods:
            self.delete_pod(namespace, pod.name)

    def _deployment(self, namespace: str, name: str) -> dict[str, Any]:
        doc = self.deployments.get((namespace, name))
        if doc is None:
            raise ClusterError(f"deployment {namespace}/{name} does not exist")
        return doc

    def deployment_pods(self, namespace: str, name: str, template_hash: str | None = None) -> list[LocalPod]:
        """The Deployment's pods that exist and have not terminated, oldest first (of `template_hash`'s
        template only, when given)."""
        owned = []
        for (pod_namespace, _), pod in list(self.pods.items()):
            owner = (pod.manifest["metadata"].get("ownerReferences") or [{}])[0]
            labels = pod.manifest["metadata"].get("labels") or {}
            pod_hash = labels.get("pod-template-hash")
            if (
                pod_namespace == namespace
                and owner.get("kind") == "ReplicaSet"
                and owner.get("name") == f"{name}-{pod_hash}"
                and template_hash in (None, pod_hash)
                and not pod.terminated()
            ):
                owned.append(pod)
        return sorted(owned, key=lambda pod: pod.created_at)

    def _control_deployment(self, namespace: str, name: str) -> None:
        """The Deployment controller (with its ReplicaSets'), every DEPLOYMENT_PERIOD_S until the cluster
        shuts down or the Deployment is deleted: a pod of the current template for each replica; a pod that
        terminated (failed, evicted) does not count and is replaced; pods of an older template are replaced
        as the strategy says."""
        while True:
            with self._reconciling:
                doc = self.deployments.get((namespace, name))
                if self._closed or doc is None:
                    return
                try:
                    self._sync_deployment(namespace, name, doc)
                except ClusterError as err:
                    log.warning("deployment %s/%s: %s", namespace, name, err)
            time.sleep(DEPLOYMENT_PERIOD_S)

    def _sync_deployment(self, namespace: str, name: str, doc: dict[str, Any]) -> None:
        """One step of a rollout. RollingUpdate: at most replicas + maxSurge pods, and old pods removed only
        while replicas - maxUnavailable pods stay ready (unready old pods first); Recreate: every old pod
        removed before a new one starts."""
        spec = doc["spec"]
        replicas = int(spec.get("replicas", 1))
        current = _template_hash(spec["template"])
        pods = self.deployment_pods(namespace, name)
        new = [pod for pod in pods if _pod_template_hash(pod) == current]
        old = [pod for pod in pods if _pod_template_hash(pod) != current]
        strategy = spec.get("strategy") or {}
        if strategy.get("type") == "Recreate":
            surge, unavailable = 0, replicas
            if old:
                for pod in old:
                    self.delete_pod(namespace, pod.name)
                return
        else:
            surge, unavailable = _rollout_bounds(strategy.get("rollingUpdate") or {}, replicas)
        for pod in new[replicas:][::-1]:  # scaled down: the newest go first
            self.delete_pod(namespace, pod.name)
        room = replicas + surge - len(pods)
        for _ in range(max(min(room, replicas - len(new)), 0)):
            self.create_pod(self._deployment_pod(doc, current))
        removable = sum(pod.ready() for pod in pods) - (replicas - unavailable)
        for pod in sorted(old, key=lambda pod: pod.ready()):
            if pod.ready():
                if removable <= 0:
                    break
                removable -= 1
            self.delete_pod(namespace, pod.name)

    @staticmethod
    def _deployment_pod(doc: dict[str, Any], template_hash: str) -> dict[str, Any]:
        """A pod as a Deployment's ReplicaSet makes it: `<deployment>-<template hash>-<5 random>`, the
        template's labels with pod-template-hash, owned by the ReplicaSet `<deployment>-<template hash>`."""
        meta, template = doc["metadata"], json.loads(json.dumps(doc["spec"]["template"]))
        replica_set = f"{meta['name']}-{template_hash}"
        suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        template_meta = template.get("metadata") or {}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{replica_set}-{suffix}",
                "namespace": meta.get("namespace", "default"),
                "uid": str(uuid.uuid4()),
                "labels": {**(template_meta.get("labels") or {}), "pod-template-hash": template_hash},
                "annotations": dict(template_meta.get("annotations") or {}),
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": replica_set, "controller": True}
                ],
            },
            "spec": template["spec"],
        }

    # -- Jobs (batch/v1, Indexed) -----------------------------------------------------------------
    def create_job(self, manifest: dict[str, Any]) -> LocalJob | None:
        """Start an Indexed Job in its namespace (None: a Job of that name exists). Raises ClusterError for
        one the local controller does not run as stated (job_problems) or a namespace that does not exist."""
        problems = job_problems(manifest)
        if problems:
            raise ClusterError("; ".join(problems))
        job = json.loads(json.dumps(manifest))
        meta, spec = job["metadata"], job["spec"]
        namespace = meta.setdefault("namespace", "default")
        if namespace not in self.namespaces:
            raise ClusterError(f"namespace {namespace!r} does not exist")
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_timestamp(_now()))
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        with self.lock:
            if (namespace, meta["name"]) in self.jobs:
                return None
            local = self.jobs[(namespace, meta["name"])] = LocalJob(job)
        threading.Thread(target=self._control_job, args=(local,), daemon=True).start()
        if meta.get("ownerReferences"):
            threading.Thread(target=self._collect_when_unowned, args=(local,), daemon=True).start()
        return local

    def patch_job_owners(self, namespace: str, name: str, owners: list[dict[str, Any]] | None) -> LocalJob:
        """A merge patch of a Job's metadata.ownerReferences (None: it has none from now on, so nothing
        collects it); ClusterError for a Job that does not exist or owners not modeled (owner_problems)."""
        problems = owner_problems(owners)
        if problems:
            raise ClusterError("; ".join(problems))
        with self._reconciling:
            job = self.jobs.get((namespace, name))
            if job is None:
                raise ClusterError(f"job {namespace}/{name} does not exist")
            meta = job.manifest["metadata"]
            collected = bool(meta.get("ownerReferences"))
            if owners:
                meta["ownerReferences"] = json.loads(json.dumps(owners))
            else:
                meta.pop("ownerReferences", None)
        if owners and not collected:
            threading.Thread(target=self._collect_when_unowned, args=(job,), daemon=True).start()
        return job

    def _collect_when_unowned(self, job: LocalJob) -> None:
        """The garbage collector for one Job, every GC_PERIOD_S while it exists and has owners: once none of
        them exists (no pod of its name and uid in its namespace), the Job and its pods are deleted
        (propagationPolicy Background)."""
        while not self._closed and self.jobs.get((job.namespace, job.name)) is job:
            owners = job.manifest["metadata"].get("ownerReferences")
            if not owners:
                return
            if not any(self._owner_exists(job.namespace, owner) for owner in owners):
                log.info("job %s/%s: every owner is gone; deleted with its pods", job.namespace, job.name)
                self.delete_job(job.namespace, job.name, with_pods=True)
                return
            time.sleep(GC_PERIOD_S)

    def _owner_exists(self, namespace: str, owner: dict[str, Any]) -> bool:
        pod = self.pods.get((namespace, owner["name"]))
        return pod is not None and pod.manifest["metadata"].get("uid") == owner["uid"]

    def delete_job(self, namespace: str, name: str, with_pods: bool) -> LocalJob | None:
        """Delete a Job at once (None: there is none). with_pods (propagationPolicy Background or Foreground):
        its pods too, those still running killed; without, they are orphaned and run on (Orphan, the API's
        default for a Job)."""
        with self._reconciling:  # from now on its controller starts no pod
            job = self.jobs.pop((namespace, name), None)
        if job is not None and with_pods:
            uid = job.manifest["metadata"]["uid"]
            for pod in list(self.pods.values()):
                if (
                    pod.namespace == namespace
                    and (pod.manifest["metadata"].get("labels") or {}).get(JOB_UID_LABEL) == uid
                ):
                    self.delete_pod(namespace, pod.name)
        return job

    def pods_labelled(self, namespace: str, key: str, value: str) -> list[LocalPod]:
        """The namespace's pods with the label key=value (`kubectl -l key=value`), oldest first."""
        return [
            pod
            for pod in list(self.pods.values())
            if pod.namespace == namespace and (pod.manifest["metadata"].get("labels") or {}).get(key) == value
        ]

    def job_status(self, namespace: str, name: str) -> dict[str, Any]:
        """A Job's status as the API returns it."""
        job = self.jobs.get((namespace, name))
        if job is None:
            raise ClusterError(f"job {namespace}/{name} does not exist")
        return job.status()

    def job_pods(self, namespace: str, job: str) -> list[LocalPod]:
        """The pods labelled as the Job's (batch.kubernetes.io/job-name), by completion index, oldest
        first."""
        pods = self.pods_labelled(namespace, JOB_NAME_LABEL, job)
        return sorted(
            pods, key=lambda pod: int((pod.manifest["metadata"].get("labels") or {}).get(JOB_INDEX_KEY, -1))
        )

    def kill_pod(self, namespace: str, name: str) -> None:
        """SIGKILL every container of a pod, as losing its node does: the pod stays, Failed, with exit
        code 137."""
        pod = self.pods.get((namespace, name))
        if pod is None or not pod.containers:
            raise ClusterError(f"pod {namespace}/{name} has no started containers to kill")
        for run in list(pod.containers.values()):
            run.kill()

    def _control_job(self, job: LocalJob) -> None:
        """The Job controller for one Job, every 0.2 s until the Job finished or was deleted."""
        while True:
            with self._reconciling:
                if self._closed or self.jobs.get((job.namespace, job.name)) is not job:
                    return
                stopping = self._sync_job(job)
            for pod in stopping:
                self.delete_pod(pod.namespace, pod.name)
            if job.condition:
                return
            time.sleep(0.2)

    def _sync_job(self, job: LocalJob) -> list[LocalPod]:
        """Count the pods that finished, then finish the Job or start a pod for each index without one (a new
        pod for an index whose pod failed: no backoff delay here). Returns the pods to delete: those still
        running when the Job failed, which count as failed, as Kubernetes counts them."""
        self._count_finished(job)
        spec = job.manifest["spec"]
        deadline = spec.get("activeDeadlineSeconds")
        if deadline is not None and (_now() - job.started_at).total_seconds() > deadline:
            stopping = list(job.active.values())
            job.failed += len(stopping)
            job.active.clear()
            job.finish("Failed", "DeadlineExceeded", "Job was active longer than specified deadline")
            return stopping
        if job.failed > spec["backoffLimit"]:
            stopping = list(job.active.values())
            job.failed += len(stopping)
            job.active.clear()
            job.finish("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            return stopping
        if len(job.succeeded) == spec["completions"]:
            job.finish("Complete", "CompletionsReached", "Reached expected number of succeeded pods")
            return []
        waiting = [
            index
            for index in range(spec["completions"])
            if index not in job.succeeded and index not in job.active
        ]
        for index in waiting[: max(spec["parallelism"] - len(job.active), 0)]:
            job.active[index] = self.create_pod(self._job_pod(job, index))
        return []

    def _count_finished(self, job: LocalJob) -> None:
        """Move the Job's pods that terminated from active to succeeded or failed. A pod that cannot start
        (no node could hold it, FailedMount) fails here, where a cluster would keep it Pending; one waiting
        for room on a node stays active."""
        for index, pod in list(job.active.items()):
            phase = pod.current_phase()
            if phase in ("Pending", "Running") and self.pods.get((pod.namespace, pod.name)) is not pod:
                phase = "Failed"  # deleted before it finished
            if phase == "Succeeded":
                job.succeeded.add(index)
            elif phase == "Failed":
                job.failed += 1
            if phase in ("Succeeded", "Failed"):
                del job.active[index]

    @staticmethod
    def _job_pod(job: LocalJob, index: int) -> dict[str, Any]:
        """The pod of an index as the Indexed Job controller makes it: named <job>-<index>-<5 random
        characters>, hostname <job>-<index>, the index in a label, an annotation and JOB_COMPLETION_INDEX."""
        template = json.loads(json.dumps(job.manifest["spec"]["template"]))
        meta, uid = template.get("metadata") or {}, job.manifest["metadata"]["uid"]
        suffix = "".join(secrets.choice(POD_NAME_CHARACTERS) for _ in range(5))
        labels = {
            **(meta.get("labels") or {}),
            JOB_NAME_LABEL: job.name,
            "job-name": job.name,
            JOB_INDEX_KEY: str(index),
            JOB_UID_LABEL: uid,
            "controller-uid": uid,
        }
        owner = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": job.name,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{job.name}-{index}-{suffix}",
                "namespace": job.namespace,
                "uid": str(uuid.uuid4()),
                "labels": labels,
                "annotations": {**(meta.get("annotations") or {}), JOB_INDEX_KEY: str(index)},
                "ownerReferences": [owner],
            },
            "spec": {**_with_completion_index(template["spec"]), "hostname": f"{job.name}-{index}"},
        }

    # -- pod network and DNS ---------------------------------------------------------------------
    def _allocate_address(self) -> str:
        """The lowest free pod address of the cluster's network block from 127.N.0.10 up (held under
        self.lock)."""
        number = FIRST_POD_ADDRESS
        while (address := str(self.network + number)) in self._addresses:
            number += 1
        self._addresses.add(address)
        return address

    def _dns_records(self) -> list[tuple[str, str, list[str], bool]]:
        """Cluster DNS as (namespace, address, names, unique), as EndpointSlices and CoreDNS make it from a
        headless Service (clusterIP None) of the pod's namespace: a pod is listed only once it runs, and ready
        unless the Service publishes not-ready addresses, and then only after dns_propagation_s (the
        endpoint controllers and DNS catching up: "you may not be able to look up the DNS name for a
        newly-run Pod immediately", Kubernetes' StatefulSet docs). A pod whose subdomain is such a Service
        has its own name, <hostname>.<subdomain>.<namespace>.svc.cluster.local, <...>.svc and, last,
        <hostname>.<subdomain> (what pods of its namespace resolve through their search domains); a Service
        that selects pods names all of them at once (unique False), <service>.<namespace>.svc.cluster.local,
        <...>.svc and <service>."""
        now, records, eligible = time.monotonic(), [], set()

        def listed(key: tuple[str, ...]) -> bool:
            eligible.add(key)
            return now - self._listed_since.setdefault(key, now) >= self.dns_propagation_s

        for pod in list(self.pods.values()):
            if pod.running_since is None or pod.terminated():
                continue
            namespace = pod.namespace
            hostname, subdomain = pod.manifest["spec"].get("hostname"), pod.manifest["spec"].get("subdomain")
            for (service_namespace, service_name), service in self.services.items():
                spec = service.get("spec") or {}
                if service_namespace != namespace or spec.get("clusterIP") != "None":
                    continue
                if not (spec.get("publishNotReadyAddresses") or pod.ready()):
                    continue
                if (
                    hostname
                    and service_name == subdomain
                    and listed((namespace, service_name, pod.name, "pod"))
                ):
                    fqdn = f"{hostname}.{subdomain}.{namespace}.svc"
                    records.append(
                        (namespace, pod.ip, [f"{fqdn}.cluster.local", fqdn, f"{hostname}.{subdomain}"], True)
                    )
                selector = spec.get("selector") or {}
                labels = pod.manifest["metadata"].get("labels") or {}
                if selector and all(labels.get(k) == v for k, v in selector.items()):
                    if listed((namespace, service_name, pod.name, "service")):
                        name = f"{service_name}.{namespace}.svc"
                        records.append(
                            (namespace, pod.ip, [f"{name}.cluster.local", name, service_name], False)
                        )
        for key in set(self._listed_since) - eligible:
            del self._listed_since[key]
        return records

    def address_of(self, hostname: str) -> str | None:
        """The address a pod's DNS name (<hostname>.<subdomain>.<namespace>.svc, optionally .cluster.local)
        resolves to in the pods' /etc/hosts, for callers on this machine."""
        with self._hosts_lock:
            records = list(self._written_records or [])
        addresses = {name: ip for _, ip, names, unique in reversed(records) if unique for name in names[:-1]}
        return addresses.get(hostname.rstrip("."))

    def service_addresses(self, namespace: str, service: str) -> list[str]:
        """The addresses a headless Service's own name resolves to now (the pods it lists)."""
        name = f"{service}.{namespace}.svc.cluster.local"
        with self._hosts_lock:
            records = list(self._written_records or [])
        return sorted({ip for _, ip, names, unique in records if not unique and name in names})

    def _sync_dns(self) -> None:
        """Rewrite the DNS whenever a record comes or goes with time (a pod listed after the propagation
        delay, or once ready), until the cluster shuts down."""
        while not self._closed:
            self._write_hosts()
            time.sleep(0.5)

    def _write_hosts(self) -> None:
        """Rewrite the cluster's DNS when its records changed: self.hosts_file (the full names of every
        listed pod) and each running pod's /etc/hosts, which holds what the kubelet writes there (localhost,
        the pod's own address and names) and then the cluster DNS records; the short names only of its own
        namespace's. Each file is replaced whole: a reader sees the old one or the new one."""
        with self._hosts_lock:
            records = self._dns_records()
            pods = [pod for pod in list(self.pods.values()) if not pod.terminated()]
            state = (records, sorted(pod.name for pod in pods))
            if state == self._written_records_state:
                return
            self._written_records, self._written_records_state = records, state
            _replace(
                self.hosts_file, _hosts_text([(ip, names[:-1], unique) for _, ip, names, unique in records])
            )
            for pod in pods:
                others = [
                    (ip, names if namespace == pod.namespace else names[:-1], unique)
                    for namespace, ip, names, unique in records
                ]
                _replace(
                    pod.directory / "dns" / "hosts", _hosts_text([(pod.ip, _own_names(pod), True), *others])
                )

    # -- pods ------------------------------------------------------------------------------------
    def create_pod(self, manifest: dict[str, Any]) -> LocalPod:
        meta = manifest["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))  # every object has one from its creation on
        namespace, name = meta.get("namespace", "default"), meta["name"]
        if namespace not in self.namespaces:
            raise ClusterError(f"namespace {namespace!r} does not exist (apply its manifest first)")
        with self.lock:
            if (namespace, name) in self.pods:
                raise ClusterError(f"pod {namespace}/{name} already exists")
            pod = self.pods[(namespace, name)] = LocalPod(
                manifest, self._pod_directory(namespace, name), ip=self._allocate_address()
            )
        self._write_hosts()
        self._record(pod, "created")
        threading.Thread(target=self._start, args=(pod,), daemon=True).start()
        return pod

    def _pod_directory(self, namespace: str, name: str) -> Path:
        """A new directory for the pod; a pod named as one that ran before (a StatefulSet's, scaled down and
        up again) gets its own, apart from its predecessor's logs ("_" is in no pod name)."""
        directory, incarnation = self.workspace / "pods" / f"{namespace}-{name}", 1
        while directory.exists():
            incarnation += 1
            directory = self.workspace / "pods" / f"{namespace}-{name}_{incarnation}"
        directory.mkdir(parents=True)
        return directory

    def _fail(self, pod: LocalPod, reason: str, message: str) -> None:
        pod.phase, pod.reason = "Failed", reason
        pod.events.append({"type": "Warning", "reason": reason, "message": message})
        log.warning("pod %s: %s: %s", pod.name, reason, message)
        self._write_hosts()  # a terminated pod has no DNS name

    def _start(self, pod: LocalPod) -> None:
        spec = pod.manifest["spec"]
        if not self._schedule(pod):
            return
        try:
            volumes = self._volumes(pod)
            for container in spec.get("initContainers") or []:
                if not self._run_init_container(pod, container, volumes):
                    return
            probed = {
                container["name"]: _probe_port(container)
                for container in spec["containers"]
                if _http_probe(container)
            }
            pod.probed = dict.fromkeys(probed, False)
            for container in spec["containers"]:
                pod.containers[container["name"]] = self._run_container(pod, container, volumes)
        except ClusterError as err:
            for run in pod.containers.values():
                run.kill()
            pod.containers.clear()
            self._fail(pod, "FailedMount" if "volume" in str(err) else "CreateContainerError", str(err))
            return
        if self.pods.get((pod.namespace, pod.name)) is not pod:  # deleted while its containers started
            for run in pod.containers.values():
                run.kill()
            return
        pod.volumes, pod.running_since = volumes, time.monotonic()
        if _storage_limits(spec, volumes) != (None, {}):
            threading.Thread(target=self._evict_past_storage_limits, args=(pod, volumes), daemon=True).start()
        for container in spec["containers"]:
            if container["name"] in probed:
                threading.Thread(
                    target=self._probe_readiness,
                    args=(pod, container, probed[container["name"]]),
                    daemon=True,
                ).start()

    def _schedule(self, pod: LocalPod) -> bool:
        """Bind the pod to the first node that fits it beside what the pods bound there hold (pod_requests,
        from binding until the pod terminates or is deleted, init containers included). A pod no node could
        hold even empty fails (FailedScheduling; a cluster would keep it Pending for good). One that waits
        for room stays Pending, unbound (a FailedScheduling event, PodScheduled False), and is bound once
        room frees. Returns whether it was bound."""
        spec = pod.manifest["spec"]
        problems = {node.name: scheduling_problems(spec, node) for node in self.nodes}
        if all(problems.values()):
            self._fail(pod, "FailedScheduling", _unavailable(problems))
            return False
        told = False
        while not self._closed and self.pods.get((pod.namespace, pod.name)) is pod:
            with self._scheduling:
                for node in self.nodes:
                    if not problems[node.name]:
                        problems[node.name] = allocation_problems(spec, node, self._held(node.name))
                        if not problems[node.name]:
                            pod.node = node.name
                            assigned = f"assigned to node {node.name}"
                            pod.events.append({"type": "Normal", "reason": "Scheduled", "message": assigned})
                            return True
            if not told:
                message = _unavailable(problems)
                pod.events.append({"type": "Warning", "reason": "FailedScheduling", "message": message})
                log.info("pod %s/%s is Pending: %s", pod.namespace, pod.name, message)
                told = True
            problems = {node.name: scheduling_problems(spec, node) for node in self.nodes}
            time.sleep(SCHEDULING_RETRY_S)
        return False

    def _held(self, node: str) -> dict[str, float]:
        """What the pods bound to the node and not terminated request, by resource."""
        held: dict[str, float] = {}
        for pod in list(self.pods.values()):
            if pod.node == node and not pod.terminated():
                for name, amount in pod_requests(pod.manifest["spec"]).items():
                    held[name] = held.get(name, 0.0) + amount
        return held

    def gpus_held(self) -> dict[str, float]:
        """nvidia.com/gpu held on each node that has any held."""
        held = {node.name: self._held(node.name).get("nvidia.com/gpu", 0.0) for node in self.nodes}
        return {name: amount for name, amount in held.items() if amount}

    def _run_init_container(self, pod: LocalPod, container: dict[str, Any], volumes) -> bool:
        """Run an init container to its end. One that fails fails the pod under restartPolicy Never (task and
        Job pods). Otherwise (Always, Kubernetes' default, as a Deployment's pods have it; OnFailure) the
        kubelet runs it again after a back-off doubling from crash_backoff_s to 30 times that
        (Init:CrashLoopBackOff): the pod stays Pending on its node, holding what it requests, until the
        init container succeeds or the pod is deleted. Returns whether it succeeded."""
        backoff = self.crash_backoff_s
        while True:
            run = self._run_container(pod, container, volumes)
            run._log_thread.join()
            if run.exit_code == 0:
                return True
            if pod.manifest["spec"].get("restartPolicy", "Always") == "Never":
                self._fail(pod, "InitContainerFailed", f"{container['name']} exited {run.exit_code}")
                return False
            pod.init_restarts[container["name"]] = pod.init_restarts.get(container["name"], 0) + 1
            pod.events.append(
                {
                    "type": "Warning",
                    "reason": "BackOff",
                    "message": f"Back-off restarting failed container {container['name']} (exited "
                    f"{run.exit_code}; restart {pod.init_restarts[container['name']]} in {backoff:g} s)",
                }
            )
            deadline = time.monotonic() + backoff
            while time.monotonic() < deadline:
                if self._closed or self.pods.get((pod.namespace, pod.name)) is not pod:
                    return False
                time.sleep(min(0.2, backoff))
            backoff = min(backoff * 2, self.crash_backoff_s * 30)

    def _evict_past_storage_limits(self, pod: LocalPod, volumes: dict[str, dict[str, Any]]) -> None:
        """The kubelet's local-storage eviction, every second while the pod runs: a pod whose containers'
        writable layers (their /tmp here) and disk-backed emptyDirs hold more than the sum of its containers'
        ephemeral-storage limits, or an emptyDir more than its sizeLimit, is evicted: its containers are
        killed and it fails with reason Evicted, as on a node. (Pods over their requests are evicted when
        the node runs short: _relieve_disk_pressure.)"""
        limit, sized = _storage_limits(pod.manifest["spec"], volumes)
        while self.pods.get((pod.namespace, pod.name)) is pod and not pod.terminated():
            used = _local_storage_used(pod)
            over = [
                f"emptyDir {name} holds {used[name]} bytes, over its sizeLimit {size}"
                for name, size in sized.items()
                if used[name] > size
            ]
            total = sum(used.values())
            if limit is not None and total > limit:
                over.append(
                    f"the pod's local storage holds {total} bytes, over its containers' limit {limit}"
                )
            if over:
                self._evict(pod, "; ".join(over))
                return
            time.sleep(1.0)

    def _evict(self, pod: LocalPod, message: str) -> None:
        pod.reason = "Evicted"
        pod.events.append({"type": "Warning", "reason": "Evicted", "message": message})
        log.warning("pod %s: Evicted: %s", pod.name, message)
        for run in list(pod.containers.values()):
            run.kill()

    def _relieve_disk_pressure(self) -> None:
        """The kubelet's eviction under node disk pressure, every second: when the pods running on a node
        whose capacity names its ephemeral-storage hold more than that less the hard eviction threshold
        (nodefs.available<10%), the pod furthest past its containers' ephemeral-storage requests (none
        requested: 0) is evicted, one at a time until the pressure is gone. A pod within its requests is
        never evicted for it."""
        while not self._closed:
            for node in self.nodes:
                if "ephemeral-storage" in node.capacity:
                    self._relieve_node(node)
            time.sleep(1.0)

    def _relieve_node(self, node: LocalNode) -> None:
        allowed = _quantity(node.capacity["ephemeral-storage"]) * (1 - NODEFS_EVICTION_THRESHOLD)
        pods = [
            pod
            for pod in list(self.pods.values())
            if pod.node == node.name and pod.running_since is not None and _running(pod)
        ]
        used = {id(pod): sum(_local_storage_used(pod).values()) for pod in pods}
        if sum(used.values()) <= allowed:
            return
        past = {id(pod): used[id(pod)] - _storage_requests(pod.manifest["spec"]) for pod in pods}
        victim = max(pods, key=lambda pod: past[id(pod)], default=None)
        if victim is None or past[id(victim)] <= 0:
            return
        self._evict(
            victim,
            f"The node was low on resource: ephemeral-storage. The pod was using {used[id(victim)]} bytes, "
            f"past its request of {_storage_requests(victim.manifest['spec'])}",
        )

    def _probe_readiness(self, pod: LocalPod, container: dict[str, Any], port: int) -> None:
        """The kubelet's readiness probing of a container's readinessProbe.httpGet, at the pod's address
        while the container runs, with the probe's own settings (ProbeTiming): nothing before
        initialDelaySeconds, then a GET every periodSeconds that fails when no answer came within
        timeoutSeconds; ready after successThreshold successes in a row, not ready again after
        failureThreshold failures in a row."""
        timing = ProbeTiming.of(container["readinessProbe"])
        path = _required_http_probe(container).get("path", "/")
        run = pod.containers[container["name"]]
        name, successes, failures = container["name"], 0, 0
        time.sleep(timing.initial_delay_s)
        while self.pods.get((pod.namespace, pod.name)) is pod and run.running:
            started = time.monotonic()
            if _answers(pod.ip, port, path, timing.timeout_s):
                successes, failures = successes + 1, 0
                if successes >= timing.success_threshold:
                    pod.probed[name] = True
            else:
                successes, failures = 0, failures + 1
                if failures >= timing.failure_threshold:
                    pod.probed[name] = False
            time.sleep(max(0.0, timing.period_s - (time.monotonic() - started)))

    def _volumes(self, pod: LocalPod) -> dict[str, dict[str, Any]]:
        namespace = pod.manifest["metadata"].get("namespace", "default")
        volumes = {}
        for volume in pod.manifest["spec"].get("volumes") or []:
            name = volume["name"]
            if "emptyDir" in volume:
                empty = volume["emptyDir"] or {}
                source = pod.directory / "volumes" / name
                source.mkdir(parents=True)
                source.chmod(0o777)  # as the kubelet makes an emptyDir: any user of the pod writes it
                size = empty.get("sizeLimit")
                memory = empty.get("medium") == "Memory"
                volumes[name] = {
                    "source": str(source),
                    "tmpfs": memory,
                    "disk": not memory,  # node-local disk: ephemeral storage, counted for eviction
                    "size": str(int(_quantity(size))) if size else None,
                }
                continue
            kind = next((VOLUME_KINDS[key] for key in VOLUME_KINDS if key in volume), None)
            if kind is None:
                raise ClusterError(
                    f"volume {name}: only persistentVolumeClaim, configMap, secret and emptyDir "
                    f"volumes run here, not {sorted(set(volume) - {'name'})}"
                )
            source_spec = volume[next(key for key in VOLUME_KINDS if key in volume)]
            claim = source_spec.get("claimName") or source_spec.get("name") or source_spec.get("secretName")
            source = self.volume_dir(kind, namespace, claim)
            if not source.is_dir():
                raise ClusterError(f"volume {name}: {kind} {namespace}/{claim} does not exist")
            volumes[name] = {
                "source": str(source),
                "tmpfs": False,
                "read_only": bool(source_spec.get("readOnly")) or kind != "pvc",
            }
        return volumes

    def _image(self, container: dict[str, Any]) -> LocalImage:
        reference = container.get("image")
        if reference not in self.images:
            raise ClusterError(
                f"image {reference!r} cannot be pulled here; known images: {sorted(self.images)}"
            )
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
        env = {
            "AWS_ROLE_ARN": role,
            "AWS_WEB_IDENTITY_TOKEN_FILE": f"{IRSA_TOKEN_DIR}/token",
            "AWS_ROLE_SESSION_NAME": pod.name,
            "AWS_STS_REGIONAL_ENDPOINTS": "regional",
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }
        return env, [{"source": str(token), "target": IRSA_TOKEN_DIR, "read_only": True}]

    def _container_env(
        self, pod: LocalPod, container: dict[str, Any]
    ) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """The env Kubernetes gives a container (not the image's own, nor HOSTNAME, which the container
        runtime sets), with which `$(NAME)` in its command and args expands, and the token volumes that go
        with it: IRSA's and the API server's env, then the spec's env in order, each value expanded with
        those before."""
        identity_env, identity_mounts = self._identity(pod)
        api_env, api_mounts = self._api_access(pod)
        # AWS's public endpoints are the local S3 (and STS) server here
        aws = {"AWS_ENDPOINT_URL": self.aws_endpoint} if self.aws_endpoint else {}
        # DRAFTER_LOCAL_POD_IP: the pod's own address, standing in for its own network namespace
        env = {**aws, **identity_env, **api_env, "DRAFTER_LOCAL_POD_IP": pod.ip}
        for variable in container.get("env") or []:
            env[variable["name"]] = _env_value(pod, container["name"], variable, env)
        return env, identity_mounts + api_mounts

    def _run_container(self, pod: LocalPod, container: dict[str, Any], volumes: dict[str, dict[str, Any]]):
        image = self._image(container)
        user = run_as(pod.manifest["spec"], container, image)
        defined, mounts = self._container_env(pod, container)
        argv = [
            expand_variables(part, defined)
            for part in [*(container.get("command") or []), *(container.get("args") or [])]
        ]
        if not argv:
            raise ClusterError(
                f"container {container['name']}: no command (the local images have no entrypoint)"
            )
        env = {"HOME": user.home, **image.env, "HOSTNAME": pod.hostname, **defined}
        for mount in container.get("volumeMounts") or []:
            if mount["name"] not in volumes:
                raise ClusterError(
                    f"container {container['name']} mounts volume {mount['name']!r}, "
                    "which the pod does not declare"
                )
            if mount.get("subPath"):
                raise ClusterError(f"volume {mount['name']}: subPath mounts are not supported here")
            volume = volumes[mount["name"]]
            mounts.append(
                {
                    **volume,
                    "target": mount["mountPath"],
                    "read_only": bool(mount.get("readOnly")) or volume.get("read_only", False),
                }
            )
        spec_path = pod.directory / f"{container['name']}.json"
        spec_path.write_text(
            json.dumps(
                {
                    "name": f"{pod.name}/{container['name']}",
                    "rootfs": str(pod.directory / "rootfs" / container["name"]),
                    "image_files": image.files,
                    "masked": list(image.masked),
                    "mounts": mounts,
                    "hostname": pod.hostname,
                    "dns": str(pod.directory / "dns"),
                    "workdir": container.get("workingDir") or image.workdir,
                    "env": env,
                    "argv": argv,
                    "user": {
                        "uid": user.uid,
                        "gid": user.gid,
                        "groups": list(user.groups),
                        "name": user.name,
                        "home": user.home,
                    },
                }
            )
        )
        pod.events.append(
            {"type": "Normal", "reason": "Started", "message": f"started container {container['name']}"}
        )
        return ContainerRun(
            container["name"],
            argv,
            env,
            spec_path,
            pod.directory / f"{container['name']}.log",
            on_exit=self._write_hosts,
            user=user,
        )

    def delete_pod(self, namespace: str, name: str) -> None:
        pod = self.pods.pop((namespace, name), None)
        if pod is None:
            return
        self._write_hosts()
        self._record(pod, "deleted")  # before the kill: a server still running was not a failure
        for run in list(pod.containers.values()):
            run.kill()
        with self.lock:
            self._addresses.discard(pod.ip)  # free once nothing of the pod listens on it
        shutil.rmtree(pod.directory / "rootfs", ignore_errors=True)

    def _record(self, pod: LocalPod, what: str) -> None:
        labels = pod.manifest["metadata"].get("labels") or {}
        base = pod.containers.get(pod.manifest["spec"]["containers"][0]["name"])
        self.history.append(
            {
                "event": what,
                "pod": pod.name,
                "task_id": labels.get("task_id"),
                "dag_id": labels.get("dag_id"),
                "run_id": labels.get("run_id"),
                "node": pod.node,
                "exit_code": base.exit_code if base else None,
                "exit_codes": {name: run.exit_code for name, run in pod.containers.items()},
                "image": pod.manifest["spec"]["containers"][0].get("image"),
            }
        )

    def shutdown(self) -> None:
        with self._reconciling:  # no StatefulSet creates pods from now on
            self._closed = True
        for namespace, name in list(self.pods):
            self.delete_pod(namespace, name)
        if self.api is not None:
            self.api.stop()
            self.api = None
        self._network_lock.close()  # the block is free for another cluster

    def pods_run(self) -> list[dict[str, Any]]:
        """One row per pod that was deleted after running, in order."""
        return [row for row in self.history if row["event"] == "deleted"]


def _reserve_network_block() -> tuple[IO[str], ipaddress.IPv4Address]:
    """The first network block 127.N.0.0/16 no other cluster holds, and the open lock file that holds it."""
    NETWORK_LOCKS.mkdir(parents=True, exist_ok=True)
    for block in NETWORK_BLOCKS:
        handle = open(NETWORK_LOCKS / f"{block}.lock", "w")  # noqa: SIM115 (held while the cluster lives)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return handle, ipaddress.IPv4Address(f"127.{block}.0.0")
    raise ClusterError(f"every local cluster network block is held (locks in {NETWORK_LOCKS})")


def _storage_limits(
    spec: dict[str, Any], volumes: dict[str, dict[str, Any]]
) -> tuple[int | None, dict[str, int]]:
    """What the kubelet holds a pod's local storage to: the sum of its containers' ephemeral-storage limits
    (None when one has none), and each disk-backed emptyDir's sizeLimit."""
    limits = [
        ((c.get("resources") or {}).get("limits") or {}).get("ephemeral-storage") for c in spec["containers"]
    ]
    total = None if None in limits else int(sum(_quantity(str(limit)) for limit in limits))
    sized = {name: int(v["size"]) for name, v in volumes.items() if v.get("disk") and v.get("size")}
    return total, sized


def _storage_requests(spec: dict[str, Any]) -> int:
    """The sum of a pod's containers' ephemeral-storage requests (a container with only a limit requests
    its limit, as the API server defaults it)."""
    total = 0.0
    for container in spec["containers"]:
        resources = container.get("resources") or {}
        wanted = (resources.get("requests") or {}).get("ephemeral-storage") or (
            resources.get("limits") or {}
        ).get("ephemeral-storage")
        total += _quantity(str(wanted)) if wanted else 0.0
    return int(total)


def _local_storage_used(pod: LocalPod) -> dict[str, int]:
    """What a pod holds on its node's disk, by where: each disk-backed emptyDir by its name, and its running
    containers' writable layers (their /tmp here) together under "writable layers"."""
    used = {name: _bytes_under(Path(v["source"])) for name, v in pod.volumes.items() if v.get("disk")}
    used["writable layers"] = sum(_writable_layer_bytes(run) for run in _running(pod))
    return used


def _writable_layer_bytes(run: ContainerRun) -> int:
    """The bytes in a running container's /tmp, its fresh tmpfs (container.py); 0 while its first process
    has not entered its root yet (its /tmp is then still this machine's, another filesystem), and once that
    process has exited (its tmpfs went with its mount namespace). Never waits: the kubelet's storage walks
    run every second over every pod, and a container that exits between listing and walking is usual."""
    pid = run.first_pid()
    if pid is None:
        return 0
    tmp = Path(f"/proc/{pid}/root/tmp")
    try:
        if tmp.stat().st_dev == Path("/tmp").stat().st_dev:
            return 0
    except OSError:  # exited meanwhile
        return 0
    return _bytes_under(tmp)


def _bytes_under(path: Path) -> int:
    """The bytes of the files under `path` on its own filesystem (0 once it is gone), as `du -x` counts them:
    a mount inside it (the image's files bound into a container's /tmp when the project lives under /tmp)
    is not what the pod wrote, and the kubelet does not count it."""
    try:
        device = path.stat().st_dev
    except OSError:
        return 0
    total = 0
    for directory, subdirectories, files in os.walk(path):
        subdirectories[:] = [
            name for name in subdirectories if _on_device(os.path.join(directory, name), device)
        ]
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    return total


def _on_device(path: str, device: int) -> bool:
    try:
        return os.lstat(path).st_dev == device
    except OSError:  # removed meanwhile
        return False


def _running(pod: LocalPod) -> list[ContainerRun]:
    return [run for run in list(pod.containers.values()) if run.running]


def _filesystem(volume: dict[str, Any]) -> str:
    """The filesystem a PersistentVolume names, as a directory name: its CSI driver and volumeHandle, or
    its NFS server and path."""
    spec = volume["spec"]
    if "csi" in spec:
        source = f"{spec['csi']['driver']}-{spec['csi']['volumeHandle']}"
    elif "nfs" in spec:
        source = f"nfs-{spec['nfs']['server']}-{spec['nfs']['path']}"
    else:
        raise ClusterError(f"volume {volume['metadata']['name']}: only csi and nfs volumes are stores here")
    return re.sub(r"[^A-Za-z0-9.-]", "_", source)


def _env_value(pod: LocalPod, container: str, variable: dict[str, Any], defined: Mapping[str, str]) -> str:
    """An env entry's value: `value` expanded with the variables defined before it, or a fieldRef's field."""
    source = variable.get("valueFrom")
    if source is None:
        return expand_variables(variable.get("value") or "", defined)
    if set(source) != {"fieldRef"}:
        raise ClusterError(
            f"container {container}: env {variable['name']} uses valueFrom {sorted(source)}, which "
            "the local cluster does not resolve (fieldRef only)"
        )
    return pod.field_value(source["fieldRef"]["fieldPath"])


def _with_completion_index(spec: dict[str, Any]) -> dict[str, Any]:
    """The pod spec with JOB_COMPLETION_INDEX, from the pod's index annotation, in every container (init
    containers too) that does not set it itself, as the Job controller adds it."""
    variable = {
        "name": "JOB_COMPLETION_INDEX",
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{JOB_INDEX_KEY}']"}},
    }
    for container in [*spec["containers"], *(spec.get("initContainers") or [])]:
        env = container.get("env") or []
        if all(entry["name"] != variable["name"] for entry in env):
            container["env"] = [*env, variable]
    return spec


def _own_names(pod: LocalPod) -> list[str]:
    """The names the kubelet gives a pod's own address in its /etc/hosts."""
    subdomain = pod.manifest["spec"].get("subdomain")
    full = [f"{pod.hostname}.{subdomain}.{pod.namespace}.svc.cluster.local"] if subdomain else []
    return [*full, pod.hostname]


def _hosts_text(entries: list[tuple[str, list[str], bool]]) -> str:
    """A hosts file: localhost, then each address with its names. A unique name is on its first line only (the
    same name twice is one hostname and subdomain twice in a namespace, an orphaned Job pod and its
    successor's: the older keeps it, where cluster DNS would answer both addresses); a Service's name is on
    the line of each address it selects, and resolves to all of them (glibc with `multi on`, Debian's
    /etc/host.conf, as the pods' system directories are this machine's)."""
    taken, lines = {"localhost"}, ["127.0.0.1 localhost"]
    for address, names, unique in entries:
        fresh = [name for name in names if name not in taken] if unique else names
        taken.update(fresh)
        if fresh:
            lines.append(" ".join([address, *fresh]))
    return "\n".join(lines) + "\n"


def _replace(path: Path, text: str) -> None:
    """Write a file by renaming a new one over it: a reader sees the whole old file or the whole new one. Not
    flushed to disk: the cluster's files last as long as it does, and pods wait on their DNS being written."""
    with atomic_write(path, durable=False) as partial:
        partial.write_text(text)


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
            [
                "nsenter",
                "--target",
                str(run.init_pid()),
                "--mount",
                "--uts",
                "--pid",
                "--root",
                "--wd",
                # as the container's own user, as `kubectl exec` runs
                f"--setgid={run.user.gid}",
                f"--setuid={run.user.uid}",
                "--",
                *command,
            ],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=run.env,
        )
        self._out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [
            threading.Thread(target=self._read, args=(channel,), daemon=True) for channel in self._out
        ]
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
            finished_at = run.finished_at  # None while it runs
            state = (
                {"running": {"startedAt": _timestamp(run.started_at)}}
                if finished_at is None
                else {
                    "terminated": {
                        "exitCode": run.exit_code,
                        "reason": "Completed" if run.exit_code == 0 else "Error",
                        "startedAt": _timestamp(run.started_at),
                        "finishedAt": _timestamp(finished_at),
                    }
                }
            )
            statuses.append(
                {
                    "name": container["name"],
                    "image": container.get("image"),
                    "imageID": "",
                    "ready": pod.container_ready(container["name"]),
                    "restartCount": 0,
                    "started": run.running,
                    "state": state,
                }
            )
        if pod.reason == "FailedScheduling":
            conditions = []
        elif pod.node is None:  # waiting for a node with room
            conditions = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
        else:
            ready = {"type": "Ready", "status": str(pod.ready())}
            conditions = [{"type": "PodScheduled", "status": "True"}, ready]
        status: dict[str, Any] = {
            "phase": pod.current_phase(),
            "startTime": _timestamp(pod.created_at),
            "podIP": pod.ip,
            "podIPs": [{"ip": pod.ip}],
            "conditions": conditions,
        }
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
        pods = [
            self._pod_model(pod)
            for (ns, _), pod in list(self.cluster.pods.items())
            if ns == namespace
            and _label_selector_matches(label_selector, pod.manifest["metadata"].get("labels") or {})
        ]
        return self._model(
            {"items": [self.api_client.sanitize_for_serialization(p) for p in pods]}, "V1PodList"
        )

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any], **kwargs):
        pod = self._pod(namespace, name)
        labels = (body.get("metadata") or {}).get("labels") or {}
        pod.manifest["metadata"].setdefault("labels", {}).update(labels)
        return self._pod_model(pod)

    def delete_namespaced_pod(self, name: str, namespace: str, **kwargs):
        self._pod(namespace, name)
        self.cluster.delete_pod(namespace, name)

    def read_namespaced_pod_log(
        self,
        name: str,
        namespace: str,
        container: str | None = None,
        follow: bool = False,
        timestamps: bool = False,
        since_seconds: int | None = None,
        **kwargs,
    ):
        pod = self._pod(namespace, name)
        run = pod.containers.get(container or pod.manifest["spec"]["containers"][0]["name"])
        stream = LogStream(run, follow, timestamps, since_seconds)
        if kwargs.get("_preload_content", True):
            return stream.data.decode("utf-8")
        return stream

    def list_namespaced_event(self, namespace: str, field_selector: str | None = None, **kwargs):
        name = (field_selector or "").partition("involvedObject.name=")[2]
        pod = self.cluster.pods.get((namespace, name))
        items = [
            {
                "metadata": {"name": f"{name}.{i}", "uid": f"{name}-{i}", "resourceVersion": str(i)},
                "involvedObject": {"kind": "Pod", "name": name, "namespace": namespace},
                "reason": event["reason"],
                "message": event["message"],
                "type": event["type"],
            }
            for i, event in enumerate(pod.events if pod else [])
        ]
        return self._model({"items": items, "metadata": {}}, "CoreV1EventList")

    def connect_get_namespaced_pod_exec(
        self,
        name: str,
        namespace: str,
        container: str | None = None,
        command: list[str] | None = None,
        stdin: bool = False,
        **kwargs,
    ):
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

    # rebinding the provider's class on purpose (mypy refuses an assignment to a class name)
    setattr(pod_operator, "KubernetesHook", LocalClusterHook)  # noqa: B010
