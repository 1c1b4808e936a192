"""The production rehearsal: the Kubernetes + Kimi-K2.5 path, end to end, on this machine.

    python -m harness.rehearsal [--workspace DIR] [--keep]      (make rehearsal)

What runs, in the order docs/RUNBOOK.md gives it to a user:
1. the cluster objects: the runbook's install manifests applied to a local cluster (harness.cluster: pods
   run in containers of their own, with only their env, their volumes and the image's files, each image as
   its Dockerfile builds it (harness.image_build), not the repository; a pod holds the GPUs it requests from
   binding on, and nothing holds one once the install is applied; pods call its API over HTTPS as their
   service accounts, under the manifests' RBAC); the weights volume holds a
   tiny Kimi-like target under
   /models/Kimi-K2.5, the prompts volume ShareGPT/UltraChat-style files, the run-config volume
   configs/rehearsal.yaml as kimi-k2.5.yaml (configs/deployment/kubernetes.yaml's run_config);
2. S3 and IAM: the bucket on a local S3 server (127.0.0.1), reached by pods through IAM roles for their
   service accounts; no access key exists anywhere;
3. the SGLang generation and capture fleets: the StatefulSets of infra/k8s/sglang-generate.yaml and
   sglang-capture.yaml at 0 replicas; their pods run stand-in servers (SGLang needs CUDA) with the
   manifests' flags, the capture servers' aux layers being the tiny target's. drafter_data scales each
   fleet up before its stage and back to 0 after it, from its own task pods;
4. Airflow with `DRAFTER_DEPLOYMENT=configs/deployment/kubernetes.yaml`, unchanged but for its
   retry_delay_seconds (REHEARSAL_RETRY_DELAY_S: the retried training task waits seconds, not minutes), its
   fleets' ready timeouts (sized for the tiny target) and its deadlines, which dag.test() cannot run
   (`rehearsal_deployment`): every
   `@task.kubernetes` task is rendered and run by the cncf provider's own code against the local
   cluster. drafter_data publishes the dataset Asset; drafter_train, given the Asset's dataset, trains,
   gates, benchmarks (the SGLang runner, its servers started in the benchmark's own pod) and promotes
   into S3; a run with a broken config fails at once without a retry; a second drafter_data run captures
   in-process (IN_PROCESS_CAPTURE: its parity and capture pods placed on the GPU node in the SGLang image
   by the deployment's engines, each a job of 2 ranks); a cron-scheduled drafter_train run (no trigger
   form) trains on the newest dataset, that one, with the deployment's run config;
5. serving: the `kimi-k2-5-eagle3` Deployment, applied once the first promotion landed (§2.6), its
   replica (one here: `sized_for_the_tiny_target`) made by the local cluster's Deployment controller as
   the manifest states it: its init container runs `drafter pull` with the read-only role, and the server
   starts with exactly the flags the pull wrote; restarts roll it as the manifest's strategy says;
6. alerts: the deployment's notifiers deliver to a local HTTP sink (their connections from the
   environment); the promotion reaches Slack with its pull command, the broken run's failed task reaches
   Slack and the pager, and no notifier secret is in an Airflow log; the OpenLineage events of the pod
   tasks link the prompts to the promoted drafter version.
The last line printed is `rehearsal=passed`, after the stages and pods that ran.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from harness.cluster import ImageUser, LocalCluster, LocalImage, LocalNode, LocalPod, use_local_cluster
from harness.json_http import free_port
from pipeline.config import TinyTargetRecipe
from pipeline.config_base import PROJECT_ROOT
from pipeline.retrying import await_health

log = logging.getLogger("drafter.rehearsal")

DEPLOYMENT = PROJECT_ROOT / "configs" / "deployment" / "kubernetes.yaml"
REHEARSAL_RETRY_DELAY_S = 5
FLEET_READY_TIMEOUT_S = 240
REHEARSAL_CONFIG = PROJECT_ROOT / "configs" / "rehearsal.yaml"
SHIM = Path(__file__).resolve().parent / "sglang_shim"
WITHOUT_AIRFLOW = Path(__file__).resolve().parent / "image_without_airflow"
HARNESS = Path(__file__).resolve().parent
# the SGLang image's stand-ins time requests by a modelled device (harness.sglang_standin.DeviceClock): a
# target forward 25 ms, a draft step a tenth of that (a one-layer drafter on a 61-layer target), about 3x
# what the tiny target's forward takes this CPU. Timed by this machine's CPU, the benchmark's servers, one
# after another, measured load that changed between them, not the drafters: the cron run's candidate,
# 1.3-1.4x its incumbent (a quiet machine; this clock), was measured slower than it under the suite's load.
STANDIN_DEVICE_CLOCK = "forward_ms=25,draft_ms=2.5"
BUCKET = "drafter-pipeline"
ACCOUNT = "123456789012"
# the tiny Kimi-like target: DeepSeek-V3 architecture (MLA + MoE), its own code and tiktoken tokenizer
TARGET_RECIPE = TinyTargetRecipe(
    architecture="deepseek_v3",
    num_layers=8,
    hidden_size=64,
    num_heads=4,
    intermediate_size=192,
    vocab_size=1024,
    seq_len=96,
    batch_size=16,
    train_steps=200,
    learning_rate=0.008,
    max_corpus_modules=60,
)
# a plain server the rehearsal itself compares the serving pod's output with (not part of the cluster)
FLEETS = {"generate": "sglang-generate", "capture": "sglang-capture-aux"}
# the first training run: 2 nodes x 1 rank, the Indexed Job of infra/k8s/trainer-workers.yaml (sized: one
# rank per node), from the run-config volume where the train pod reads it
TRAINER_JOB = "drafter-trainer"
TRAINER_MANIFEST = "/etc/drafter/trainer-workers.yaml"
# the trigger form's overrides; the node pods' manifest (TRAINER_MANIFEST) is the run config's
# train.kubernetes_job, as a form may not name the pods' commands (pipeline.config.CODE_SETTINGS)
MULTI_NODE = [
    "train.nodes=2",
    "train.nproc=1",
    "train.launcher=kubernetes",
]
SERVING_PORT = 30000
# a second drafter_data run captures in-process (capture.engine inprocess): the target in the capture pod,
# placed on the GPU node in the SGLang image by the deployment's engines, as a job of 2 tensor-parallel
# ranks (the local runner over the tiny target: SGLang needs CUDA); the cron run then trains on its dataset
IN_PROCESS_CAPTURE = [
    "capture.engine=inprocess",
    "capture.inprocess.runner=local",
    "capture.inprocess.tp_size=2",
]


class RehearsalFailed(RuntimeError):
    pass


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise RehearsalFailed(what)
    log.info("ok: %s", what)


def _images(workspace: Path) -> dict[str, LocalImage]:
    """The images of configs/deployment/kubernetes.yaml, each as its Dockerfile builds it
    (harness/image_build: only the files its COPY lines bring, the project pip-installed from them, not
    editable, into a Python environment of its own, its WORKDIR, USER and ENV), built under `workspace`.
    Where this machine differs from the image's, and why:
    - the SGLang image's `sglang` is the stand-in (harness/sglang_shim, with the harness beside it, which
      this image alone sees): SGLang's EAGLE3 serving and the MLA target need CUDA (docs/BENCHMARKS.md,
      issue 56); its requests take a modelled GPU's time
      (STANDIN_DEVICE_CLOCK), not this shared CPU's;
    - the vLLM image's vLLM is vLLM's CPU build (`.venv-vllm`) at /opt/drafter/.venv-vllm, where
      docker/vllm.Dockerfile puts its GPU build;
    - DS_ACCELERATOR is `cpu`: the Dockerfiles' `cuda` names the GPU nodes' accelerator, which this
      machine's nodes do not have;
    - only the pipeline image has Airflow (its Dockerfile builds FROM apache/airflow): in the others
      harness/image_without_airflow comes first on the path, so `import airflow` fails, as there."""
    from airflow.providers.cncf.kubernetes.utils.xcom_sidecar import PodDefaults

    from harness import image_build
    from harness.sglang_standin import DEVICE_CLOCK_ENV

    deployment = yaml.safe_load(DEPLOYMENT.read_text())["kubernetes"]["images"]
    python_home = str(Path(sys.base_prefix).resolve())
    sglang_extra = {"/opt/sglang-shim": str(SHIM), "/opt/sglang-harness/harness": str(HARNESS)}
    extra = {
        "sglang": (sglang_extra, ("/opt/sglang-shim", "/opt/sglang-harness")),
        "vllm": ({"/opt/drafter/.venv-vllm": str(PROJECT_ROOT / ".venv-vllm")}, ()),
    }

    def image(name: str) -> LocalImage:
        dockerfile = PROJECT_ROOT / "docker" / f"{name}.Dockerfile"
        built = image_build.build(name, workspace / "images" / name, dockerfile)
        extra_files, python_path = extra.get(name, ({}, ()))
        if not dockerfile_installs_airflow(dockerfile):
            extra_files = {"/opt/without-airflow": str(WITHOUT_AIRFLOW), **extra_files}
            python_path = ("/opt/without-airflow", *python_path)
        built.make_mount_points(extra_files)
        env = {key: value for key, value in built.steps.env.items() if key != "PATH"}
        env |= {
            "PATH": f"{built.bin}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "DS_ACCELERATOR": "cpu",
            # Pods share this machine's cores as pods share a node: one OpenMP thread each unless this
            # machine's environment says otherwise. Several processes at once, each with a thread per core,
            # stall at OpenMP barriers (two side by side ran 3x slower than with one thread each).
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        if python_path:
            env["PYTHONPATH"] = ":".join(python_path)
        if name == "sglang":
            env[DEVICE_CLOCK_ENV] = STANDIN_DEVICE_CLOCK
        files = {**built.files, python_home: python_home, **extra_files}
        return LocalImage(files, built.steps.workdir, env, (), dockerfile_user(dockerfile))

    sidecar = LocalImage({}, "/", {"PATH": "/usr/bin:/bin"})  # alpine, as root
    return {
        **{deployment[name]: image(name) for name in ("pipeline", "trainer", "sglang", "vllm")},
        PodDefaults.SIDECAR_CONTAINER.image: sidecar,
    }


# The users of the base images the Dockerfiles build FROM: apache/airflow's `airflow` is uid 50000 in group
# 0 (the root group), home /home/airflow (Airflow's "Docker image" docs, "Arbitrary docker user")
BASE_IMAGE_USERS = {"airflow": ImageUser(50000, 0, "airflow", "/home/airflow")}


def dockerfile_user(path: Path) -> ImageUser:
    """The user a built image runs as: its Dockerfile's last USER (root without one), by name or uid,
    resolved through the Dockerfile's own `useradd` lines or the base image's users."""
    import shlex

    text = path.read_text().replace("\\\n", " ")
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    if not users:
        return ImageUser()
    wanted = users[-1].split(":")[0]
    added = {}
    for line in text.splitlines():
        words = shlex.split(line.partition("useradd")[2]) if "useradd" in line else []
        if words:
            options = dict(zip(words[:-1:2], words[1:-1:2], strict=False))
            uid, name = int(options["--uid"]), words[-1]
            added[name] = added[str(uid)] = ImageUser(
                uid, int(options.get("--gid", uid)), name, options.get("--home-dir", f"/home/{name}")
            )
    known = {**BASE_IMAGE_USERS, **added}
    if wanted in known:
        return known[wanted]
    if wanted.isdigit():
        return ImageUser(int(wanted), 0, f"uid{wanted}", "/")
    raise RehearsalFailed(f"{path.name}: USER {wanted} is none its Dockerfile or base image creates")


def dockerfile_installs_airflow(path: Path) -> bool:
    """Whether a built image has Apache Airflow: its Dockerfile builds FROM apache/airflow or pip-installs
    the project's `airflow` extra."""
    text = path.read_text()
    return bool(re.search(r"^FROM apache/airflow:", text, re.M) or re.search(r"\.\[[^]]*airflow", text))


