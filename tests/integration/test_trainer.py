"""The trainer end to end on a small captured dataset: learning, the best held-out epoch exported, exact
resume after SIGKILL, warm start (reusing the old mapping, refusing another contract), plateau stop, the
node command and the settings the SSH launcher left behind. Several nodes: tests/system/test_multinode.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.data.capture_contract import ContractMismatch
from pipeline.manifest import read_manifest
from pipeline.ops.report import init_rows, render, status_table
from pipeline.promotion import gate_record
from pipeline.records import DatasetRecord, DatasetShard, EvalRecord, read_record
from pipeline.stages import run_stage
from pipeline.stages.train import training_fingerprint
from pipeline.storage import open_store
from pipeline.training.nodes import torchrun_args
from pipeline.training.worker import BEST_EPOCH_DIR
from tests.conftest import REPO, captured_dataset, published, storage_config, tiny_config_dict


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir):
    tmp = tmp_path_factory.mktemp("trainer")
    data = tiny_config_dict(storage_config("file", tmp, None))
    data["prompts"].update({"num_samples": 80, "shard_size": 16, "eval_fraction": 0.2})
    data["generate"]["max_new_tokens"] = 24
    data["train"].update({"epochs": 3, "checkpoint_every_steps": 2, "log_every": 1, "micro_batch_size": 4})
    data["capture"]["parity"] = {"samples": 0}
    config = load_config(data=data)
    store = open_store(config.storage)
    dataset_uri = captured_dataset(config, store, "d")
    return {"data": data, "config": config, "store": store, "dataset": dataset_uri, "tmp": tmp}


@pytest.fixture(scope="module")
def uninterrupted(setup):
    """The module's reference training run, `uninterrupted` (3 epochs, no kill): the drafter the warm
    starts begin from and what the killed run must resume to."""
    return run_stage("train", setup["config"], "uninterrupted", setup["store"], dataset_uri=setup["dataset"])


def tensorboard_scalars(store, prefix: str, local) -> dict[str, list[tuple[int, float]]]:
    """The event files under `prefix`, as TensorBoard's own reader loads them: (step, value) per tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    local.mkdir(parents=True, exist_ok=True)
    names = [key.rsplit("/", 1)[1] for key in store.list(prefix)]
    assert names and all(name.startswith("events.out.tfevents.") for name in names), names
    for name in names:
        (local / name).write_bytes(store.get_bytes(f"{prefix}/{name}"))
    accumulator = EventAccumulator(str(local), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


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


def test_training_learns_and_writes_metrics(setup, uninterrupted):
    result = uninterrupted
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
    assert all(line["tokens_per_s"] > 0 for line in lines if line["kind"] == "interval")
    # the same curves as TensorBoard event files under the run's prefix: a point per logging interval for
    # loss_k, cond_acc_k, simulated acceptance, learning rate and throughput; a point per epoch held out
    manifest = train_manifest(setup, result)
    assert manifest["tracking"] == {"tensorboard": setup["store"].uri("runs/uninterrupted/train/tensorboard")}
    curves = tensorboard_scalars(setup["store"], "runs/uninterrupted/train/tensorboard", setup["tmp"] / "tb")
    intervals = [line for line in lines if line["kind"] == "interval"]
    for tag, value in (
        ("train/loss_2", lambda line: line["loss"][2]),
        ("train/cond_acc_0", lambda line: line["cond_acc"][0]),
        ("train/tau_simulated", lambda line: line["tau_simulated"]),
        ("train/lr", lambda line: line["lr"]),
        ("train/tokens_per_s", lambda line: line["tokens_per_s"]),
    ):
        assert [step for step, _ in curves[tag]] == steps, tag
        assert [v for _, v in curves[tag]] == pytest.approx([value(line) for line in intervals], rel=1e-6)
    epoch_steps = [line["global_step"] for line in lines if line["kind"] == "epoch"]
    assert [step for step, _ in curves["heldout/tau_simulated"]] == epoch_steps and len(epoch_steps) == 3


def test_the_exported_drafter_is_the_epoch_with_the_best_held_out_acceptance(setup, uninterrupted):
    """Every epoch is scored on the eval split; the drafter exported is the best one, and evaluating it
    again (the evaluate stage) gives that epoch's held-out tau."""
    store, result = setup["store"], uninterrupted
    manifest = train_manifest(setup, result)
    taus = [epoch["heldout"]["tau_simulated"] for epoch in manifest["history"]]
    assert len(taus) == 3 and all(tau >= 1.0 for tau in taus)
    chosen = taus.index(max(taus))  # the earliest of equals
    assert manifest["result"]["chosen_epoch"] == chosen
    assert manifest["result"]["heldout_tau_by_epoch"] == taus
    evaluation = run_stage("evaluate", setup["config"], "uninterrupted", store, dataset_uri=setup["dataset"])
    # evaluated a domain at a time, the pooled figure is still the one training scored on all held-out samples
    assert published(store, evaluation)["summary"]["tau_simulated"] == pytest.approx(taus[chosen], abs=1e-5)
    record = read_record(store, evaluation.uri, EvalRecord)
    assert set(record.domains) == {"data-formats", "runtime"}  # the demo corpus's two domains
    assert sum(domain.samples for domain in record.domains.values()) == record.samples
    assert all(len(domain.cond_acc) == record.ttt_steps for domain in record.domains.values())
    assert len(list((workdir(setup, "uninterrupted") / BEST_EPOCH_DIR).iterdir())) == 1


def test_a_later_worse_epoch_is_not_the_one_exported(tmp_path):
    """Held-out tau 1.5, 1.8, then 1.2: epoch 1's weights are exported and the run summary names it."""
    from pipeline.drafter.export import export_drafter, read_drafter_dir
    from pipeline.records import RunSummary
    from pipeline.run import epoch_selection, format_table
    from pipeline.training.worker import keep_if_best, prune_best_weights, restore_best, selection_summary
    from tests.builders import small_drafter

    drafter = small_drafter(seed=0)
    best_dir = tmp_path / BEST_EPOCH_DIR
    best, history, weights = None, [], []
    for epoch, tau in enumerate([1.5, 1.8, 1.2]):
        trained = small_drafter(seed=epoch + 1)  # what this epoch's training left
        drafter.load_state_dict(trained.state_dict())
        weights.append({k: v.clone() for k, v in trained.state_dict().items()})
        heldout = {"tau_simulated": tau, "cond_acc": [0.5]}
        history.append({"epoch": epoch, "heldout": heldout})
        best = keep_if_best(best, epoch, heldout, drafter, best_dir)
        prune_best_weights(best_dir, best)
    assert best == {"epoch": 1, "tau_simulated": 1.8}
    assert [p.name for p in best_dir.iterdir()] == ["epoch-0001.safetensors"]
    restore_best(drafter, best_dir, best)
    contract = {"aux_layer_ids": drafter.arch.aux_layer_ids}
    _, exported, _ = read_drafter_dir(export_drafter(drafter, contract, tmp_path / "drafter", "float32"))
    assert all(torch.equal(exported[name], weights[1][name]) for name in weights[1])
    assert not torch.equal(exported["fc.weight"], weights[2]["fc.weight"])
    selection = selection_summary(history, best)
    assert selection["chosen_epoch"] == 1 and selection["heldout_tau_by_epoch"] == [1.5, 1.8, 1.2]
    summary = RunSummary(
        run_id="r",
        target="t",
        samples=1,
        tokens=1,
        cond_acc=[0.5],
        stop_reason="completed",
        outcome="promoted",
        report="r.html",
        **epoch_selection(selection),
    )
    assert summary.chosen_epoch == 1 and "chosen epoch (from 0)  1" in format_table(summary)


def test_a_run_killed_mid_training_resumes_to_the_same_end(setup, uninterrupted):
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
    resumed_history = read_manifest(store, "runs/killed/train", kind="train")["history"]
    straight = read_manifest(store, "runs/uninterrupted/train", kind="train")["history"]
    assert resumed_history == straight
    resumed_result = read_manifest(store, "runs/killed/train", kind="train")["result"]
    straight_result = read_manifest(store, "runs/uninterrupted/train", kind="train")["result"]
    for key in ("chosen_epoch", "heldout_tau_by_epoch"):  # the best-so-far survives the kill
        assert resumed_result[key] == straight_result[key]
    weights = [
        load_file(str(workdir(setup, run) / "drafter" / "model.safetensors"))
        for run in ("killed", "uninterrupted")
    ]
    assert all((weights[0][name] == weights[1][name]).all() for name in weights[1])
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len([line for line in lines if line["kind"] == "interval"]) == len(
        {line["global_step"] for line in lines if line["kind"] == "interval"}
    )
    # TensorBoard, reading both attempts' event files from the run's prefix, shows each step once: the
    # resumed attempt's file purges the steps it redid
    curves = tensorboard_scalars(store, "runs/killed/train/tensorboard", setup["tmp"] / "tb-killed")
    intervals = [line["global_step"] for line in lines if line["kind"] == "interval"]
    assert [step for step, _ in curves["train/loss_0"]] == intervals
    assert [value for _, value in curves["train/loss_0"]] == pytest.approx(
        [line["loss"][0] for line in lines if line["kind"] == "interval"], rel=1e-6
    )


def test_training_curves_go_to_an_mlflow_tracking_server(setup, mlflow_server):
    from mlflow.tracking import MlflowClient

    tracking = {"mlflow_uri": mlflow_server, "mlflow_experiment": "drafter-tests"}
    config = load_config(
        data={**setup["data"], "train": {**setup["data"]["train"], "epochs": 1}, "tracking": tracking}
    )
    result = run_stage("train", config, "tracked", setup["store"], dataset_uri=setup["dataset"])
    mlflow = train_manifest(setup, result)["tracking"]["mlflow"]
    client = MlflowClient(mlflow_server)
    run = client.get_run(mlflow["run_id"])
    assert mlflow["url"] == f"{mlflow_server}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert run.info.status == "FINISHED" and run.data.tags["drafter.run_id"] == "tracked"
    lines = [json.loads(line) for line in (workdir(setup, "tracked", config) / "metrics.jsonl").open()]
    intervals = [line for line in lines if line["kind"] == "interval"]
    loss = sorted(client.get_metric_history(run.info.run_id, "train/cond_acc_1"), key=lambda m: m.step)
    assert [m.step for m in loss] == [line["global_step"] for line in intervals]
    assert [m.value for m in loss] == pytest.approx([line["cond_acc"][1] for line in intervals], rel=1e-6)
    [heldout] = client.get_metric_history(run.info.run_id, "heldout/tau_simulated")
    assert heldout.value == pytest.approx(lines[-1]["heldout"]["tau_simulated"])


def test_an_unreachable_mlflow_server_fails_training_before_it_starts(setup, monkeypatch):
    from pipeline.processes import free_port
    from pipeline.training.nodes import TrainingFailed

    monkeypatch.setenv(
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"
    )  # MLflow's own knob; its default retries 7 times
    nowhere = f"http://127.0.0.1:{free_port()}"
    config = load_config(data={**setup["data"], "tracking": {"mlflow_uri": nowhere}})
    with pytest.raises(TrainingFailed, match=f"the MLflow tracking server {nowhere} .* did not answer"):
        run_stage("train", config, "untracked", setup["store"], dataset_uri=setup["dataset"])
    assert not setup["store"].exists("runs/untracked/train/worker_spec.json")


def test_warm_start_reuses_the_old_mapping_and_refuses_another_contract(setup, uninterrupted):
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
        (
            "config.json",
            lambda c: (
                c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 3]),
                c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4]),  # vLLM's ids for layers 0, 2, 3
            ),
        ),
    ):
        content = json.loads((other / name).read_text())
        edit(content)
        (other / name).write_text(json.dumps(content))
    config = load_config(
        data={**setup["data"], "train": {**setup["data"]["train"], "init": "warm", "init_from": str(other)}}
    )
    with pytest.raises(ContractMismatch, match="aux_layer_ids"):
        run_stage("train", config, "warm-refused", setup["store"], dataset_uri=setup["dataset"])


