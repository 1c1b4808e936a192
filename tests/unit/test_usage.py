"""What a run's tasks held and cost (pipeline.ops.usage): the GPUs the deployment places each stage on for
the run's engines, every attempt recorded however it ended, the cost per stage and in total, a fleet's
servers from scale-up to scale-down, and what `drafter status` shows."""

import datetime as dt

import pytest

from pipeline.config import load_config
from pipeline.ops.deployment import load_deployment, usage_rates
from pipeline.ops.usage import Rates, metered, read_usage, record_fleet, run_cost, saved_per_1k_tokens
from pipeline.storage import open_store
from tests.conftest import REPO, storage_config, tiny_config_dict

KUBERNETES = REPO / "configs" / "deployment" / "kubernetes.yaml"


def test_a_runs_rates_follow_its_engines_and_its_training_nodes():
    table = load_deployment(KUBERNETES).usage_table()
    kimi = load_config("configs/kimi-k2.5.yaml", ["train.nodes=2"])
    rates = usage_rates(table, kimi)
    assert rates.gpu_hour_usd == 4.0 and rates.fleet_gpus_per_replica == {"generate": 8, "capture": 8}
    assert (rates.gpus["train"], rates.gpus["benchmark"], rates.gpus["capture"]) == (16, 8, 0)
    inprocess = usage_rates(table, load_config("configs/kimi-k2.5.yaml", ["capture.engine=inprocess"]))
    assert (inprocess.gpus["train"], inprocess.gpus["capture"]) == (8, 8)
    # the kubernetes launcher: 4 node pods of 8 GPUs; the train task's own pod only watches them
    jobs = usage_rates(
        table, load_config("configs/kimi-k2.5.yaml", ["train.nodes=4", "train.launcher=kubernetes"])
    )
    assert jobs.gpus["train"] == 32


@pytest.fixture
def store(tmp_path):
    config = load_config(data=tiny_config_dict(storage_config("file", tmp_path, None)))
    return open_store(config.storage)


def test_every_attempt_is_recorded_and_priced_per_stage(store):
    rates = Rates(gpus={"train": 8}, gpu_hour_usd=4.0)
    with pytest.raises(RuntimeError), metered(store, "r1", "train", "train", rates):
        raise RuntimeError("a lost node")
    with metered(store, "r1", "train", "train", rates):
        pass
    with metered(store, "r1", "gate", "gate", rates):
        pass
    records = read_usage(store, "r1")
    assert sorted((u.stage, u.outcome, u.gpus) for u in records) == [
        ("gate", "succeeded", 0),
        ("train", "failed", 8),
        ("train", "succeeded", 8),
    ]
    cost = run_cost(records)
    [train, gate] = cost.stages
    assert (train.stage, train.attempts, gate.attempts) == ("train", 2, 1)
    seconds = sum(u.seconds for u in records if u.stage == "train")
    assert train.gpu_hours == pytest.approx(seconds / 3600 * 8)
    assert train.cost_usd == pytest.approx(train.gpu_hours * 4.0) and gate.cost_usd == 0
    assert cost.cost_usd == pytest.approx(train.cost_usd)
    unpriced = Rates(gpus={"train": 8})
    with metered(store, "r2", "train", "train", unpriced):
        pass
    assert run_cost(read_usage(store, "r2")).cost_usd is None
    with metered(store, "r3", "train", "train", None):  # no rates: nothing recorded
        pass
    assert read_usage(store, "r3") == []


def test_a_fleets_servers_count_from_scale_up_to_scale_down(store):
    rates = Rates(fleet_gpus_per_replica={"generate": 8}, gpu_hour_usd=4.0)
    an_hour_ago = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)).isoformat()
    record_fleet(store, "data", "generate", {"scaled": True, "replicas": 2, "scaled_at": an_hour_ago}, rates)
    record_fleet(store, "data", "capture", {"scaled": False, "replicas": 0}, rates)  # not scaled: nothing
    [fleet] = run_cost(read_usage(store, "data")).stages
    assert fleet.stage == "generate fleet" and fleet.gpu_hours == pytest.approx(16, rel=1e-3)
    assert fleet.cost_usd == pytest.approx(64, rel=1e-3)


def test_the_serving_saving_per_1k_tokens():
    # 100 -> 150 tok/s saves 3.33 s per 1,000 tokens: on 8 GPUs at $4 an hour, $0.0296
    assert saved_per_1k_tokens(100, 150, 8, 4.0) == pytest.approx(10 / 3 / 3600 * 32)
    assert saved_per_1k_tokens(100, 80, 8, 4.0) < 0  # a slower drafter costs more
    assert saved_per_1k_tokens(100, 150, 0, 4.0) is None and saved_per_1k_tokens(100, 150, 8, None) is None


def test_status_lists_recent_runs_with_their_cost_data_runs_too(store):
    from pipeline.ops.report import status_table

    rates = Rates(gpus={"generate": 8}, gpu_hour_usd=4.0)
    with metered(store, "data-run", "generate", "generate", rates):
        pass
    table = status_table(store, "tiny")
    [row] = [line for line in table.splitlines() if line.strip().startswith("data-run")]
    assert "no training (generate)" in row and "$0.00" in row


def test_the_train_task_that_launches_a_node_job_holds_no_gpu():
    """With train.launcher kubernetes the train task's pod creates the Job of node pods and waits: N nodes
    need N GPU nodes, not N + 1, and no GPU sits idle under the watcher."""
    deployment = load_deployment(KUBERNETES)
    watcher = deployment.placed_fields("train", "kubernetes")
    limits = watcher["container_resources"].limits
    assert "nvidia.com/gpu" not in limits and watcher["node_selector"] == {} and watcher["tolerations"] == []
    assert watcher["image"] == deployment.kubernetes.images["pipeline"]
    single = deployment.placed_fields("train", "torchrun")  # trains in its own pod: its 8 GPUs
    assert single["container_resources"].limits["nvidia.com/gpu"] == "8"