GPU_NODE_PREFIX = "gpu-node-"
NODES = (
    LocalNode(
        "cpu-node",
        {"kubernetes.io/os": "linux"},
        (),
        {"cpu": "64", "memory": "512Gi", "ephemeral-storage": "900Gi"},
    ),
    # 8 x H200 nodes as cloud providers offer them (p5en.48xlarge: 8 x 3.84 TB of local NVMe), GPUs tainted
    # for GPU pods only: four, more than the rehearsal holds at once (the serving replica beside a stage's
    # two: the generation fleet's servers or the training Job's nodes). A pod counts its requests against
    # its node from the moment it is bound, so a pod that holds GPUs idle leaves another Pending.
    *(
        LocalNode(
            f"{GPU_NODE_PREFIX}{index}",
            {"kubernetes.io/os": "linux", "nvidia.com/gpu.product": "NVIDIA-H200"},
            ({"key": "nvidia.com/gpu", "effect": "NoSchedule"},),
            {"cpu": "192", "memory": "2048Gi", "nvidia.com/gpu": "8", "ephemeral-storage": "28Ti"},
        )
        for index in range(4)
    ),
)


RUNBOOK = PROJECT_ROOT / "docs" / "RUNBOOK.md"
REHEARSED, REAL_CLUSTER = "# [rehearsed]", "# [real cluster]"


def runbook_commands(marker: str = REHEARSED, section: str | None = None) -> list[str]:
    """The commands docs/RUNBOOK.md gives a user, marked with `marker`, in the runbook's order (those of its
    `## <section>` only, when given: "1." is Deploy)."""
    lines = RUNBOOK.read_text().splitlines()
    if section is not None:
        starts = [i for i, line in enumerate(lines) if line.startswith(f"## {section}")]
        if len(starts) != 1:
            raise RehearsalFailed(f"docs/RUNBOOK.md has {len(starts)} sections '## {section}'")
        after = [i for i, line in enumerate(lines) if line.startswith("## ") and i > starts[0]]
        lines = lines[starts[0] : after[0] if after else len(lines)]
    return [line.split(marker)[0].strip() for line in lines if line.rstrip().endswith(marker)]


class Runbook:
    """The runbook's [rehearsed] commands, each run the way this machine can: `drafter` commands exactly
    as written, `kubectl apply` and `aws s3api` as the same calls to the local cluster and S3 server,
    `airflow` commands with the rehearsal's Airflow. Every one of them must have run by the end."""

    HANDLED = (
        "aws s3api",
        "kubectl apply",
        "kubectl -n airflow exec",
        "curl",
        "drafter ",
        "kubectl -n sglang set env",
        "kubectl -n sglang scale",
        "kubectl -n sglang rollout status",
        "kubectl -n drafter logs",
        "kubectl -n drafter wait",
        "kubectl -n airflow exec deploy/airflow-triggerer",
        "kubectl -n airflow create configmap",
    )

    def __init__(self, handlers: dict[str, Any]):
        if set(handlers) != set(self.HANDLED):
            raise RehearsalFailed(f"runbook handlers {sorted(handlers)} differ from {sorted(self.HANDLED)}")
        self.handlers = handlers
        self.commands = runbook_commands()
        self.ran: list[str] = []

    def run(self, command: str, **values: str) -> str:
        if command not in self.commands:
            raise RehearsalFailed(f"docs/RUNBOOK.md gives no [rehearsed] command {command!r}")
        literal = command
        for name, value in values.items():
            literal = literal.replace(f"<{name}>", value)
        handler = next((h for prefix, h in self.handlers.items() if command.startswith(prefix)), None)
        if handler is None:
            raise RehearsalFailed(f"the rehearsal has no way to run the runbook's {command!r}")
        output = handler(literal)
        self.ran.append(command)
        log.info("runbook: %s", literal)
        return output

    def missed(self) -> list[str]:
        """The runbook's [rehearsed] commands not run (as often as the runbook gives them)."""
        from collections import Counter

        return list((Counter(self.commands) - Counter(self.ran)).elements())


def run_drafter(command: str) -> str:
    """A `drafter ...` command of the runbook, as written, where the Airflow worker runs (its identity)."""
    import shlex

    argv = shlex.split(command)
    if (PROJECT_ROOT / ".venv").is_dir():
        argv[0] = str(PROJECT_ROOT / ".venv" / "bin" / argv[0])
    return _output(argv, command, timeout=600, cwd=PROJECT_ROOT)


def _output(argv: list[str], shown: str, timeout: float, cwd: Path | None = None) -> str:
    """The standard output of a command that must succeed; `shown` names it when it fails."""
    out = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout)
    if out.returncode != 0:
        raise RehearsalFailed(f"`{shown}` exited {out.returncode}: {out.stderr[-2000:]}")
    return out.stdout


def start_s3() -> tuple[Any, str]:
    """The local S3 (and STS) server: AWS's endpoints for everything in the rehearsal."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def aws_s3api(endpoint: str):
    """`aws s3api` as the runbook's bucket owner runs it: the same S3 calls."""
    import shlex

    import boto3

    admin = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bucket-owner",
        aws_secret_access_key="bucket-owner",
    )

    def run(command: str) -> str:
        argv = shlex.split(command)
        options = dict(zip(argv[3::2], argv[4::2], strict=True))
        bucket = options["--bucket"]
        if argv[2] == "create-bucket":
            admin.create_bucket(Bucket=bucket)
        elif argv[2] == "put-bucket-policy":
            policy = _file_argument(options["--policy"]).replace("ACCOUNT_ID", ACCOUNT)
            admin.put_bucket_policy(Bucket=bucket, Policy=policy)
        elif argv[2] == "put-bucket-lifecycle-configuration":
            rules = json.loads(_file_argument(options["--lifecycle-configuration"]))
            admin.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration=rules)
        else:
            raise RehearsalFailed(f"no S3 call for `{command}`")
        return ""

    return run


def _file_argument(value: str) -> str:
    return (PROJECT_ROOT / value.removeprefix("file://")).read_text()


def kubectl_apply(cluster: LocalCluster, workspace: Path):
    def run(command: str) -> str:
        argv = command.split()
        files = [PROJECT_ROOT / argv[i + 1] for i, arg in enumerate(argv) if arg == "-f"]
        created = [obj for path in files for obj in cluster.apply(sized_for_the_tiny_target(path, workspace))]
        return "\n".join(created)

    return run


def sized_for_the_tiny_target(path: Path, workspace: Path) -> Path:
    """The manifest as applied here. Three things differ, all for size only: the capture servers return the
    aux layers of the tiny target's contract (Kimi's 1 29 57 do not exist in an 8-layer model), readiness
    probes start at once and come every second (`probe_timing_for_the_tiny_target`), and the serving
    Deployment has one replica: each replica's probe runs a generation every second, and a second one on
    this 2-core machine slowed the cron run's benchmark until its drafter was refused as slower (CI, at
    1a2076e). Its rollouts keep the manifest's strategy."""
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == ServingDeployment.NAME:
            doc["spec"]["replicas"] = 1
        for container in _template_containers(doc):
            probe_timing_for_the_tiny_target(container)
            args = container.get("args") or []
            if "--return-aux-hidden-state-layer-ids" in args:
                aux_ids = _tiny_target_aux_flag_ids()
                at = args.index("--return-aux-hidden-state-layer-ids") + 1
                args[at : at + len(aux_ids)] = [str(i) for i in aux_ids]
    sized = workspace / "manifests" / path.name
    sized.parent.mkdir(parents=True, exist_ok=True)
    sized.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return sized


def _template_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def probe_timing_for_the_tiny_target(container: dict[str, Any]) -> None:
    """A readiness probe's first GET at once and one a second: the manifests wait 300 s and probe every
    15 s for Kimi-K2.5 loading onto GPUs, the stand-in loads the tiny target in seconds. timeoutSeconds
    and the thresholds stay as written: they are about how a server answers, not how big its model is."""
    probe = container.get("readinessProbe")
    if probe is not None:
        probe.update(initialDelaySeconds=0, periodSeconds=1)


def _tiny_target_aux_flag_ids() -> list[int]:
    """--return-aux-hidden-state-layer-ids for the tiny target's contract, as SGLang reads the flag."""
    from pipeline.config import default_aux_layer_ids, load_config
    from pipeline.engines.layer_ids import TINY_TARGET_FAMILIES, draft_config_ids

    config = load_config(REHEARSAL_CONFIG)
    layers = config.capture.aux_layer_ids or default_aux_layer_ids(TARGET_RECIPE.num_layers)
    family = TINY_TARGET_FAMILIES[TARGET_RECIPE.architecture]
    return draft_config_ids("sglang", family, layers, TARGET_RECIPE.num_layers)


def one_rank_per_node(path: Path) -> str:
    """The node Job as the rehearsal runs it. Only its size differs: one rank per node, not 8."""
    job = yaml.safe_load(path.read_text())
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--nproc-per-node") + 1] = "1"
    return yaml.safe_dump(job, sort_keys=False)


def kubectl_scale(cluster: LocalCluster):
    """`kubectl -n NS scale statefulset/NAME --replicas=N`."""

    def run(command: str) -> str:
        argv = command.split()
        namespace, name = argv[argv.index("-n") + 1], argv[argv.index("scale") + 1].split("/", 1)[1]
        replicas = int(next(arg for arg in argv if arg.startswith("--replicas=")).split("=", 1)[1])
        cluster.scale_statefulset(namespace, name, replicas)
        return f"statefulset.apps/{name} scaled"

    return run