def test_an_eagle31_drafter_trains_and_exports_its_norms_and_warm_starts_only_an_eagle31(setup):
    """drafter.architecture eagle3.1 through the same trainer: its fc_norm weights train and are exported with
    the flags, the directory loads back as eagle3.1, and an eagle3 run refuses to warm-start from it."""
    from pipeline.drafter.export import load_drafter
    from pipeline.engines.target import describe_target, load_frozen_tensors

    train = {**setup["data"]["train"], "epochs": 1, "checkpoint_every_steps": 0}
    drafter = {**setup["data"]["drafter"], "architecture": "eagle3.1"}
    config = load_config(data={**setup["data"], "train": train, "drafter": drafter})
    result = run_stage("train", config, "eagle31", setup["store"], dataset_uri=setup["dataset"])
    assert train_manifest(setup, result)["result"]["stop_reason"] == "completed"
    assert all(torch.isfinite(torch.tensor(epoch["loss"])).all() for epoch in history(setup, result))
    directory = workdir(setup, "eagle31", config) / "drafter"
    exported = json.loads((directory / "config.json").read_text())
    assert (exported["fc_norm"], exported["norm_before_fc"], exported["norm_output"]) == (True, False, True)
    assert exported["drafter_architecture"] == "eagle3.1"
    tensors = load_file(str(directory / "model.safetensors"))
    norms = [tensors[f"fc_norm.{i}.weight"] for i in range(3)]
    assert all(not torch.equal(norm, torch.ones_like(norm)) for norm in norms)  # trained from ones
    model, _ = load_drafter(
        directory, load_frozen_tensors(describe_target(config).model_dir)["embed"].float()
    )
    assert (model.arch.fc_norm, model.arch.norm_output) == (True, True)
    plain = load_config(
        data={**setup["data"], "train": {**train, "init": "warm", "init_from": str(directory)}}
    )
    with pytest.raises(ContractMismatch, match="initial drafter is a eagle3.1 drafter"):
        run_stage("train", plain, "eagle3-from-eagle31", setup["store"], dataset_uri=setup["dataset"])


