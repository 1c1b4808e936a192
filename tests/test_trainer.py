"""The trainer end to end on a small captured dataset: learning, exact resume after SIGKILL, warm start
(reusing the old mapping, refusing another contract), plateau stop, the node command and the settings
the SSH launcher left behind. Several nodes: tests/test_multinode.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.data.capture_contract import ContractMismatch
from pipeline.records import DatasetRecord, DatasetShard
from pipeline.stages import run_stage
from pipeline.stages.train import training_fingerprint
from pipeline.storage import open_store
from pipeline.training.nodes import torchrun_args
from tests.conftest import REPO, captured_dataset, published, storage_config, tiny_config_dict


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir):
    tmp = tmp_path_factory.mktemp("trainer")
    data = tiny_config_dict(storage_config("file", tmp, None))
    data["prompts"].update({"num_samples": 64, "shard_size": 16, "eval_fraction": 0.0})
    data["generate"]["max_new_tokens"] = 24
    data["train"].update({"epochs": 3, "checkpoint_every_steps": 2, "log_every": 1, "micro_batch_size": 4})
    data["capture"]["parity"] = {"samples": 0}
    config = load_config(data=data)
    store = open_store(config.storage)
    dataset_uri = captured_dataset(config, store, "d")
    return {"data": data, "config": config, "store": store, "dataset": dataset_uri, "tmp": tmp}


def train_manifest(setup, result):
    return published(setup["store"], result)


def history(setup, result):
    return [{k: v for k, v in epoch.items()} for epoch in train_manifest(setup, result)["history"]]


def workdir(setup, run_id, config=None):
    """The run's training work dir (one per dataset + settings fingerprint)."""
    from pipeline.records import read_dataset

    config = config or setup["config"]
    store = setup["store"]
    dataset = read_dataset(store, setup["dataset"])
    return config.storage.run_workdir(run_id) / f"train-{training_fingerprint(config, dataset)}"


def test_training_learns_and_writes_metrics(setup):
    result = run_stage(
        "train", setup["config"], "uninterrupted", setup["store"], dataset_uri=setup["dataset"]
    )
    epochs = history(setup, result)
    assert len(epochs) == 3 and train_manifest(setup, result)["result"]["stop_reason"] == "completed"
    assert epochs[-1]["cond_acc"][0] > epochs[0]["cond_acc"][0] and epochs[-1]["cond_acc"][0] > 0.2
    lines = [
        json.loads(line)
        for line in (workdir(setup, "uninterrupted") / "metrics.jsonl").read_text().splitlines()
    ]
    assert {line["kind"] for line in lines} == {"interval", "epoch"}
    steps = [line["global_step"] for line in lines if line["kind"] == "interval"]
    assert steps == sorted(set(steps))
    for key in ("loss", "acc", "full_acc", "cond_acc", "tau_simulated"):
        assert key in lines[-1]


def test_a_run_killed_mid_training_resumes_to_the_same_end(setup):
    config_path = setup["tmp"] / "config.yaml"
    config_path.write_text(yaml.safe_dump(setup["data"]))
    command = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "train",
        "--config",
        str(config_path),
        "--run-id",
        "killed",
        "--dataset",
        setup["dataset"],
    ]
    process = subprocess.Popen(
        command, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        metrics = workdir(setup, "killed") / "metrics.jsonl"
        done = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if any(line["global_step"] >= 7 for line in done):
            break
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert (workdir(setup, "killed") / "checkpoints" / "latest").exists()
    assert not (workdir(setup, "killed") / "train_result.json").exists()
    checkpoints = workdir(setup, "killed") / "checkpoints"
    partial = (
        checkpoints / "step-99999999"
    )  # what a kill in the middle of a save leaves: files, never committed
    partial.mkdir(exist_ok=True)
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"cut off")
    resumed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint" in resumed.stderr
    committed = json.loads((checkpoints / "committed.json").read_text())
    assert not partial.exists() and len(committed) == 2
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == sorted(committed)
    assert (checkpoints / "latest").read_text() == committed[-1]
    store = setup["store"]
    from pipeline.manifest import read_manifest

    resumed_history = read_manifest(store, "runs/killed/train", kind="train")["history"]
    straight = read_manifest(store, "runs/uninterrupted/train", kind="train")["history"]
    assert resumed_history == straight
    weights = [
        load_file(str(workdir(setup, run) / "drafter" / "model.safetensors"))
        for run in ("killed", "uninterrupted")
    ]
    assert all((weights[0][name] == weights[1][name]).all() for name in weights[1])
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len([line for line in lines if line["kind"] == "interval"]) == len(
        {line["global_step"] for line in lines if line["kind"] == "interval"}
    )