def kubectl_rollout_status(cluster: LocalCluster, serving: ServingDeployment):
    """`kubectl -n NS rollout status statefulset/NAME --timeout=...`: wait until every replica is ready;
    of deployment/NAME (the serving Deployment): until it rolled out."""

    def run(command: str) -> str:
        argv = command.split()
        kind, name = argv[argv.index("status") + 1].split("/", 1)
        if kind == "deployment":
            if name != serving.NAME:
                raise RehearsalFailed(f"{command}: the rehearsal's only Deployment is {serving.NAME}")
            return serving.rollout_status(command)
        namespace = argv[argv.index("-n") + 1]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = cluster.statefulset_status(namespace, name)
            if status["readyReplicas"] >= status["replicas"] > 0:
                return (
                    f"partitioned roll out complete: {status['readyReplicas']} new pods have been updated..."
                )
            time.sleep(1)
        raise RehearsalFailed(f"statefulset {namespace}/{name} was not ready within 300 s: {status}")

    return run


def kubectl_wait_for_job(cluster: LocalCluster):
    """`kubectl -n NS wait --for=condition=complete job/NAME --timeout=...`: until the Job completed; a Job
    that failed fails the rehearsal with its pods' logs."""

    def run(command: str) -> str:
        argv = command.split()
        namespace, name = argv[argv.index("-n") + 1], argv[-2].split("/", 1)[1]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = cluster.job_status(namespace, name)
            conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
            if conditions.get("Complete") == "True":
                return f"job.batch/{name} condition met"
            if conditions.get("Failed") == "True":
                pods = cluster.job_pods(namespace, name)
                logs = [path.read_text()[-2000:] for pod in pods for path in pod.directory.glob("*.log")]
                raise RehearsalFailed(f"job {namespace}/{name} failed: {status}\n" + "\n".join(logs))
            time.sleep(1)
        raise RehearsalFailed(f"job {namespace}/{name} did not complete within 300 s")

    return run


# The Airflow chart's values (infra/helm/airflow-values.yaml): its components' service accounts, and the
# triggerer's pod, as the chart renders them where the rehearsal needs them
HELM_VALUES = PROJECT_ROOT / "infra" / "helm" / "airflow-values.yaml"
HELM_ACCOUNTS = {  # component: the chart's default service account name
    "workers": "airflow-worker",
    "triggerer": "airflow-triggerer",
    "apiServer": "airflow-api-server",
    "scheduler": "airflow-scheduler",
    "dagProcessor": "airflow-dag-processor",
}


def helm_release(cluster: LocalCluster, workspace: Path) -> dict[str, Any]:
    """What `helm upgrade --install ... -n airflow --create-namespace -f infra/helm/airflow-values.yaml`
    makes that the rehearsal's pods meet: namespace airflow and each component's service account, with the
    annotations (IAM roles) the values give it, or none. Returns the values."""
    values = yaml.safe_load(HELM_VALUES.read_text())
    docs: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "airflow"}}]
    for component, default in HELM_ACCOUNTS.items():
        account = (values.get(component) or {}).get("serviceAccount") or {}
        meta = {"name": account.get("name") or default, "namespace": "airflow"}
        if account.get("annotations"):
            meta["annotations"] = account["annotations"]
        docs.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta})
    manifest = workspace / "manifests" / "airflow-release.yaml"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(yaml.safe_dump_all(docs))
    cluster.apply(manifest)
    return values


def triggerer_pod(values: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """A pod of the chart's triggerer Deployment, as its values make it, running `argv` (what `kubectl exec
    deploy/airflow-triggerer -- argv` runs there): namespace airflow, its service account, the Airflow
    image, the chart's `env`, its extra volumes and mounts, the chart's uid 50000 in group 0."""
    triggerer = values.get("triggerer") or {}
    image = values["images"]["airflow"]
    account = (triggerer.get("serviceAccount") or {}).get("name") or HELM_ACCOUNTS["triggerer"]
    container = {
        "name": "triggerer",
        "image": f"{image['repository']}:{image['tag']}",
        "command": argv,
        "env": list(values.get("env") or []),
        "volumeMounts": list(triggerer.get("extraVolumeMounts") or []),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"airflow-triggerer-{int(time.time() * 1000) % 10**8}", "namespace": "airflow"},
        "spec": {
            "serviceAccountName": account,
            "securityContext": {"runAsUser": 50000, "runAsGroup": 0, "fsGroup": 0},
            "restartPolicy": "Never",
            "containers": [container],
            "volumes": list(triggerer.get("extraVolumes") or []),
        },
    }


def exec_in_triggerer(cluster: LocalCluster):
    """`kubectl -n airflow exec deploy/airflow-triggerer -- CMD`: CMD in a pod of the triggerer as the Helm
    values give it (its namespace, account and role, mounts and env), which must succeed; its output."""

    def run(command: str) -> str:
        import shlex

        argv = shlex.split(command.split(" -- ", 1)[1])
        pod = cluster.create_pod(triggerer_pod(yaml.safe_load(HELM_VALUES.read_text()), argv))
        deadline = time.monotonic() + 300
        while pod.current_phase() in ("Pending", "Running") and time.monotonic() < deadline:
            time.sleep(0.5)
        logs = "\n".join(path.read_text() for path in sorted(pod.directory.glob("*.log")))
        cluster.delete_pod("airflow", pod.name)
        _check(
            pod.current_phase() == "Succeeded",
            f"`{command}` succeeded in the triggerer's pod:\n{logs[-4000:]}",
        )
        return "\n".join(line.split(" ", 1)[1] for line in logs.splitlines() if " " in line)

    return run


def kubectl_create_configmap(cluster: LocalCluster):
    """`kubectl -n NS create configmap NAME --from-file=KEY=PATH`: the ConfigMap, holding that file."""

    def run(command: str) -> str:
        argv = command.split()
        namespace, name = argv[argv.index("-n") + 1], argv[argv.index("configmap") + 1]
        directory = cluster.volume_dir("configmap", namespace, name)
        directory.mkdir(parents=True, exist_ok=True)
        for arg in argv:
            if arg.startswith("--from-file="):
                key, path = arg.removeprefix("--from-file=").split("=", 1)
                shutil.copyfile(path, directory / key)
        return f"configmap/{name} created"

    return run


def check_watches(runbook: Runbook, cluster: LocalCluster, serving: ServingDeployment) -> str:
    """`drafter watches` in the triggerer's pod, once the serving replica is listed under the headless
    Service the acceptance watch reads: both watches read what they watch, with the triggerer's own mounts
    and role, and the served revision is the one the production drafter was trained for."""
    from pipeline.retrying import poll_until

    replicas = len(serving.pods)

    def listed() -> bool:
        addresses = cluster.service_addresses("sglang", "kimi-k2-5-replicas")
        return all(pod.ip in addresses for pod in serving.pods)

    _check(
        poll_until(listed, 60, 0.5),
        f"the {replicas} serving replicas are listed under their headless Service",
    )
    out = runbook.run("kubectl -n airflow exec deploy/airflow-triggerer -- drafter watches")
    lines = [line for line in out.splitlines() if line.startswith(("served acceptance:", "target revision:"))]
    _check(
        any(line.startswith(f"served acceptance: {replicas} replica(s) read apart") for line in lines),
        f"the triggerer's acceptance watch reads each serving replica through their headless Service: {out}",
    )
    _check(
        any(line.startswith("target revision:") and line.endswith(": the same") for line in lines),
        f"the triggerer's revision watch reads the served revision and the registry: {out}",
    )
    return "watches (in the triggerer's pod): " + " | ".join(lines)


def airflow_command(command: str) -> str:
    """The `airflow ...` part of a `kubectl exec ... -- airflow ...`, run with the rehearsal's Airflow."""
    import shlex

    argv = shlex.split(command.split(" -- ", 1)[1])
    return _output([str(Path(sys.executable).with_name("airflow")), *argv[1:]], " ".join(argv), timeout=300)


# configs/deployment/kubernetes.yaml's notifiers, pointed at a local HTTP sink (harness/alert_sinks.py)
# that records what Slack and the pager would get. Their connections come from the environment, as a
# Kubernetes Secret gives them to Airflow's pods: under dag.test() Airflow 3.3.2 answered a task's lookup
# of a connection made with `airflow connections add` with not-found (seen in this rehearsal, cause not
# found), while the running Airflow of tests/system/test_airflow_live.py finds connections made over its
# REST API.
SLACK_TOKEN, WEBHOOK_TOKEN = "T0REHEARSE/B0ALERTS/rehearsal-slack-6a1f", "rehearsal-pager-token-93d0"


def start_alert_sink(workspace: Path, processes: list[subprocess.Popen]) -> Path:
    """The HTTP sink the Slack and webhook notifiers deliver to, and their connections to it; where the
    sink records the requests it gets."""
    port, requests_file = free_port(), workspace / "alerts.jsonl"
    command = [sys.executable, "-m", "harness.alert_sinks", "http", "--port", str(port)]
    processes.append(subprocess.Popen([*command, "--out", str(requests_file)], cwd=PROJECT_ROOT))
    _check(await_health(f"http://127.0.0.1:{port}", 60), "the alert sink listens")
    connections = {
        "DRAFTER_SLACK": {
            "conn_type": "slackwebhook",
            "host": f"http://127.0.0.1:{port}/slack",
            "password": SLACK_TOKEN,
        },
        "DRAFTER_WEBHOOK": {
            "conn_type": "http",
            "host": "127.0.0.1",
            "port": port,
            "schema": "http",
            "extra": {"Authorization": f"Bearer {WEBHOOK_TOKEN}"},
        },
    }
    for name, connection in connections.items():
        os.environ[f"AIRFLOW_CONN_{name}"] = json.dumps(connection)
    return requests_file


def delivered_alerts(requests_file: Path) -> dict[str, list]:
    """What the sink got, by notifier: Slack's texts and the pager's JSON bodies (each with its token)."""
    entries = (
        [json.loads(line) for line in requests_file.read_text().splitlines()]
        if requests_file.exists()
        else []
    )
    return {
        "slack": [json.loads(e["body"])["text"] for e in entries if e["path"] == f"/slack/{SLACK_TOKEN}"],
        "pager": [
            json.loads(e["body"])
            for e in entries
            if e["path"] == "/v1/alerts/drafter"
            and e["headers"].get("Authorization") == f"Bearer {WEBHOOK_TOKEN}"
        ],
    }