def auto_init_config(setup, init_from: str | None, gate_bar: float = 0.99, **auto_init):
    """train.init auto, one epoch at a learning rate that learns nothing, under a gate bar (by default one
    nothing reaches)."""
    train = {**setup["data"]["train"], "init": "auto", "epochs": 1, "learning_rate": 1e-9}
    train.update({"checkpoint_every_steps": 0, "auto_init": auto_init, "init_from": init_from})
    return load_config(data={**setup["data"], "train": train, "gate": {"min_cond_acc": [gate_bar]}})


def test_auto_restarts_a_stalled_warm_start_from_scratch_within_the_run(setup, uninterrupted):
    """The incumbent was trained on this same target, so auto warm-starts from it; its cond_acc_0 does not
    move within plateau_steps and is under the gate's bar, so the attempt stops and the run goes on from
    scratch. The manifest records both attempts, their reasons and curves."""
    store, source = setup["store"], workdir(setup, "uninterrupted") / "drafter"
    config = auto_init_config(setup, str(source), plateau_steps=3, plateau_min_gain=0.05)
    result = run_stage("train", config, "auto-stalled", store, dataset_uri=setup["dataset"])
    manifest = train_manifest(setup, result)
    warm, scratch = manifest["attempts"]
    assert (warm["init"]["requested"], warm["init"]["chosen"]) == ("auto", "warm")
    assert "same target" in warm["init"]["reason"] and warm["init"]["source"] == str(source)
    steps_per_epoch = manifest["result"]["steps_per_epoch"]
    assert warm["stop_reason"] == "warm_plateau" and 4 <= warm["global_steps"] < steps_per_epoch
    assert (scratch["init"]["requested"], scratch["init"]["chosen"]) == ("auto", "scratch")
    assert "plateaued" in scratch["init"]["reason"] and scratch["stop_reason"] == "completed"
    assert manifest["init"] == scratch["init"] and manifest["init_from"] is None
    # the warm attempt's curve is kept beside the run's own
    curve = [
        json.loads(line) for line in store.get_bytes(store.key_for(warm["metrics"])).decode().splitlines()
    ]
    assert [line["global_step"] for line in curve if line["kind"] == "interval"][-1] == warm["global_steps"]
    assert manifest["result"]["global_steps"] == steps_per_epoch and scratch["history"] == manifest["history"]
    # evaluation, the gate's record and `drafter status` carry both attempts
    evaluation = run_stage("evaluate", config, "auto-stalled", store, dataset_uri=setup["dataset"])
    record = read_record(store, evaluation.uri, EvalRecord)
    decision = gate_record(record, config.gate, "auto-stalled")
    assert [choice.chosen for choice in decision.init] == ["warm", "scratch"]
    report = render(store, "auto-stalled", config.target.name)
    assert "attempts" in report["plots"]  # both attempts' cond_acc_0 curves, beside the gate's bar
    page = store.get_bytes("runs/auto-stalled/report/report.html").decode()
    assert "training attempt 2" in page and "plateaued at training cond_acc_0" in page
    table = status_table(store, config.target.name, limit=100)
    assert "training attempt 1: warm (train.init auto): " in table
    assert "training attempt 2: scratch (train.init auto): the warm start from" in table