def test_warm_start_reuses_the_old_mapping_and_refuses_another_contract(setup):
    source = workdir(setup, "uninterrupted") / "drafter"
    config = load_config(
        data={
            **setup["data"],
            "train": {**setup["data"]["train"], "init": "warm", "init_from": str(source), "epochs": 1},
            "drafter": {**setup["data"]["drafter"], "draft_vocab_size": 100},
        }
    )
    result = run_stage("train", config, "warm", setup["store"], dataset_uri=setup["dataset"])
    old, new = (
        load_file(str(path / "model.safetensors"))
        for path in (source, workdir(setup, "warm", config) / "drafter")
    )
    assert (old["d2t"] == new["d2t"]).all() and new["lm_head.weight"].shape[0] == old["lm_head.weight"].shape[
        0
    ] != 100
    assert train_manifest(setup, result)["init_from"] == str(source)
    other = setup["tmp"] / "other-contract"
    shutil.copytree(source, other)
    for name, edit in (
        ("capture_contract.json", lambda c: c.update(aux_layer_ids=[0, 2, 3])),
        ("config.json", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 3])),
    ):
        content = json.loads((other / name).read_text())
        edit(content)
        (other / name).write_text(json.dumps(content))
    config = load_config(
        data={**setup["data"], "train": {**setup["data"]["train"], "init": "warm", "init_from": str(other)}}
    )
    with pytest.raises(ContractMismatch, match="aux_layer_ids"):
        run_stage("train", config, "warm-refused", setup["store"], dataset_uri=setup["dataset"])


def test_training_stops_on_a_plateau(setup):
    data = {
        **setup["data"],
        "train": {
            **setup["data"]["train"],
            "epochs": 6,
            "learning_rate": 1e-9,
            "checkpoint_every_steps": 0,
            "plateau": {"enabled": True, "window_epochs": 1, "min_gain": 0.05},
        },
        "gate": {"min_cond_acc": [0.9]},
    }
    result = run_stage(
        "train", load_config(data=data), "plateau", setup["store"], dataset_uri=setup["dataset"]
    )
    assert train_manifest(setup, result)["result"]["stop_reason"] == "plateau"
    assert train_manifest(setup, result)["result"]["epochs_run"] == 2


def test_one_node_runs_standalone_and_several_meet_at_the_rendezvous(tmp_path):
    def settings(**train):
        return load_config(
            data={"storage": {"root": str(tmp_path)}, "target": {"name": "t"}, "train": train}
        ).train

    worker = ["--module", "pipeline.cli", "train-worker", "--spec", "s3://b/runs/r/train/worker_spec.json"]
    assert (
        torchrun_args(settings(nproc=8), worker[-1], "r")
        == ["--standalone", "--nproc-per-node", "8"] + worker
    )
    several = settings(
        nproc=8, nodes=4, rendezvous_endpoint="drafter-trainer-0.drafter-trainer", rendezvous_timeout_s=1800
    )
    assert (
        torchrun_args(several, worker[-1], "r")
        == [
            "--nnodes",
            "4",
            "--nproc-per-node",
            "8",
            "--max-restarts",
            "0",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "drafter-trainer-0.drafter-trainer:29400",
            "--rdzv-id",
            "r",
            "--rdzv-conf",
            "join_timeout=1800,read_timeout=1800",
        ]
        + worker
    )


@pytest.mark.parametrize(
    "removed, instead",
    [
        ("train.hostfile=/etc/drafter-hostfile/hostfile", "train.hostfile was removed"),
        ("train.launcher=deepspeed", "train.launcher 'deepspeed' was removed"),
    ],
)
def test_settings_of_the_ssh_launcher_are_refused_with_what_to_use_instead(tmp_path, removed, instead):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=instead) as refused:
        load_config(REPO / "configs" / "local.yaml", [removed])
    assert "train.nodes, train.rendezvous_endpoint and train.rendezvous_port" in str(refused.value)
    with pytest.raises(ConfigError, match="need train.rendezvous_endpoint"):
        load_config(REPO / "configs" / "local.yaml", ["train.nodes=2"])


def test_placement_settings_keep_the_checkpoints_of_a_run(tmp_path):
    """A rerun whose nodes meet on another port resumes the same work dir; another node count does not."""
    data = {
        "storage": {"root": str(tmp_path)},
        "target": {"name": "t"},
        "train": {"nodes": 2, "rendezvous_endpoint": "127.0.0.1"},
    }
    dataset = DatasetRecord.model_construct(
        uri="u", created_at="c", train_shards=[DatasetShard.model_construct(sha256="s")]
    )

    def fingerprint(**train):
        return training_fingerprint(load_config(data={**data, "train": {**data["train"], **train}}), dataset)

    assert fingerprint(rendezvous_port=29401) == fingerprint(rendezvous_port=29402, launcher="kubernetes")
    assert fingerprint(nodes=3) != fingerprint()