def check_alerts(requests_file: Path, promoted_version: str, broken, airflow_home: Path) -> str:
    """The promotion reached Slack with its pull command; the failed configure task reached Slack and the
    pager; no notifier secret is in any Airflow log."""
    alerts = delivered_alerts(requests_file)
    promotion = [text for text in alerts["slack"] if f"version {promoted_version} is now production" in text]
    _check(
        len(promotion) == 1
        and f"--alias {promoted_version} --dest ./drafters/kimi-k2.5/{promoted_version}" in promotion[0]
        and "pull: drafter pull --config /etc/drafter/kimi-k2.5.yaml" in promotion[0],
        f"the promotion of {promoted_version} reached Slack with its pull command",
    )
    failed = [
        hook for hook in alerts["pager"] if hook["event"] == "failure" and hook["run_id"] == broken.run_id
    ]
    _check(
        len(failed) == 1
        and failed[0]["task_id"] == "configure"
        and "It exited 2: bad input (a config" in failed[0]["error"],
        f"the failed configure task of {broken.run_id} reached the pager, with its error",
    )
    _check(
        any("task configure failed" in text and broken.run_id in text for text in alerts["slack"]),
        "the failed configure task reached Slack",
    )
    _check(
        not any(hook["event"] == "promotion" for hook in alerts["pager"]),
        "the pager takes only the events it names (failure, deadline)",
    )
    logs = "\n".join(path.read_text(errors="replace") for path in airflow_home.rglob("*.log"))
    _check(SLACK_TOKEN not in logs and WEBHOOK_TOKEN not in logs, "no notifier secret is in an Airflow log")
    return (
        f"alerts: {len(alerts['slack'])} to Slack, {len(alerts['pager'])} to the pager "
        f"(promotion of {promoted_version}; {broken.run_id}'s configure failure)"
    )


def capture_server_info(cluster: LocalCluster):
    """`curl --retry N --retry-all-errors --retry-delay S` of a capture server's /server_info, by its pod's
    DNS name (resolved as long as curl retries), with the fields the runbook names."""

    def run(command: str) -> str:
        from urllib.parse import urlsplit

        from pipeline.retrying import poll_until

        argv = command.split()
        url = urlsplit(argv[-1])
        host = url.hostname
        if host is None:
            raise RehearsalFailed(f"`{command}` names no host to ask")
        retries = int(argv[argv.index("--retry") + 1]) if "--retry" in argv else 0
        delay = float(argv[argv.index("--retry-delay") + 1]) if "--retry-delay" in argv else 1.0
        poll_until(lambda: cluster.address_of(host) is not None, retries * delay, delay)
        address = cluster.address_of(host)
        _check(address is not None, f"{host} resolves to a running pod")
        return _checked_server_info(f"http://{address}:{url.port}{url.path}")

    return run


def _checked_server_info(url: str) -> str:
    import requests

    info = requests.get(url, timeout=30).json()
    _check(
        info.get("enable_return_aux_hidden_states") is True
        and info.get("disable_radix_cache") is True
        and info.get("chunked_prefill_size") == -1
        and str(info.get("version", "")).startswith("0.5.23"),
        f"the capture server reports the settings the runbook asks for: {info}",
    )
    return json.dumps(info)


def worker_identity(workspace: Path, endpoint: str) -> None:
    """This process is the Airflow worker: the identity its service account's role gives it (IRSA)."""
    token = workspace / "airflow-worker-token"
    token.write_text("local-web-identity-token-airflow-worker")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(name, None)
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ROLE_ARN": f"arn:aws:iam::{ACCOUNT}:role/drafter-pipeline-writer",
            "AWS_WEB_IDENTITY_TOKEN_FILE": str(token),
            "AWS_ROLE_SESSION_NAME": "airflow-worker",
        }
    )


def fill_volumes(cluster: LocalCluster, cache: Path) -> Path:
    """What the runbook has the user put on the volumes: the weights, the prompt files, the run config."""
    from pipeline.engines.tiny_target import ensure_tiny_target

    model = ensure_tiny_target(TARGET_RECIPE, cache)
    # into the model store, once, through the task pods' claim, as a user copies weights (files of their
    # own umask's modes); the SGLang servers' claim reads them only if it is bound to the same filesystem
    weights = cluster.volume_dir("pvc", "drafter", "kimi-k2-5-weights")
    shutil.copytree(model, weights / "Kimi-K2.5", dirs_exist_ok=True, copy_function=shutil.copyfile)
    downloaded_at(weights / "Kimi-K2.5", hashlib.sha1((model / "config.json").read_bytes()).hexdigest())
    write_prompt_files(cluster.volume_dir("pvc", "drafter", "drafter-prompts"))
    configs = cluster.volume_dir("pvc", "drafter", "drafter-run-configs")
    shutil.copy(REHEARSAL_CONFIG, configs / "kimi-k2.5.yaml")
    (configs / Path(TRAINER_MANIFEST).name).write_text(
        one_rank_per_node(PROJECT_ROOT / "infra/k8s/trainer-workers.yaml")
    )
    return cluster.volume_dir("pvc", "drafter", "kimi-k2-5-weights") / "Kimi-K2.5"


def downloaded_at(model_dir: Path, commit: str) -> None:
    """The metadata `hf download --local-dir` leaves beside each file it downloaded, for config.json: the
    commit it came from, its etag and when (huggingface_hub's _local_folder.py)."""
    from pipeline.engines.target import DOWNLOAD_METADATA

    metadata = model_dir / DOWNLOAD_METADATA
    metadata.parent.mkdir(parents=True, exist_ok=True)
    metadata.write_text(f'{commit}\n"{commit[:16]}"\n{time.time():.1f}\n')


MALFORMED_LINE = '{"conversations": [{"from": "human", "value": "an export cut off mid-rec'


STANDARD_SET_RECORDS = 4  # conversations of the demo corpus written as each standard set's records


def write_prompt_files(directory: Path) -> None:
    """sharegpt.jsonl (with one truncated line, as exports have) and ultrachat.parquet (OpenAI form), and
    under eval/ the standard sets configs/kimi-k2.5.yaml evaluates on, in their publishers' formats."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.engines.tiny_target import demo_conversations

    conversations = demo_conversations()
    held_back = 5 * STANDARD_SET_RECORDS
    training, standard = conversations[:-held_back], conversations[-held_back:]
    sharegpt = [json.dumps(c) for c in training[0::2]]
    sharegpt.insert(len(sharegpt) // 2, MALFORMED_LINE)
    (directory / "sharegpt.jsonl").write_text("\n".join(sharegpt) + "\n")
    rows = [
        {
            "messages": [
                {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in c["conversations"]
            ]
        }
        for c in training[1::2]
    ]
    pq.write_table(pa.Table.from_pylist(rows), directory / "ultrachat.parquet")
    write_standard_sets(directory / "eval", [c["conversations"][0]["value"] for c in standard])


def write_standard_sets(directory: Path, asked: list[str]) -> None:
    """The five standard sets' files, each in its publisher's format (pipeline/data/standard_sets.py), with
    questions from the demo corpus: the real sets' prompts are longer than the rehearsal's 160 tokens (BFCL's
    function specs alone are), and three of them ship in no registry package (harness/shipped_sets.py).
    """
    chunks = [asked[i::5] for i in range(5)]
    lookup = {
        "name": "lookup",
        "description": "Look a name up in the project's documentation.",
        "parameters": {"type": "dict", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    }
    records: dict[str, list[dict[str, Any]]] = {
        "mt_bench/question.jsonl": [
            {"question_id": 81 + i, "category": "coding", "turns": [q, "Say that again in one sentence."]}
            for i, q in enumerate(chunks[0])
        ],
        "gsm8k/test.jsonl": [{"question": q, "answer": "#### 0"} for q in chunks[1]],
        "math500/test.jsonl": [
            {
                "problem": q,
                "solution": "",
                "answer": "",
                "subject": "Prealgebra",
                "level": 1,
                "unique_id": f"test/prealgebra/{i}.json",
            }
            for i, q in enumerate(chunks[3])
        ],
        "bfcl/BFCL_v4_simple_python.json": [
            {"id": f"simple_python_{i}", "question": [[{"role": "user", "content": q}]], "function": [lookup]}
            for i, q in enumerate(chunks[4])
        ],
    }
    humaneval = [
        {"task_id": f"HumanEval/{i}", "prompt": f'def answer():\n    """{q}"""\n', "entry_point": "answer"}
        for i, q in enumerate(chunks[2])
    ]
    for name, lines in records.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (directory / "humaneval").mkdir(parents=True, exist_ok=True)
    with gzip.open(directory / "humaneval" / "HumanEval.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(line) + "\n" for line in humaneval)


def start_reference_server(model_dir: Path, workspace: Path, processes: list[subprocess.Popen]) -> str:
    """A plain (non-speculative) server of the target on this machine: what the serving pod's greedy
    output is compared with. The rehearsal's own instrument, not part of the deployment."""
    log_file = open(workspace / "reference-server.log", "w")
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.sglang_standin",
            "--model-path",
            str(model_dir),
            "--port",
            str(port),
            "--trust-remote-code",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=PROJECT_ROOT,
    )
    processes.append(process)
    url = f"http://127.0.0.1:{port}"
    _await_health(url, _exited(process), 300)
    return url


def _await_health(url: str, gone, timeout_s: float) -> None:
    """Wait for `url`/health to answer 200; `gone()` says why the server will never come (else None)."""

    def check() -> None:
        reason = gone()
        if reason:
            raise RehearsalFailed(f"{url}: {reason}")

    if not await_health(url, timeout_s, check):
        raise RehearsalFailed(f"{url} was not healthy within {timeout_s:.0f} s")


def _exited(process: subprocess.Popen):
    return lambda: f"the server exited with code {process.returncode}" if process.poll() is not None else None


def rehearsal_deployment(workspace: Path) -> Path:
    """configs/deployment/kubernetes.yaml with three changes:
    - the wait before a task's retry (REHEARSAL_RETRY_DELAY_S): the rehearsal's lost node is retried at
      once instead of minutes later;
    - a fleet's wait for its servers (FLEET_READY_TIMEOUT_S, not the hour Kimi-K2.5 may take to load): the
      stand-in loads the tiny target in seconds, and a fleet that never gets ready fails the rehearsal in
      minutes;
    - no `deadline_minutes`: Airflow 3.3.2's dag.test() cannot run a DAG with deadline alerts (its
      DagRun.update_state looks the DAG's alerts up as stored ids: airflow/models/dagrun.py, in
      update_state, `DeadlineAlertModel.get_by_id(alert_id, ...) for alert_id in dag.deadline`, and gets
      the DeadlineAlert objects of the unserialized DAG). A scheduler runs them:
      tests/system/test_airflow_live.py has a deadline alert delivered by a running scheduler and
      triggerer."""
    deployment = yaml.safe_load(DEPLOYMENT.read_text())
    deployment["retry_delay_seconds"] = REHEARSAL_RETRY_DELAY_S
    for fleet in deployment["kubernetes"]["fleets"].values():
        fleet["ready_timeout_seconds"] = FLEET_READY_TIMEOUT_S
    deployment.pop("deadline_minutes", None)
    path = workspace / "deployment.yaml"
    path.write_text(yaml.safe_dump(deployment, sort_keys=False))
    return path