def _drafter_for_rare_tokens(setup, source: Path, dest: Path) -> None:
    """A copy of `source` from "another target": its draft vocabulary is the data's LEAST used assistant
    tokens, so it cannot emit the ones the data's answers use (the mechanism of
    benchmarks/exp_warm_start_vocab_shift.py, where the new target's frequent tokens carry other ids)."""
    from safetensors.torch import save_file

    from pipeline.drafter.vocab import build_mapping
    from pipeline.records import read_dataset
    from pipeline.training.stream import ShardRef, assistant_token_counts

    shutil.copytree(source, dest)
    dataset = read_dataset(setup["store"], setup["dataset"])
    shards = [ShardRef.from_manifest(entry) for entry in dataset.train_shards]
    counts = assistant_token_counts(setup["store"], shards, dataset.contract.vocab_size)
    tensors = load_file(str(dest / "model.safetensors"))
    rare = build_mapping(counts.max() - counts, tensors["d2t"].numel())
    assert int(counts[rare.used_ids].sum()) < 0.01 * int(counts.sum())
    tensors.update(d2t=rare.d2t.to(tensors["d2t"].dtype), t2d=rare.t2d.to(tensors["t2d"].dtype))
    save_file(tensors, str(dest / "model.safetensors"))
    contract = json.loads((dest / "capture_contract.json").read_text())
    contract["target"].update(revision="previous")
    (dest / "capture_contract.json").write_text(json.dumps(contract))


