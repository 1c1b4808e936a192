"""Shared fixtures: both storage backends (a temp dir and moto's S3 server over HTTP on 127.0.0.1),
and a small tiny-target variant built once per machine."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import uuid
from pathlib import Path

import pytest

# the fault suite's fixtures (`record`, the S3 proxy) for the fault modules of every tier
pytest_plugins = ("tests.faults.plugin",)

REPO = Path(__file__).resolve().parents[1]
TEST_CACHE = REPO / ".drafter" / "test-cache"
# the shipped production config the deployed paths are checked against
KIMI_CONFIG = REPO / "configs" / "kimi-k2.5.yaml"
BUCKET = "drafter-tests"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One OpenMP thread per process: `make test` runs two workers on two cores, and processes that each take a
# thread per core stall at OpenMP barriers. Measured on this machine, two greedy decodes of the tiny target
# side by side took 10.5 s each with two threads apiece and 3-4 s with one; alone, one thread is 7% slower.
# Subprocesses (stage CLIs, torchrun, the Airflow components, the rehearsal's pods) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
# moto accepts any credentials; these keep boto3 from looking for real ones.
os.environ["AWS_ACCESS_KEY_ID"] = "testing"
os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ.pop("AWS_PROFILE", None)

# A target small enough to build in well under a minute; 7 layers so the default aux layers apply.
TEST_RECIPE = {
    "num_layers": 7,
    "hidden_size": 64,
    "num_heads": 2,
    "intermediate_size": 192,
    "vocab_size": 1024,
    "seq_len": 96,
    "batch_size": 16,
    "train_steps": 150,
    "learning_rate": 0.008,
    "max_corpus_modules": 60,
}
# a DeepSeek-V3 (MLA) tiny target with remote code, as Kimi ships: small enough to build in seconds
KIMI_TEST_RECIPE = {
    "architecture": "deepseek_v3",
    "num_layers": 6,
    "hidden_size": 64,
    "num_heads": 4,
    "intermediate_size": 192,
    "vocab_size": 1024,
    "seq_len": 96,
    "batch_size": 16,
    "train_steps": 40,
    "learning_rate": 0.008,
    "max_corpus_modules": 60,
}


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


MLFLOW_PYTHON = REPO / ".venv-mlflow" / "bin" / "python"


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """MLflow's tracking server (its own virtualenv: `make mlflow-venv`, which `make test` runs) on 127.0.0.1,
    its store in a temp dir; stopped by its PID."""
    import subprocess

    from pipeline.processes import free_port, stop_process_group
    from pipeline.retrying import await_health

    require(
        MLFLOW_PYTHON.exists(), f"MLflow's server is not installed at {MLFLOW_PYTHON}: run `make mlflow-venv`"
    )
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [str(MLFLOW_PYTHON), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--default-artifact-root", str(root)]
    command += ["--workers", "1"]
    with open(root / "server.log", "w") as log:
        server = subprocess.Popen(
            command, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def gone() -> None:
        if server.poll() is not None:
            raise RuntimeError(f"the MLflow server exited: {(root / 'server.log').read_text()[-3000:]}")

    url = f"http://127.0.0.1:{port}"
    try:
        if not await_health(url, 180, gone):
            pytest.fail(
                f"the MLflow server did not answer in 180 s: {(root / 'server.log').read_text()[-3000:]}"
            )
        yield url
    finally:
        stop_process_group(server, 30)


def storage_config(kind: str, tmp_path: Path, s3_endpoint: str | None) -> dict:
    if kind == "file":
        return {"root": str(tmp_path / "store"), "local_cache": str(TEST_CACHE)}
    return {
        "root": f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}",
        "endpoint_url": s3_endpoint,
        "local_cache": str(TEST_CACHE),
        "multipart_threshold_mb": 5,
    }


@pytest.fixture(params=["file", "s3"])
def storage(request, tmp_path):
    """A StorageConfig dict for each backend."""
    endpoint = request.getfixturevalue("s3_endpoint") if request.param == "s3" else None
    return storage_config(request.param, tmp_path, endpoint)


@pytest.fixture
def store(storage):
    from pipeline.storage import StorageConfig, open_store

    return open_store(StorageConfig(**storage))


def tiny_config_dict(storage: dict) -> dict:
    return {
        "storage": storage,
        "target": {"name": "tiny-test", "source": "tiny", "tiny": copy.deepcopy(TEST_RECIPE)},
        "prompts": {"num_samples": 96, "eval_fraction": 0.25, "shard_size": 40, "max_prompt_tokens": 120},
        "generate": {"max_new_tokens": 32, "batch_size": 16},
        "capture": {"max_length": 192, "batch_size": 8},
        "drafter": {"draft_vocab_size": 384, "export_dtype": "float32"},
        "train": {
            "epochs": 3,
            "micro_batch_size": 4,
            "max_length": 192,
            "ttt_steps": 3,
            "nproc": 2,
            "learning_rate": 0.003,
            "log_every": 5,
            "deepspeed_config": str(REPO / "configs/deepspeed/zero2-cpu.json"),
        },
        "evaluate": {"simulated_anchors": 128},
        "gate": {"min_cond_acc": [0.05], "min_tau_simulated": 1.0},
        "benchmark": {
            "num_prompts": 4,
            "max_new_tokens": 24,
            "draft_steps": 3,
            "budget_s": 5,
            "calibration_budget_s": 5,
            "min_speedup_vs_baseline": 0.0,
        },
    }


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    from pipeline.config import TinyTargetRecipe
    from pipeline.engines.tiny_target import ensure_tiny_target

    return ensure_tiny_target(TinyTargetRecipe(**TEST_RECIPE), TEST_CACHE)


@pytest.fixture(scope="session")
def kimi_target_dir() -> Path:
    """The tiny DeepSeek-V3 (MLA) target with remote code and a tiktoken tokenizer, as Kimi ships."""
    from pipeline.config import TinyTargetRecipe
    from pipeline.engines.tiny_target import ensure_tiny_target

    return ensure_tiny_target(TinyTargetRecipe(**KIMI_TEST_RECIPE), TEST_CACHE)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir):
    from pipeline.engines.target import load_tokenizer

    return load_tokenizer(tiny_target_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_target_dir):
    from pipeline.engines.target import load_model

    return load_model(tiny_target_dir)


def captured_dataset(config, store, snapshot: str) -> str:
    """prompts -> generate -> capture -> dataset of `snapshot`, through the stage table; the dataset URI."""
    from pipeline.stages import run_stage

    for stage in ("prompts", "generate", "capture"):
        run_stage(stage, config, snapshot, store)
    return run_stage("dataset", config, snapshot, store).uri


def published(store, output) -> dict:
    """The manifest a stage published (its output names the URI)."""
    from pipeline.manifest import read_manifest

    return read_manifest(store, store.key_for(output.uri))


@contextlib.contextmanager
def metered_ngram_standin(target_dir: Path, revision: str | None = None):
    """A serving replica in this process: the stand-in with n-gram speculation and its /metrics on,
    started with this --revision; yields its URL."""
    from harness.sglang_standin import StandinBackend, serve

    backend = StandinBackend(
        target_dir, None, "NGRAM", num_steps=3, draft_tokens=4, revision=revision, enable_metrics=True
    )
    server = serve(backend)
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server a test starts."""
    from harness.json_http import free_port as free

    return free()


VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """vLLM's virtualenv (`make vllm-venv`, which `make test` runs)."""
    require(VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: run `make vllm-venv`")
    return VLLM_PYTHON


SGLANG_VENV = REPO / ".venv-sglang"


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """Real SGLang 0.5.23 on the CPU in its own virtualenv (`make sglang-venv`, which `make test` runs); its
    stamp is written only after the install's own checks passed."""
    require(
        (SGLANG_VENV / ".sglang-installed").is_file(),
        f"{SGLANG_VENV} is missing or incomplete: run `make sglang-venv`",
    )
    return SGLANG_VENV / "bin" / "python"


# -- tiers, prerequisites and order -------------------------------------------------------------------------
# tests/unit (no subprocess, server, socket or model training), tests/integration (subprocesses, moto's S3
# server, torchrun on one node, the SGLang stand-in) and tests/system (a running Airflow, the rehearsal,
# vLLM, chromium, several nodes, fault runs that kill stages). `make check` runs the first two, `make test`
# all three with DRAFTER_TEST_STRICT=1: what a tier needs and this machine lacks is a skip, with its reason,
# in `make check` and a failure in `make test` (CI cannot pass without running it).
STRICT = os.environ.get("DRAFTER_TEST_STRICT") == "1"
TIERS = ("system", "integration", "unit")
# The modules handed to the two workers first, in this order (xdist deals the first four alternately: the
# rehearsal and the vLLM benchmark to one worker, one after the other). The rehearsal runs one pod at a time
# and uses under one core of the two for most of its ~13 min, so the other worker meanwhile gets the modules
# that keep a core busy or use both (DAG runs in process, multi-node and multi-process training, the stage
# CLIs); the modules that mostly wait (a live Airflow's scheduler loop, the local cluster's DNS and probe
# timings) come after, beside the vLLM benchmark. Started beside the rehearsal, they left a core idle for
# minutes. The rest of the system tier follows in file order, then the shuffled unit and integration tiers.
HANDED_OUT_FIRST = (
    "tests/system/test_rehearsal.py",
    "tests/system/test_dag_runs.py",
    "tests/system/test_vllm_bench.py",
    "tests/system/test_multinode.py",
    "tests/system/test_pipeline_e2e.py",
    "tests/system/test_process_death.py",
    "tests/system/test_vllm_generate.py",
    "tests/integration/test_trainer.py",  # the integration tier's longest (about 200 s): never started last
    "tests/system/test_airflow_live.py",
    "tests/system/test_local_cluster.py",
)


def require(present: bool, missing: str) -> None:
    """Skip (make check) or fail (make test) the test when a prerequisite is not `present`."""
    if not present:
        if STRICT:
            pytest.fail(f"{missing} (make test needs every tier's prerequisites)")
        pytest.skip(missing)


@pytest.fixture(scope="session")
def root() -> None:
    """The local cluster's containers need root (mount and PID namespaces)."""
    require(os.geteuid() == 0, "containers need root (mount and PID namespaces): run as root")


CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, which playwright drives (`make test` installs it: scripts/install-system-deps)."""
    import shutil

    path = shutil.which("chromium")
    require(path is not None, "Debian's chromium is missing: run scripts/install-system-deps")
    return str(path)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--order-seed",
        type=int,
        default=None,
        help="shuffle the unit and integration tiers with this seed (modules, then the tests of each module)",
    )


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.getoption("order_seed")
    return f"test order: {'file order' if seed is None else f'unit and integration shuffled, seed {seed}'}"


def tier_of(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """HANDED_OUT_FIRST, then the rest of the system tier, then the rest of the unit and integration tiers;
    with --order-seed those modules in a shuffled order, and the tests within each integration and unit
    module too (the system tier keeps its order): the same seed gives every xdist worker the same order."""
    import random

    seed = config.getoption("order_seed")
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    first = [m for m in HANDED_OUT_FIRST if m in modules]
    system = [m for m in modules if tier_of(m) == "system" and m not in first]
    rest = [m for m in modules if tier_of(m) != "system" and m not in first]
    if seed is not None:
        shuffler = random.Random(seed)
        shuffler.shuffle(rest)
        for module in rest + [m for m in first if tier_of(m) != "system"]:
            shuffler.shuffle(modules[module])
    items[:] = [item for module in first + system + rest for item in modules[module]]


class AlertSinks:
    """The HTTP and SMTP sinks the notifiers deliver to (harness/alert_sinks.py) and what they got."""

    SMTP_LOGIN, SMTP_PASSWORD = "drafter-alerts", "smtp-secret-5d8e1b"
    # a deployment's notifiers, one of each kind, whose connections (`connections`) point at the sinks
    NOTIFIERS = [
        {"kind": "slack", "conn_id": "drafter_slack"},
        {
            "kind": "email",
            "conn_id": "drafter_smtp",
            "to": ["ml-infra@example.com"],
            "from_email": "drafter@example.com",
        },
        {"kind": "webhook", "conn_id": "drafter_webhook", "endpoint": "/hooks/drafter"},
    ]

    def __init__(self, root: Path, http_port: int, smtp_port: int):
        self.root, self.http_port, self.smtp_port = root, http_port, smtp_port

    def connections(self, slack_token: str, webhook_token: str) -> dict[str, dict]:
        """The Airflow connections of NOTIFIERS by conn_id, their secrets the given tokens and the SMTP
        login."""
        return {
            "drafter_slack": {
                "conn_type": "slackwebhook",
                "host": f"http://127.0.0.1:{self.http_port}/slack",
                "password": slack_token,
            },
            "drafter_smtp": {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": self.smtp_port,
                "login": self.SMTP_LOGIN,
                "password": self.SMTP_PASSWORD,
                "extra": {"disable_tls": True, "disable_ssl": True, "retry_limit": 0},
            },
            "drafter_webhook": {
                "conn_type": "http",
                "host": "127.0.0.1",
                "port": self.http_port,
                "schema": "http",
                "extra": {"Authorization": f"Bearer {webhook_token}"},
            },
        }

    def requests(self, path_prefix: str = "/") -> list[dict]:
        """The HTTP requests received, oldest first, whose path starts with `path_prefix`."""
        sink = self.root / "http.jsonl"
        lines = sink.read_text().splitlines() if sink.exists() else []
        entries = [json.loads(line) for line in lines]
        return [entry for entry in entries if entry["path"].startswith(path_prefix)]

    def emails(self) -> list[dict]:
        """The messages received: subject, from, to and the decoded HTML body."""
        import email
        from email import policy

        messages = []
        for path in sorted((self.root / "mail").glob("*.eml"), key=lambda p: int(p.stem)):
            message = email.message_from_bytes(path.read_bytes(), policy=policy.default)
            body = message.get_body(preferencelist=("html", "plain"))
            messages.append(
                {
                    "subject": str(message["Subject"]),
                    "from": str(message["From"]),
                    "to": str(message["To"]),
                    "body": body.get_content() if body is not None else "",
                }
            )
        return messages


@pytest.fixture(scope="module")
def alert_sinks(tmp_path_factory):
    """Both sinks on 127.0.0.1 for one module's tests (a module never sees what another sent), stopped by
    their PIDs."""
    import subprocess
    import sys

    from pipeline.processes import free_port as free
    from pipeline.processes import stop_process_group
    from pipeline.retrying import poll_until

    root = tmp_path_factory.mktemp("alert-sinks")
    http_port, smtp_port = free(), free()
    base = [sys.executable, "-m", "harness.alert_sinks"]
    env = dict(os.environ, DRAFTER_SMTP_SINK_PASSWORD=AlertSinks.SMTP_PASSWORD)
    servers = []
    with open(root / "sinks.log", "w") as log:
        for command in (
            [*base, "http", "--port", str(http_port), "--out", str(root / "http.jsonl")],
            [
                *base,
                "smtp",
                "--port",
                str(smtp_port),
                "--out",
                str(root / "mail"),
                "--login",
                AlertSinks.SMTP_LOGIN,
            ],
        ):
            servers.append(
                subprocess.Popen(
                    command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    try:
        for port in (http_port, smtp_port):
            if not poll_until(lambda port=port: _listening(port), 60, 0.2):
                pytest.fail(
                    f"an alert sink did not listen on {port}: {(root / 'sinks.log').read_text()[-2000:]}"
                )
        yield AlertSinks(root, http_port, smtp_port)
    finally:
        for server in servers:
            stop_process_group(server, 10)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


# ---- Airflow in this process: a home with the project's DAGs, parsed, and a migrated database ----------

DAGS = REPO / "dags"


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory):
    """Airflow's settings for this process, set for the module and put back after it: a module that runs
    Airflow in a subprocess later on this worker must not inherit this home."""
    home = tmp_path_factory.mktemp("airflow-home")
    settings = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "DRAFTER_DEPLOYMENT": str(REPO / "configs/deployment/local.yaml"),
        # lineage through Airflow's OpenLineage provider, to its file transport (one event a line);
        # emitted from a thread, not a forked process, inside this test process
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
            {"type": "file", "log_file_path": str(home / "openlineage.jsonl"), "append": True}
        ),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "drafter-tests",
        "AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD": "True",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in settings.items():
            patch.setenv(name, value)
        patch.syspath_prepend(str(DAGS))  # what Airflow's dag bundle does for the dags folder
        yield home


@pytest.fixture(scope="module")
def dagbag(airflow_home):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


@pytest.fixture(scope="module")
def migrated_db(airflow_home, dagbag):
    from airflow.utils import db

    db.initdb()
    from airflow.models.pool import Pool

    Pool.create_or_update_pool(
        "drafter_gpu", slots=1, description="GPU-bound drafter tasks", include_deferred=False
    )
    return airflow_home