def airflow_environment(workspace: Path) -> None:
    """Airflow's settings, before anything imports Airflow (it reads them once, on import)."""
    if "airflow" in sys.modules:
        raise RehearsalFailed("Airflow was imported before the rehearsal set its environment")
    home = workspace / "airflow"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_ROOT / "dags"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "DRAFTER_DEPLOYMENT": str(rehearsal_deployment(workspace)),
            # lineage through Airflow's OpenLineage provider, to a file (a lineage server stands in a
            # cluster: infra/helm/airflow-values.yaml); emitted from a thread of this process
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
                {"type": "file", "log_file_path": str(lineage_events(workspace)), "append": True}
            ),
            "AIRFLOW__OPENLINEAGE__NAMESPACE": "drafter-rehearsal",
            "AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD": "True",
        }
    )


def lineage_events(workspace: Path) -> Path:
    return workspace / "openlineage.jsonl"


def check_lineage(workspace: Path, version: str) -> str:
    """The OpenLineage events of the pod tasks link the data run's prompts to the promoted version: each
    step's outputs are among the next one's inputs, all in the S3 bucket."""
    from pipeline.ops.lineage import LINEAGE_CHAIN as chain
    from pipeline.ops.lineage import completed_datasets

    jobs = completed_datasets(lineage_events(workspace))

    def datasets(job: str, side: str) -> set[tuple[str, str]]:
        return jobs.get(job, {}).get(side, set())

    for before, after in zip(chain, chain[1:], strict=False):
        _check(
            bool(datasets(before, "outputs") & datasets(after, "inputs")),
            f"lineage: {before}'s outputs are {after}'s inputs",
        )
    namespaces = {
        namespace for job in chain for side in ("inputs", "outputs") for namespace, _ in datasets(job, side)
    }
    _check(namespaces == {f"s3://{BUCKET}"}, f"lineage: every dataset is in the bucket ({namespaces})")
    versions = [
        name
        for _, name in datasets("drafter_train.promote", "outputs")
        if name.endswith(f"/versions/{version}")
    ]
    _check(len(versions) == 1, f"lineage: the promotion published drafter version {version}")
    return f"lineage: {' -> '.join(job.split('.')[1] for job in chain)} -> {versions[0]}"


def start_airflow(workspace: Path, cluster: LocalCluster):
    """Airflow's metadata database and the DAGs, parsed with the Kubernetes deployment."""
    if str(PROJECT_ROOT / "dags") not in sys.path:
        sys.path.insert(0, str(PROJECT_ROOT / "dags"))
    _output(
        [str(Path(sys.executable).with_name("airflow")), "db", "migrate"], "airflow db migrate", timeout=600
    )
    use_local_cluster(cluster)
    parsed_dag("drafter_data")


def parsed_dag(dag_id: str):
    """The DAG as a worker parses it for a new run. Parsed afresh each time: dag.test() leaves a run's
    trigger form in the DAG object's params, where a scheduler's next run would not see it."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(PROJECT_ROOT / "dags"))
    if bag.import_errors:
        raise RehearsalFailed(f"the DAGs do not parse: {bag.import_errors}")
    return bag.dags[dag_id]


def task_states(run) -> dict[str, str]:
    states: dict[str, str] = {}
    for ti in run.get_task_instances():
        key = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
        states[key] = str(ti.state)
    return states


def dataset_events() -> list[dict[str, Any]]:
    """The extras of the drafter_dataset Asset's events (what the scheduler hands drafter_train)."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.settings import Session
    from sqlalchemy import select

    if Session is None:
        raise RehearsalFailed("Airflow's database session is not configured")
    with Session() as session:
        rows = session.execute(
            select(AssetEvent)
            .join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetModel.name == "drafter_dataset")
            .order_by(AssetEvent.id)
        ).scalars()
        return [dict(event.extra or {}) for event in rows]


def scheduled_run(dag, cron: str):
    """A run of `dag` as the scheduler makes one on its cron: run type scheduled, triggered by the
    timetable at its latest tick, no trigger form (its params are the form's defaults). dag.test() would
    make a manual run; only the run's creation is swapped, the tasks run as in any dag.test()."""
    from unittest import mock

    import airflow.models.dagrun as dagrun_module
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType
    from croniter import croniter

    tick = croniter(cron, dt.datetime.now(dt.UTC)).get_prev(dt.datetime)

    def create_scheduled(*, dag, logical_date, data_interval, run_after, session, **_):
        run_id = dagrun_module.DagRun.generate_run_id(
            run_type=DagRunType.SCHEDULED, logical_date=logical_date, run_after=run_after
        )
        return dag.create_dagrun(
            run_id=run_id,
            logical_date=logical_date,
            data_interval=data_interval,
            run_after=run_after,
            conf=None,
            run_type=DagRunType.SCHEDULED,
            state=DagRunState.RUNNING,
            triggered_by=DagRunTriggeredByType.TIMETABLE,
            triggering_user_name=None,
            start_date=logical_date,
            session=session,
        )

    with mock.patch.object(dagrun_module, "get_or_create_dagrun", create_scheduled):
        return dag.test(logical_date=tick, run_after=tick)


class ServingDeployment:
    """The `kimi-k2-5-eagle3` Deployment of infra/k8s/sglang-serve.yaml once the runbook applied it (§2.6,
    after the first promotion), its pods made by the local cluster's Deployment controller: `kubectl set env`
    pins the version their init container pulls (DRAFTER_VERSION), which rolls them one at a time."""

    NAMESPACE, NAME = "sglang", "kimi-k2-5-eagle3"

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster

    @property
    def pods(self) -> list[LocalPod]:
        """The Deployment's pods of its current template, oldest first (none before it is applied)."""
        if (self.NAMESPACE, self.NAME) not in self.cluster.deployments:
            return []
        current = self.cluster.deployment_template_hash(self.NAMESPACE, self.NAME)
        return self.cluster.deployment_pods(self.NAMESPACE, self.NAME, current)

    def rollout_status(self, command: str = "", timeout_s: float = 600) -> str:
        """`kubectl rollout status deployment/...`: until every replica is a ready pod of the current template
        and no older pod is left; then each answers /health here too."""
        from pipeline.retrying import poll_until

        doc = self.cluster.deployments.get((self.NAMESPACE, self.NAME))
        if doc is None:
            raise RehearsalFailed(f"deployment {self.NAMESPACE}/{self.NAME} was never applied")
        replicas = int(doc["spec"].get("replicas", 1))

        def rolled_out() -> bool:
            for pod in self.pods:
                reason = self._gone(pod)
                if reason:
                    raise RehearsalFailed(f"serving pod {pod.name}: {reason}\n{_pod_logs(pod)}")
            everything = self.cluster.deployment_pods(self.NAMESPACE, self.NAME)
            return len(self.pods) == len(everything) == replicas and all(pod.ready() for pod in self.pods)

        if not poll_until(rolled_out, timeout_s, 1.0):
            raise RehearsalFailed(
                f"the serving Deployment did not roll out in {timeout_s:.0f} s: "
                + "; ".join(f"{pod.name} {pod.current_phase()} {pod.events[-2:]}" for pod in self.pods)
            )
        for pod in self.pods:
            _await_health(self._url(pod), lambda pod=pod: self._gone(pod), timeout_s)
        served = self.served_version()
        return f'deployment "{self.NAME}" successfully rolled out: {len(self.pods)} pods serve {served}'

    def set_env(self, command: str) -> str:
        """`kubectl -n sglang set env deployment/NAME -c CONTAINER KEY=VALUE...`, as kubectl changes the
        template (the controller rolls it out; `rollout status` waits for it)."""
        import shlex

        words = shlex.split(command)[5:]
        if len(words) < 4 or words[0] != f"deployment/{self.NAME}" or words[1] != "-c":
            raise RehearsalFailed(f"the rehearsal runs `set env deployment/{self.NAME} -c ...`: {command!r}")
        values = dict(word.split("=", 1) for word in words[3:])
        self.cluster.set_env(self.NAMESPACE, self.NAME, words[2], values)
        return f"deployment.apps/{self.NAME} env updated"

    def await_refusal(self, message: str, timeout_s: float = 120) -> str:
        """Until a pod of the current template has failed its init container with `message` in its log."""
        from pipeline.retrying import poll_until

        def refused() -> bool:
            return any(pod.init_restarts and message in _pod_logs(pod) for pod in self.pods)

        if not poll_until(refused, timeout_s, 0.5):
            raise RehearsalFailed(f"no serving pod refused to start with {message!r} in {timeout_s:.0f} s")
        return message

    def evict_one(self) -> str:
        """A node drain's eviction of the oldest serving pod: the ReplicaSet makes another of the same
        template, which pulls the version the template pins."""
        pod = self.running_pod if len(self.pods) == 1 else self.pods[0]
        self.cluster.delete_pod(self.NAMESPACE, pod.name)
        return pod.name

    @property
    def running_pod(self) -> LocalPod:
        """The newest pod of the current template (the Deployment has none before it is applied)."""
        if not self.pods:
            raise RehearsalFailed("the serving Deployment has no pod: it was never applied, or stopped")
        return self.pods[-1]

    @staticmethod
    def _gone(pod: LocalPod) -> str | None:
        """Why the pod will never serve (None: it may yet): failed, its server exited, or its init
        container (the pull) failing and restarting with back-off."""
        server = pod.containers.get("sglang")
        if pod.current_phase() == "Failed":
            return f"the pod failed ({pod.reason})"
        if pod.init_restarts:
            return f"its init container keeps failing: {pod.events[-1]['message']}"
        if server is not None and not server.running:
            return f"the server exited with code {server.exit_code}"
        return None

    @staticmethod
    def _url(pod: LocalPod) -> str:
        # the pod's own address (the Deployment's pods have no DNS name)
        return f"http://{pod.ip}:{SERVING_PORT}"

    @property
    def url(self) -> str:
        return self._url(self.running_pod)

    def served_version(self) -> str:
        """The version the pods pulled (all the same, or the rehearsal fails)."""
        versions = {
            json.loads((pod.directory / "volumes" / "drafter" / "current" / "manifest.json").read_text())[
                "version"
            ]
            for pod in self.pods
        }
        if len(versions) != 1:
            raise RehearsalFailed(f"the serving pods serve {sorted(versions)}: not one version")
        return versions.pop()

    def flags(self) -> str:
        return (self.running_pod.directory / "volumes" / "drafter" / "serving-flags").read_text().strip()

    def stop(self) -> None:
        self.cluster.delete_deployment(self.NAMESPACE, self.NAME)