def test_auto_restarts_a_warm_start_whose_vocabulary_misses_the_new_targets_tokens(
    setup, uninterrupted, tmp_path
):
    """The miniature's failure as a test: an incumbent of another target whose draft vocabulary holds none
    of the new data's tokens. Auto's probe sees it and chooses scratch. Made to warm-start anyway (probe bar
    0, vocabulary check off), it stalls at the learning rate scratch learns with; auto stops it within
    plateau_steps and the run goes on from scratch, which learns."""
    from pipeline.records import read_dataset
    from pipeline.stages.train import choose_init

    store, source = setup["store"], workdir(setup, "uninterrupted") / "drafter"
    other = tmp_path / "rare-token-drafter"
    _drafter_for_rare_tokens(setup, source, other)
    train = {**setup["data"]["train"], "init": "auto", "init_from": str(other), "epochs": 1}
    train.update(checkpoint_every_steps=0, auto_init={"min_probe_cond_acc": 0.0, "plateau_steps": 3})
    config = load_config(data={**setup["data"], "train": train})
    directory, choice = choose_init(config, store, read_dataset(store, setup["dataset"]), tmp_path / "w")
    assert directory is None and choice.chosen == "scratch" and choice.vocabulary is not None
    assert choice.vocabulary.incumbent_outside > 0.99 > 0.05 > choice.vocabulary.fresh_outside
    assert "but its draft vocabulary misses" in choice.reason
    train["auto_init"] = {**train["auto_init"], "max_vocabulary_gap": 1.0}
    config = load_config(data={**setup["data"], "train": train})
    result = run_stage("train", config, "auto-rare", store, dataset_uri=setup["dataset"])
    warm, scratch = train_manifest(setup, result)["attempts"]
    assert warm["init"]["chosen"] == "warm" and "clears the bar 0.000" in warm["init"]["reason"]
    assert warm["stop_reason"] == "warm_plateau"
    assert max(acc for _, acc in warm["cond_acc0_by_step"]) < 0.05  # it cannot emit what the data says
    assert scratch["init"]["chosen"] == "scratch" and scratch["stop_reason"] == "completed"
    assert scratch["cond_acc0_by_step"][-1][1] > 3 * max(acc for _, acc in warm["cond_acc0_by_step"])