def _pod_logs(pod: LocalPod) -> str:
    return "\n".join(path.read_text()[-3000:] for path in sorted(pod.directory.glob("*.log")))


def check_serving(serving: ServingDeployment, expected_version: str, reference_url: str) -> str:
    """One request to the serving pod: EAGLE3 with the expected version, greedy output unchanged."""
    import requests

    url = serving.url
    info = requests.get(f"{url}/server_info", timeout=30).json()
    prompt = {"input_ids": list(range(10, 30)), "sampling_params": {"max_new_tokens": 32, "temperature": 0}}
    speculative = requests.post(f"{url}/generate", json=prompt, timeout=300).json()
    plain = requests.post(f"{reference_url}/generate", json=prompt, timeout=300).json()
    _check(serving.served_version() == expected_version, f"the serving pod pulled version {expected_version}")
    _check(
        info.get("speculative_algorithm") == "EAGLE3",
        "the serving server runs EAGLE3 with the pulled drafter",
    )
    _check(
        speculative["output_ids"] == plain["output_ids"],
        "the speculative output equals the plain server's greedy output token for token",
    )
    accept = speculative["meta_info"].get("spec_accept_length", 0)
    _check(accept > 1.0, f"the served drafter is accepted: {accept:.2f} tokens per verify step")
    return f"serving {expected_version}: EAGLE3 accept length {accept:.2f} with flags {serving.flags()}"


def rehearse(workspace: Path, cache: Path) -> list[str]:
    """Run everything, in the runbook's order; returns the summary lines. Raises on any failure."""
    airflow_environment(workspace)
    server, endpoint = start_s3()
    cluster = LocalCluster(workspace / "cluster", _images(workspace), NODES, aws_endpoint=endpoint)
    serving = ServingDeployment(cluster)
    runbook = Runbook(
        {
            "aws s3api": aws_s3api(endpoint),
            "kubectl apply": kubectl_apply(cluster, workspace),
            "kubectl -n sglang scale": kubectl_scale(cluster),
            "kubectl -n sglang rollout status": kubectl_rollout_status(cluster, serving),
            "kubectl -n drafter wait": kubectl_wait_for_job(cluster),
            "kubectl -n drafter logs": kubectl_logs(cluster),
            # before the plain `kubectl -n airflow exec`, which runs `airflow` commands here
            "kubectl -n airflow exec deploy/airflow-triggerer": exec_in_triggerer(cluster),
            "kubectl -n airflow exec": airflow_command,
            "kubectl -n airflow create configmap": kubectl_create_configmap(cluster),
            "curl": capture_server_info(cluster),
            "drafter ": run_drafter,
            "kubectl -n sglang set env": serving.set_env,
        }
    )
    processes: list[subprocess.Popen] = []
    try:
        cluster.start_api()
        worker_identity(workspace, endpoint)
        for command in runbook_commands(section="1."):  # §1: S3 and IAM, the cluster objects
            if command.startswith(("aws s3api", "kubectl apply", "kubectl -n drafter wait")):
                runbook.run(command)
        _check(
            not cluster.gpus_held(),
            f"no pod holds a GPU once the install's manifests are applied (held: {cluster.gpus_held()})",
        )
        model_dir = fill_volumes(cluster, cache)
        reference_url = start_reference_server(
            model_dir, workspace, processes
        )  # stopped below, started or not
        check_fleets_at_rest(cluster, "the manifests were applied")
        for command in runbook_commands(
            section="1."
        ):  # one capture server up for a look at its flags, then down
            if command.startswith(("kubectl -n sglang scale", "kubectl -n sglang rollout status", "curl")):
                runbook.run(command)
        helm_release(cluster, workspace)
        start_airflow(workspace, cluster)
        runbook.run(
            "kubectl -n airflow exec deploy/airflow-scheduler -- airflow pools set drafter_gpu 3 "
            '"GPU-bound drafter tasks"'
        )
        runbook.run(
            "kubectl -n airflow create configmap drafter-run-configs "
            "--from-file=kimi-k2.5.yaml=<your run config>",
            **{"your run config": str(REHEARSAL_CONFIG)},
        )
        alerts = start_alert_sink(workspace, processes)
        lines = run_dags(runbook, serving, cluster, reference_url, workspace, alerts)
        missed = runbook.missed()
        _check(not missed, f"every [rehearsed] command of docs/RUNBOOK.md ran (missed: {missed})")
        return lines + pod_lines(cluster)
    finally:
        serving.stop()
        cluster.shutdown()
        for process in processes:
            process.kill()
            process.wait()
        server.stop()


class NodeLoss:
    """Loses node 1 of the multi-node training mid-epoch, once the trainer has committed a checkpoint: its
    pod's processes are killed, as when a node goes away. Then, with the Job failed, its nodes' logs are
    read with the runbook's command before the retry replaces the Job."""

    def __init__(self, cluster: LocalCluster, runbook: Runbook, workspace: Path):
        self.cluster, self.runbook = cluster, runbook
        self.api = _api_as(cluster, "drafter", "drafter-pipeline", workspace)
        self.killed: dict[str, Any] = {}
        self.job_at_loss: dict[str, Any] = {}  # the running Job's metadata and spec when the node was lost
        self.owner_pod: dict[str, Any] = {}  # what its ownerReference named: that pod's labels and uid
        self.disowned = False  # the failed Job's owner dropped by its task, so it stays for its logs
        self.failed_job_logs = ""
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="node-loss", daemon=True)

    def __enter__(self) -> NodeLoss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _watch(self) -> None:
        try:
            if self._kill_node_after_a_checkpoint():
                self._read_logs_of_the_failed_job()
        except BaseException as error:  # reported by the caller's checks
            self.error = error

    def _kill_node_after_a_checkpoint(self) -> bool:
        cache = self.cluster.volume_dir("pvc", "drafter", "drafter-cache")
        while not self._stop.wait(0.2):
            pods = {
                pod.manifest["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index"): pod
                for pod in self.cluster.job_pods("drafter", TRAINER_JOB)
            }
            committed = [path.read_text().strip() for path in cache.glob("runs/*/train-*/checkpoints/latest")]
            # a step checkpoint (not an epoch's end): the loss comes mid-epoch
            if (
                committed
                and committed[0].startswith("step-")
                and "1" in pods
                and pods["1"].current_phase() == "Running"
            ):
                tag = committed[0]
                self._note_the_running_job()
                self.cluster.kill_pod("drafter", pods["1"].name)
                self.killed = {"pod": pods["1"].name, "checkpoint": tag}
                log.info("lost node 1 (pod %s) after checkpoint %s was committed", pods["1"].name, tag)
                return True
        return False

    def _note_the_running_job(self) -> None:
        """The Job as it runs: its owner (the train task's pod, which must exist with that uid), deadline."""
        job = self.api.read_job("drafter", TRAINER_JOB)
        self.job_at_loss = {"metadata": job["metadata"], "spec": job["spec"]}
        for owner in job["metadata"].get("ownerReferences") or []:
            pod = self.cluster.pods.get(("drafter", owner["name"]))
            if pod is not None and pod.manifest["metadata"].get("uid") == owner["uid"]:
                self.owner_pod = {"labels": pod.manifest["metadata"].get("labels") or {}, "uid": owner["uid"]}

    def _read_logs_of_the_failed_job(self) -> None:
        from pipeline.training.nodes import job_outcome

        while not self._stop.wait(0.5):
            try:
                job = self.api.read_job("drafter", TRAINER_JOB)
            except Exception:  # replaced by the retry already
                return
            self.disowned = self.disowned or not job["metadata"].get("ownerReferences")
            if job_outcome(job) == "Failed" and self.disowned:
                self.failed_job_logs = self.runbook.run(
                    f"kubectl -n drafter logs -l batch.kubernetes.io/job-name={TRAINER_JOB} --prefix"
                )
                return


def _api_as(cluster: LocalCluster, namespace: str, account: str, workspace: Path):
    """The cluster's API as a service account (what `kubectl` with that account's token would use)."""
    from pipeline.ops.kube_api import KubernetesApi

    token = workspace / f"token-{namespace}-{account}"
    token.write_text(cluster.service_account_token(namespace, account))
    if cluster.api is None:
        raise RehearsalFailed("the local cluster serves no Kubernetes API: start_api() was not called")
    return KubernetesApi(cluster.api.url, token, Path(cluster.api.ca_file))


def kubectl_logs(cluster: LocalCluster):
    """`kubectl -n NS logs -l KEY=VALUE --prefix`: every container log of the pods with that label."""

    def run(command: str) -> str:
        argv = command.split()
        namespace = argv[argv.index("-n") + 1]
        key, value = argv[argv.index("-l") + 1].split("=", 1)
        lines = []
        for pod in cluster.pods_labelled(namespace, key, value):
            for path in sorted(pod.directory.glob("*.log")):
                prefix = f"[pod/{pod.name}/{path.stem}] "
                lines += [prefix + line for line in path.read_text(errors="replace").splitlines()]
        return "\n".join(lines)

    return run


def check_multi_node_training(run, node_loss: NodeLoss, deployment) -> str:
    """The first attempt lost a node after a committed checkpoint; the retry resumed both nodes from it."""
    _check(node_loss.error is None, f"the node-loss watcher ran without error ({node_loss.error!r})")
    _check(bool(node_loss.killed), "node 1 of the 2-node training was lost after a checkpoint was committed")
    deadline = node_loss.job_at_loss.get("spec", {}).get("activeDeadlineSeconds")
    _check(
        node_loss.owner_pod.get("labels", {}).get("task_id") == "train"
        and deadline == deployment.stage("train").timeout_minutes * 60,
        "the running trainer Job was owned by its train task's pod and could not outlive the task's timeout "
        f"(owner {node_loss.owner_pod.get('labels', {}).get('task_id')}, activeDeadlineSeconds {deadline})",
    )
    _check(node_loss.disowned, "the failed Job was disowned by its task, kept for its node logs")
    _check(
        "[pod/" in node_loss.failed_job_logs and "node" in node_loss.failed_job_logs,
        "the failed Job's node logs were read with the runbook's kubectl logs command",
    )
    train = next(ti for ti in run.get_task_instances() if ti.task_id == "train")
    _check(
        train.try_number == 2,
        f"the train task failed once (the lost node) and its retry succeeded (try {train.try_number})",
    )
    result = _train_result(train.xcom_pull(task_ids="train")["uri"])
    resumed_at = result["global_steps"] - result["steps_this_attempt"]
    tag = node_loss.killed["checkpoint"]
    _check(
        result["nodes"] == 2 and result["world_size"] == 2,
        f"the retry trained on 2 nodes x 1 rank ({result['nodes']} nodes, world size {result['world_size']})",
    )
    _check(
        0 < resumed_at < result["global_steps"] and resumed_at == int(tag.split("-")[1]),
        f"the retry resumed from the committed checkpoint {tag} "
        f"(step {resumed_at} of {result['global_steps']}), not from scratch",
    )
    return (
        f"multi-node training: 2 nodes x 1 rank as Indexed Job {TRAINER_JOB}; "
        f"node 1 ({node_loss.killed['pod']}) lost after checkpoint {tag}; "
        f"the retry resumed at step {resumed_at} and finished at step "
        f"{result['global_steps']} ({result['steps_this_attempt']} steps this attempt)"
    )