def _drafter_reading_features_another_way(source: Path, dest: Path, share: float) -> None:
    """A copy of `source` from "another target" whose hidden states differ: its fc reads `share` of each
    feature from a permuted one, as a drafter would on a target whose hidden states moved."""
    from safetensors.torch import save_file

    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    fc = tensors["fc.weight"].float()
    moved = fc[:, torch.randperm(fc.shape[1], generator=torch.Generator().manual_seed(0))]
    tensors["fc.weight"] = ((1 - share) * fc + share * moved).to(tensors["fc.weight"].dtype)
    save_file(tensors, str(dest / "model.safetensors"))
    contract = json.loads((dest / "capture_contract.json").read_text())
    contract["target"].update(revision="previous")
    (dest / "capture_contract.json").write_text(json.dumps(contract))


def test_auto_restarts_a_warm_start_stalled_over_the_gates_bar_but_far_under_its_own_level(
    setup, uninterrupted, tmp_path
):
    """The K2 -> K2.5 shape: the incumbent in the registry reached its lineage's held-out cond_acc_0 on its
    own target; warm-started on a target whose hidden states differ, it stalls over the gate's bar and far
    under that level less auto_init.plateau_shortfall_vs_own. The gate's bar alone would keep it; auto
    restarts it from scratch, and the record says under what and why."""
    from pipeline.ops import registry

    store, source = setup["store"], workdir(setup, "uninterrupted") / "drafter"
    uninterrupted = read_manifest(store, "runs/uninterrupted/train", kind="train")
    own = max(entry["heldout"]["cond_acc"][0] for entry in uninterrupted["history"])
    other = tmp_path / "previous-target-drafter"
    _drafter_reading_features_another_way(source, other, share=0.72)
    lineage = {"run_id": "previous-target", "eval": {"cond_acc": [own], "tau_simulated": 1.0}}
    version, _ = registry.publish_version(
        store, setup["config"].target.name, other, lineage, {"steps": 3, "topk": 1, "draft_tokens": 4}
    )
    config = auto_init_config(
        setup,
        f"registry:{version}",
        0.05,
        min_probe_cond_acc=0.0,
        plateau_steps=3,
        plateau_shortfall_vs_own=0.1,
    )
    result = run_stage("train", config, "auto-own-level", store, dataset_uri=setup["dataset"])
    warm, scratch = train_manifest(setup, result)["attempts"]
    assert warm["init"]["chosen"] == "warm" and warm["init"]["version"] == version
    bar = warm["init"]["restart_under"]
    assert bar["cond_acc0"] == pytest.approx(own - 0.1)
    assert bar["reason"] == f"its own held-out cond_acc_0 {own:.3f} in its registry lineage, less 0.1"
    stalled = [acc for _, acc in warm["cond_acc0_by_step"]]
    assert warm["stop_reason"] == "warm_plateau" and 0.05 < min(stalled) <= max(stalled) < own - 0.1
    assert scratch["init"]["chosen"] == "scratch" and f"under {own - 0.1:.3f}" in scratch["init"]["reason"]
    rows = dict(init_rows(train_manifest(setup, result)))
    assert f"a stall under training cond_acc_0 {own - 0.1:.3f} restarts it" in rows["training attempt 1"]


def test_auto_probes_an_incumbent_of_another_target_and_trains_from_scratch_below_the_bar(
    setup, uninterrupted, tmp_path
):
    store, source = setup["store"], workdir(setup, "uninterrupted") / "drafter"
    other = tmp_path / "previous-target-drafter"
    shutil.copytree(source, other)
    contract = json.loads((other / "capture_contract.json").read_text())
    contract["target"].update(revision="previous", config_sha256="0" * 64)
    (other / "capture_contract.json").write_text(json.dumps(contract))
    config = auto_init_config(setup, str(other), min_probe_cond_acc=0.99)
    result = run_stage("train", config, "auto-probed", store, dataset_uri=setup["dataset"])
    (attempt,) = train_manifest(setup, result)["attempts"]
    choice = attempt["init"]
    assert choice["chosen"] == "scratch" and "another target" in choice["reason"]
    assert choice["probe"]["bar"] == 0.99 and 0.0 < choice["probe"]["cond_acc"][0] < 0.99
    assert f"{choice['probe']['cond_acc'][0]:.3f}" in choice["reason"] and "revision" in choice["reason"]
    # the evaluate stage scores such an incumbent too (what serves the target until a candidate beats it),
    # with the probe's figures, and records that it was trained for another target
    from pipeline.engines.target import describe_target
    from pipeline.records import IncumbentEval, read_dataset
    from pipeline.stages.evaluate import evaluate_incumbent, heldout_shards

    dataset = read_dataset(store, setup["dataset"])
    scored = evaluate_incumbent(
        ("v-previous", other),
        dataset.contract.model_dump(mode="json"),
        heldout_shards(config, store, dataset),
        describe_target(config).model_dir,
        config.evaluate.ttt_steps or config.train.ttt_steps,
        config,
        [entry.domain for entry in dataset.eval_shards],
    )
    assert isinstance(scored, IncumbentEval) and scored.version == "v-previous"
    assert scored.cond_acc[0] == pytest.approx(choice["probe"]["cond_acc"][0])
    assert [difference.split(" ")[0] for difference in scored.target_differs] == ["revision", "config_sha256"]


def test_auto_without_an_incumbent_in_the_registry_chooses_scratch(setup, tmp_path):
    from pipeline.records import read_dataset
    from pipeline.stages.train import choose_init

    config = auto_init_config(setup, None)
    directory, choice = choose_init(
        config, setup["store"], read_dataset(setup["store"], setup["dataset"]), tmp_path
    )
    assert directory is None and choice.chosen == "scratch"
    assert choice.reason == "no drafter at registry:production to warm-start from"


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
        uri="u", created_at="c", train_shards=[DatasetShard.model_construct(sha256="s")], eval_shards=[]
    )

    def fingerprint(**train):
        return training_fingerprint(load_config(data={**data, "train": {**data["train"], **train}}), dataset)

    assert fingerprint(rendezvous_port=29401) == fingerprint(rendezvous_port=29402, launcher="kubernetes")
    assert fingerprint(nodes=3) != fingerprint()