def _train_result(train_uri: str) -> dict[str, Any]:
    """runs/<id>/train/train_result.json, read from S3 as the worker's role."""
    return _s3_json(train_uri, "train_result.json")


def _s3_json(uri: str, name: str) -> dict[str, Any]:
    """<uri>/<name>, read from S3 as the worker's role."""
    import boto3

    bucket, key = uri[len("s3://") :].split("/", 1)
    return json.loads(boto3.client("s3").get_object(Bucket=bucket, Key=f"{key}/{name}")["Body"].read())


def check_fleets_at_rest(cluster: LocalCluster, when: str) -> None:
    """Neither SGLang fleet holds a pod (or GPUs)."""
    for name in FLEETS.values():
        status = cluster.statefulset_status("sglang", name)
        _check(status["replicas"] == 0, f"{when}: StatefulSet sglang/{name} is at 0 replicas ({status})")


def check_fleets_followed_their_stages(run, cluster: LocalCluster) -> str:
    """Each fleet was scaled to its stage's servers by a task pod, its servers answered the stage, and a
    teardown task put it back to 0."""
    states = task_states(run)
    summary = []
    for stage, name in FLEETS.items():
        up = next(ti for ti in run.get_task_instances() if ti.task_id == f"{stage}_fleet_up")
        scaled = up.xcom_pull(task_ids=up.task_id) or {}
        _check(
            states[f"{stage}_fleet_down"] == "success" and scaled.get("scaled") is True,
            f"{run.run_id}: the {stage} fleet was scaled up ({scaled}) and back down by its tasks",
        )
        pods = sorted(
            {
                row["pod"]
                for row in cluster.history
                if row["pod"].startswith(f"{name}-") and row["event"] == "deleted"
            }
        )
        _check(len(pods) >= scaled["replicas"], f"{stage} fleet pods ran and were deleted: {pods}")
        summary.append(
            f"{stage} fleet {scaled['statefulset']}: {scaled['replicas']} replica(s) ready in "
            f"{scaled['ready_seconds']} s, pods {', '.join(pods)}, back to 0"
        )
    check_fleets_at_rest(cluster, f"after {run.run_id}")
    return "; ".join(summary)


def check_engine_placement(runs: list, cluster: LocalCluster, deployment, stage_of, run_label) -> str:
    """Every pod of a stage that follows the run's engine (the deployment's `engines`) ran in the image and
    on the kind of node that engine places it, as its run's configure step found the engine.
    `stage_of(dag_id, task_id)` is the stage a task runs (None for a task of no stage); `run_label(run_id)`
    the run's pod label (the cncf provider's make_safe_label_value)."""
    engines = {}
    for run in runs:
        configure = next(ti for ti in run.get_task_instances() if ti.task_id == "configure")
        engines[run_label(run.run_id)] = configure.xcom_pull(task_ids="configure")["engines"]
    placed: dict[tuple[str, str], set[str]] = {}
    for row in cluster.pods_run():
        stage = stage_of(row["dag_id"], row["task_id"])
        if row["run_id"] not in engines or stage is None or not deployment.follows_engine(stage):
            continue
        engine = engines[row["run_id"]][stage]
        expected = deployment.placed_fields(stage, engine)
        on_gpus = bool(expected["node_selector"])
        _check(
            row["image"] == expected["image"] and (row["node"] or "").startswith(GPU_NODE_PREFIX) == on_gpus,
            f"pod {row['pod']} ({row['dag_id']}.{row['task_id']}, {stage} engine {engine}) ran in the "
            f"image {row['image']} on {row['node']}, as the deployment places that engine",
        )
        placed.setdefault((stage, engine), set()).add(f"{row['image']} on {row['node']}")
    expected_pairs = {("generate", "sglang"), ("capture", "sglang"), ("capture", "inprocess")}
    # the multi-node run's train task only launches its node Job (no GPU); the cron run trains in its pod
    expected_pairs |= {("benchmark", "sglang"), ("train", "kubernetes"), ("train", "torchrun")}
    _check(
        expected_pairs <= set(placed),
        f"pods ran for each engine placement the runs needed: {sorted(placed)}",
    )
    return "engine placement: " + ", ".join(f"{s} {e}: {sorted(p)}" for (s, e), p in sorted(placed.items()))


def task_stages() -> dict[tuple[str, str], str]:
    """The stage each pod task of the DAGs runs (StagePodOperator's drafter_stage), by DAG and task id."""
    stages = {}
    for dag_id in ("drafter_data", "drafter_train"):
        for task in parsed_dag(dag_id).tasks:  # a mapped task holds its operator's arguments unapplied
            unapplied = getattr(task, "partial_kwargs", {})
            stage = getattr(task, "drafter_stage", None) or unapplied.get("drafter_stage")
            if stage:
                stages[(dag_id, task.task_id)] = stage
    return stages


def check_in_process_capture(run) -> str:
    """The in-process run captured without the capture fleet, as a job of ranks whose parity passed."""
    scaled = _xcom(run, "capture_fleet_up")
    _check(scaled.get("scaled") is False, f"{run.run_id}: in-process capture scaled no fleet {scaled}")
    parity = _xcom(run, "parity")["parity"]
    _check(
        bool(parity.get("passed")) and parity.get("samples", 0) > 0,
        f"{run.run_id}: the parity task checked the 2-rank in-process engine against a reference forward "
        f"({parity})",
    )
    manifest = _s3_json(_xcom(run, "captures")["uri"], "manifest.json")
    ranks = manifest["config"]["inprocess"]["tp_size"]
    _check(
        manifest["contract"]["engine"]["name"] == "inprocess" and ranks == 2 and manifest["shards"],
        f"{run.run_id}: the capture was made in-process by {ranks} ranks "
        f"({manifest['contract']['engine']}, {manifest['totals']})",
    )
    return (
        f"in-process capture: {manifest['totals']['samples']} samples by a job of {ranks} ranks, engine "
        f"{manifest['contract']['engine']['version']}, parity on {parity['samples']} samples, no fleet"
    )


def check_run_costs(data, trained, deployment) -> str:
    """The runs' tasks recorded what they held, priced at the deployment's gpu_hour_usd: the data run's
    fleets by their replicas' GPUs, the 2-node training by both nodes' GPUs and both attempts."""
    from pipeline.config import load_config
    from pipeline.ops.usage import read_usage, run_cost
    from pipeline.storage import open_store

    store = open_store(load_config(REHEARSAL_CONFIG).storage)
    price = deployment.gpu_hour_usd
    lines = []
    for run, expected in ((data, {"generate fleet": 16, "capture fleet": 8}), (trained, {"train": 16})):
        usage = read_usage(store, _xcom(run, "configure")["run_id"])
        cost = run_cost(usage)
        for stage, gpus in expected.items():
            held = {u.gpus for u in usage if u.stage == stage}
            _check(held == {gpus}, f"{run.run_id}: {stage} recorded {gpus} GPUs held ({held})")
        priced = price is not None and cost.cost_usd is not None
        _check(
            priced and math.isclose(cost.cost_usd or 0.0, cost.gpu_hours * (price or 0.0), rel_tol=1e-9),
            f"{run.run_id}: priced at ${price} a GPU-hour ({cost.gpu_hours:.4f} GPU-hours, ${cost.cost_usd})",
        )
        lines.append(
            f"{run.run_id}: "
            + ", ".join(f"{r.stage} {r.gpu_hours:.4f} GPU-h x{r.attempts}" for r in cost.stages)
        )
    usage = read_usage(store, _xcom(trained, "configure")["run_id"])
    [train] = [row for row in run_cost(usage).stages if row.stage == "train"]
    _check(
        train.attempts == 2, f"the lost node's attempt counts in the run's cost ({train.attempts} attempts)"
    )
    return "costs: " + "; ".join(lines)


def check_setting_choice(trained, serving: ServingDeployment) -> str:
    """The benchmark timed every benchmark.sglang.candidates server and chose by pipeline.decoding.choice;
    the serving pod runs the chosen flags and the benchmarked load (its /server_info)."""
    import requests

    from pipeline import layout
    from pipeline.config import load_config
    from pipeline.decoding.choice import shape_label
    from pipeline.records import BenchRecord, read_record
    from pipeline.storage import open_store

    config = load_config(REHEARSAL_CONFIG)
    store = open_store(config.storage)
    prefix = layout.run_stage_prefix(_xcom(trained, "configure")["run_id"], "bench")
    record = read_record(store, store.uri(prefix), BenchRecord)
    assert config.benchmark.sglang is not None
    chosen = (record.draft_steps, record.topk, record.draft_tokens)
    timed = [(t.steps, t.topk, t.draft_tokens) for t in record.timed_settings]
    choice = record.setting_choice
    _check(
        timed == config.benchmark.sglang.candidate_settings() and choice is not None,
        f"the benchmark timed a candidate server per setting: {timed}",
    )
    assert choice is not None
    _check(
        choice.chosen == shape_label(chosen) and choice.chosen in choice.tied,
        f"the benchmarked and promoted setting is the one chosen: {choice.reason}",
    )
    info = requests.get(f"{serving.url}/server_info", timeout=30).json()
    served = tuple(
        info.get(key)
        for key in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    )
    _check(served == chosen, f"the serving pod runs the chosen setting {chosen} ({served})")
    load = config.benchmark.sglang.max_running_requests
    _check(
        record.max_running_requests == load and info.get("max_running_requests") == load,
        f"the serving pod runs {load} requests at once, as every benchmark server did "
        f"(/server_info: {info.get('max_running_requests')}, bench record: {record.max_running_requests})",
    )
    spreads = ", ".join(
        f"{shape_label((t.steps, t.topk, t.draft_tokens))} {t.speedup.ratio:.2f}x "
        f"[{t.speedup.ci_low:.2f}, {t.speedup.ci_high:.2f}]"
        for t in record.timed_settings
    )
    return f"serving setting: {choice.chosen} chosen of {spreads}"


def incumbent_speedups(run) -> str:
    """The run's benchmark against the incumbent, at every batch size it measured: each interval, the
    acceptance of both drafters, and the decision (what a refusal as slower is read from)."""
    from pipeline import layout
    from pipeline.config import load_config
    from pipeline.records import BenchRecord, read_record
    from pipeline.storage import open_store

    config = load_config(REHEARSAL_CONFIG)
    store = open_store(config.storage)
    prefix = layout.run_stage_prefix(_xcom(run, "configure")["run_id"], "bench")
    try:
        record = read_record(store, store.uri(prefix), BenchRecord)
    except Exception as err:  # reported, not raised: the run's own state says whether it failed
        return f"no bench record ({type(err).__name__}: {err})"
    levels = [(record.batch_size, record.speedups, record.methods)] + [
        (batch.batch_size, batch.speedups, batch.methods) for batch in record.batches
    ]
    parts = [
        f"batch {size}: candidate/incumbent {vs.ratio:.3f} [{vs.ci_low:.3f}, {vs.ci_high:.3f}], tau "
        f"{methods.candidate.tau_measured} vs {methods.incumbent.tau_measured if methods.incumbent else None}"
        for size, speedups, methods in levels
        if (vs := speedups.get("incumbent")) is not None
    ]
    return "; ".join(parts or ["no incumbent measured"]) + f" ({record.decision.verdict})"


def _xcom(run, task_id: str) -> dict[str, Any]:
    ti = next(ti for ti in run.get_task_instances() if ti.task_id == task_id and ti.map_index < 0)
    return ti.xcom_pull(task_ids=task_id) or {}


def run_dags(
    runbook: Runbook,
    serving: ServingDeployment,
    cluster: LocalCluster,
    reference_url: str,
    workspace: Path,
    alerts: Path,
) -> list[str]:
    """§2 to §6 of the runbook: the first run, serving it, a failing run, the cron, rollback, status.
    `alerts`: where the alert sink records what the notifiers sent."""
    from drafter_support import DEPLOYMENT

    from pipeline.ids import safe_id

    lines = []
    runbook.run(
        "drafter plan --config configs/kimi-k2.5.yaml --samples 37000 "
        "--deployment configs/deployment/kubernetes.yaml"
    )
    data = parsed_dag("drafter_data").test(run_conf={"num_shards": 2})
    lines.append(f"drafter_data {data.run_id}: {data.state} {task_states(data)}")
    _check(
        str(data.state) == "success",
        f"drafter_data ran every stage task as a pod and succeeded ({data.state} {task_states(data)})",
    )
    lines.append(check_fleets_followed_their_stages(data, cluster))
    events = dataset_events()
    _check(
        len(events) == 1 and events[0].get("dataset_uri", "").startswith(f"s3://{BUCKET}/"),
        f"drafter_data published the drafter_dataset Asset: {events}",
    )

    with NodeLoss(cluster, runbook, workspace) as node_loss:
        first = parsed_dag("drafter_train").test(
            run_conf={"dataset_uri": events[0]["dataset_uri"], "overrides": MULTI_NODE}
        )
    lines.append(f"drafter_train {first.run_id} ({' '.join(MULTI_NODE)}): {first.state} {task_states(first)}")
    _check(
        str(first.state) == "success" and task_states(first)["promote"] == "success",
        "drafter_train on the published dataset trained, gated, benchmarked and promoted into S3 "
        f"({first.state} {task_states(first)})",
    )
    lines.append(check_multi_node_training(first, node_loss, DEPLOYMENT))
    lines.append(check_run_costs(data, first, DEPLOYMENT))
    runbook.run("drafter list --config configs/kimi-k2.5.yaml")
    runbook.run(
        "drafter plan --config configs/kimi-k2.5.yaml --samples 200000 --measured-from <the train run id>",
        **{"the train run id": safe_id(first.run_id)},
    )
    first_version = promoted_version(first)
    _check(not serving.pods, "nothing serves before the runbook applies the serving Deployment")
    runbook.run("kubectl apply -f infra/k8s/sglang-serve.yaml")
    serving.await_refusal("DRAFTER_VERSION pins no version")  # as applied, the manifest pins nothing
    runbook.run(PIN_SERVED_VERSION, version=first_version)
    runbook.run("kubectl -n sglang rollout status deployment/kimi-k2-5-eagle3 --timeout=30m")
    lines.append(check_serving(serving, first_version, reference_url))
    lines.append(check_watches(runbook, cluster, serving))
    lines.append(check_setting_choice(first, serving))

    broken = parsed_dag("drafter_train").test(run_conf={"overrides": ["train.epochs=0"]})
    configure = next(ti for ti in broken.get_task_instances() if ti.task_id == "configure")
    lines.append(f"drafter_train {broken.run_id} (train.epochs=0): {broken.state} {task_states(broken)}")
    _check(
        str(configure.state) == "failed" and configure.try_number == 1 and configure.max_tries >= 1,
        "a config error failed its pod's task at once, without the retries a transient fault gets",
    )
    lines.append(check_alerts(alerts, first_version, broken, Path(os.environ["AIRFLOW_HOME"])))
    lines.append(check_lineage(workspace, first_version))

    inprocess = parsed_dag("drafter_data").test(run_conf={"num_shards": 1, "overrides": IN_PROCESS_CAPTURE})
    lines.append(
        f"drafter_data {inprocess.run_id} ({' '.join(IN_PROCESS_CAPTURE)}): {inprocess.state} "
        f"{task_states(inprocess)}"
    )
    _check(
        str(inprocess.state) == "success",
        "drafter_data with in-process capture succeeded in pods "
        f"({inprocess.state} {task_states(inprocess)})",
    )
    lines.append(check_in_process_capture(inprocess))
    inprocess_dataset = dataset_events()[-1]["dataset_uri"]

    if DEPLOYMENT.retrain_cron is None:
        raise RehearsalFailed("the deployment config sets no retrain_cron to schedule drafter_train on")
    cron = scheduled_run(parsed_dag("drafter_train"), DEPLOYMENT.retrain_cron)
    lines.append(
        f"drafter_train {cron.run_id} (cron {DEPLOYMENT.retrain_cron}): {cron.state} {task_states(cron)}"
    )
    cron_speed = incumbent_speedups(cron)
    lines.append(f"cron run's benchmark: {cron_speed}")
    _check(
        cron.run_id.startswith("scheduled__") and str(cron.state) == "success",
        "the cron-scheduled drafter_train run (no trigger form) trained with the deployment's run config "
        f"({cron.run_id}: {cron.state} {task_states(cron)}; its benchmark: {cron_speed})",
    )
    cron_dataset = _xcom(cron, "configure")["dataset_uri"]
    _check(
        cron_dataset == inprocess_dataset,
        f"the cron run trained on the newest dataset, the in-process capture's ({cron_dataset})",
    )
    second_version = promoted_version(cron)
    _check(second_version != first_version, f"the cron run promoted a new version {second_version}")
    lines.append(check_pinned_through_a_drain(serving, first_version, second_version))
    runbook.run(PIN_SERVED_VERSION, version=second_version)  # §2.6: a later promotion
    runbook.run("kubectl -n sglang rollout status deployment/kimi-k2-5-eagle3 --timeout=30m")
    lines.append(check_serving(serving, second_version, reference_url))

    from airflow.providers.cncf.kubernetes.pod_generator import make_safe_label_value

    stages = task_stages()

    def stage_of(dag_id: str, task_id: str) -> str | None:
        return stages.get((dag_id, task_id))

    runs = [data, first, inprocess, cron]
    lines.append(check_engine_placement(runs, cluster, DEPLOYMENT, stage_of, make_safe_label_value))
    rolled_back = json.loads(runbook.run("drafter rollback --config configs/kimi-k2.5.yaml"))["version"]
    _check(rolled_back == first_version, f"the rollback moved production back to {first_version}")
    runbook.run(PIN_SERVED_VERSION, version=rolled_back)
    runbook.run("kubectl -n sglang rollout status deployment/kimi-k2-5-eagle3 --timeout=30m")
    lines.append(check_serving(serving, first_version, reference_url))
    status = runbook.run("drafter status --config configs/kimi-k2.5.yaml")
    lines.append("status: " + " | ".join(line.strip() for line in status.splitlines() if line.strip()))
    return lines


PIN_SERVED_VERSION = (
    "kubectl -n sglang set env deployment/kimi-k2-5-eagle3 -c pull-drafter DRAFTER_VERSION=<version>"
)


def check_pinned_through_a_drain(serving: ServingDeployment, pinned: str, promoted: str) -> str:
    """A serving pod evicted (a node drain) after a later promotion is replaced by one that serves the
    pinned version, not `production`: the fleet stays on one version until the runbook pins the new one."""
    evicted = serving.evict_one()
    serving.rollout_status()
    served = serving.served_version()
    _check(
        served == pinned and evicted not in {pod.name for pod in serving.pods},
        f"a serving pod recreated after {promoted} was promoted still serves the pinned {pinned} ({served})",
    )
    return f"drain: {evicted} evicted; its replacement serves the pinned {served}, production is {promoted}"


def promoted_version(run) -> str:
    promote = next(ti for ti in run.get_task_instances() if ti.task_id == "promote")
    result = promote.xcom_pull(task_ids="promote") or {}
    _check(bool(result.get("promoted")) and bool(result.get("version")), f"{run.run_id} promoted: {result}")
    return result["version"]


def pod_lines(cluster: LocalCluster) -> list[str]:
    lines = []
    for row in cluster.pods_run():
        ended = "running until deleted" if row["exit_code"] is None else f"exit {row['exit_code']}"
        lines.append(
            f"pod {row['pod']}: {row['dag_id'] or '-'}.{row['task_id'] or '-'} on {row['node']} "
            f"image {row['image']} {ended}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workspace", type=Path, help="where the cluster, volumes and Airflow live (default: temp)"
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=PROJECT_ROOT / ".drafter" / "cache",
        help="where the tiny target is built once",
    )
    parser.add_argument("--keep", action="store_true", help="keep the workspace afterwards")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        raise SystemExit("the rehearsal's containers need root (mount and PID namespaces)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers and pods on the way out
    workspace = (args.workspace or Path(tempfile.mkdtemp(prefix="drafter-rehearsal-"))).resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        lines = rehearse(workspace, args.cache.resolve())
    except Exception as failure:
        print(f"rehearsal=failed: {type(failure).__name__}: {failure}", flush=True)
        raise
    finally:
        if not args.keep:
            shutil.rmtree(workspace, ignore_errors=True)
    for line in lines:
        print(line)
    print(f"rehearsal_seconds={time.monotonic() - started:.0f}")
    print("rehearsal=passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
