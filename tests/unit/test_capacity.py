"""`drafter plan`'s arithmetic on Kimi-K2.5's config, where nothing can run here: storage per encoding
measured with the real shard writer, compute from rates and replica counts, S3 cost. The CLI and measured
transport rates: tests/integration/test_capacity.py."""

import re

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.ops.capacity import PlanError, plan, shard_bytes_per_token
from pipeline.ops.deployment import DeploymentConfig, load_deployment
from pipeline.ops.plan_fit import deployment_fit, format_fit
from tests.conftest import KIMI_CONFIG, REPO


@pytest.fixture(scope="module")
def kimi():
    return load_config(KIMI_CONFIG)


@pytest.fixture(scope="module")
def kimi_plan(kimi):
    return plan(kimi, 200_000)


def test_bytes_per_token_follow_the_encodings():
    hidden = 7168
    fp8_topk = shard_bytes_per_token(hidden, "fp8", ("topk",), 16)
    bf16_last = shard_bytes_per_token(hidden, "bf16", ("last_hidden",), 16)
    # fp8: one byte per aux value plus a float32 scale per 128 channels of each layer (1x128 blocks);
    # top-16 ids and log-probs; the token id and mask
    aux_bytes = 3 * hidden + 3 * (hidden // 128) * 4
    assert aux_bytes < fp8_topk < aux_bytes + 16 * 8 + 16
    # bf16 aux + bf16 last hidden: the plain layout other tools store, plus the id and mask
    assert 4 * hidden * 2 <= bf16_last < 4 * hidden * 2 + 16


def test_kimi_200k_plan_is_consistent(kimi, kimi_plan):
    tokens = kimi_plan["tokens"]
    assert tokens["captured"] == pytest.approx(200_000 * tokens["per_sample"], rel=1e-6)
    storage = kimi_plan["storage"]
    assert storage["chosen"] == "fp8+topk"
    chosen = storage["encodings"]["fp8+topk"]
    assert chosen["bytes"] == pytest.approx(chosen["bytes_per_token"] * tokens["captured"], rel=1e-3)
    assert chosen["tb"] < 0.4 * storage["plain_bf16_tb"]
    generate = kimi_plan["stages"]["generate"]
    servers = len(kimi.generate.sglang.urls)
    assert generate["gpus"] == servers * kimi.target.tensor_parallel
    assert generate["wall_hours"] == pytest.approx(
        tokens["generated"] / (kimi.plan.generate_tok_s_per_server * servers) / 3600, rel=1e-2
    )
    assert generate["gpu_hours"] == pytest.approx(generate["wall_hours"] * generate["gpus"], rel=1e-2)
    train = kimi_plan["stages"]["train"]
    assert train["tokens"] == pytest.approx(tokens["trained_per_epoch"] * kimi.train.epochs, rel=1e-6)
    total = kimi_plan["total"]
    assert total["gpu_hours"] == pytest.approx(
        sum(s["gpu_hours"] for s in kimi_plan["stages"].values()), abs=0.2
    )
    assert total["usd"] >= total["gpu_usd"] + total["s3_usd"]["storage_usd"] - 1


def test_fleets_cost_their_stage_plus_loading_and_would_idle_left_up(kimi):
    small = plan(kimi, 5_000)  # a run whose fleets are up for less than a week
    fleets, stages = small["fleets"], small["stages"]
    load_hours = small["assumptions"]["server_load_minutes"] / 60
    for name in ("generate", "capture"):
        row = fleets["servers"][name]
        assert row["gpus"] == stages[name]["gpus"]
        assert row["up_hours"] == pytest.approx(stages[name]["wall_hours"] + load_hours, abs=0.1)
    gpus = 8 * (len(kimi.generate.sglang.urls) + len(kimi.capture.sglang.urls))  # TP-8 servers
    assert fleets["always_on_gpus"] == gpus and fleets["always_on_gpu_hours_per_week"] == gpus * 168
    up = sum(row["gpus"] * row["up_hours"] for row in fleets["servers"].values())
    assert 0 < fleets["idle_gpu_hours_per_week"] == pytest.approx(gpus * 168 - up, abs=0.5)


def test_replicas_trade_wall_time_not_gpu_hours(kimi, kimi_plan):
    servers = {name: len(getattr(kimi, name).sglang.urls) for name in ("generate", "capture")}
    wider = plan(
        kimi,
        200_000,
        generate_servers=2 * servers["generate"],
        capture_servers=2 * servers["capture"],
        train_nodes=2,
    )
    for stage in ("generate", "capture", "train"):
        assert wider["stages"][stage]["wall_hours"] == pytest.approx(
            kimi_plan["stages"][stage]["wall_hours"] / 2, rel=0.02
        )
        assert wider["stages"][stage]["gpu_hours"] == pytest.approx(
            kimi_plan["stages"][stage]["gpu_hours"], rel=0.02
        )
    assert "2 node(s) x 8 GPUs" in wider["stages"]["train"]["layout"]


def test_more_samples_scale_storage_and_compute(kimi, kimi_plan):
    double = plan(kimi, 400_000)
    assert double["storage"]["encodings"]["fp8+topk"]["tb"] == pytest.approx(
        2 * kimi_plan["storage"]["encodings"]["fp8+topk"]["tb"], rel=0.01
    )
    assert double["total"]["gpu_hours"] == pytest.approx(2 * kimi_plan["total"]["gpu_hours"], rel=0.01)


def test_responses_are_capped_by_the_generation_limit(kimi):
    capped = plan(
        kimi.model_copy(
            update={
                "plan": kimi.plan.model_copy(
                    update={"response_tokens_mean": 1e6, "prompt_tokens_mean": kimi.capture.max_length}
                )
            }
        ),
        10,
    )
    assert capped["tokens"]["response_mean"] == kimi.generate.max_new_tokens * kimi.plan.assistant_turns
    assert capped["tokens"]["per_sample"] == kimi.capture.max_length


def test_bad_plan_input_is_refused(kimi):
    with pytest.raises(PlanError):
        plan(kimi, 0)
    with pytest.raises(ConfigError, match="gpu_hours_usd"):
        load_config(
            KIMI_CONFIG, ["plan.gpu_hours_usd=3"]
        )  # a misspelt assumption is an error, not a silent default
    three = plan(load_config(KIMI_CONFIG, ["train.nodes=3", "train.launcher=kubernetes"]), 1000)
    assert three["stages"]["train"]["gpus"] == 24


def with_plan(config, **values):
    return config.model_copy(update={"plan": config.plan.model_copy(update=values)})


def test_each_stage_names_what_binds_it(kimi, kimi_plan):
    stages, paths = kimi_plan["stages"], kimi_plan["capture_paths"]
    # a drafter trains faster than one node reads Kimi's captures from S3 (its FLOPs at the stated rate)
    assert stages["generate"]["bottleneck"] == "GPU (decoding)"
    assert stages["train"]["bottleneck"] == "S3 bandwidth"
    fast_read = plan(with_plan(kimi, s3_read_mb_s_per_node=1e6), 1000)["stages"]["train"]
    assert fast_read["bottleneck"] == "training"
    # over SGLang's JSON each server moves far fewer tokens than its GPUs prefill: no client fleet fixes that
    http = paths["http"]
    assert http["bottleneck"] == "transport" and not http["gpu_bound"]
    assert (
        http["tok_s_per_server"]
        == kimi.plan.transport_tok_s_per_server
        == stages["capture"]["tok_s"] / len(kimi.capture.sglang.urls)
    )
    assert http["clients_needed"] >= 1 and http["gpu_utilization"] < 0.05
    assert paths["in_process"]["gpu_bound"] and paths["in_process"]["gpu_hours"] < http["gpu_hours"] / 10
    few_clients = plan(with_plan(kimi, capture_clients=1, capture_client_cores=1), 1000)["capture_paths"][
        "http"
    ]
    assert few_clients["bottleneck"] == "client parse" and few_clients["clients_needed"] > 1
    slow_s3 = plan(with_plan(kimi, s3_write_mb_s=1.0, capture_clients=1), 1000)["capture_paths"]["http"]
    assert slow_s3["bottleneck"] == "S3 bandwidth"
    slow_read = plan(with_plan(kimi, s3_read_mb_s_per_node=1.0), 1000)["stages"]["train"]
    assert slow_read["bottleneck"] == "S3 bandwidth"
    encode_bound = plan(with_plan(kimi, shard_encode_tok_s_per_core=10.0), 1000)["capture_paths"][
        "in_process"
    ]
    assert encode_bound["bottleneck"] == "shard encoding" and not encode_bound["gpu_bound"]


def test_response_lengths_follow_thinking_and_a_measured_mean_wins(kimi):
    thinking = plan(kimi, 1000)["tokens"]["response_mean"]
    instant = plan(with_plan(kimi, thinking_fraction=0.0), 1000)["tokens"]["response_mean"]
    half = plan(with_plan(kimi, thinking_fraction=0.5), 1000)["tokens"]["response_mean"]
    assert (
        thinking == kimi.plan.response_tokens_thinking and instant == kimi.plan.response_tokens_non_thinking
    )
    assert half == pytest.approx((thinking + instant) / 2)
    assert plan(with_plan(kimi, response_tokens_mean=1234.0), 1000)["tokens"]["response_mean"] == 1234.0


def test_the_plan_stands_beside_torchspecs_published_run(kimi, kimi_plan):
    comparison = kimi_plan["torchspec"]
    assert comparison["published"]["h200_gpu_hours"] == 1500 and comparison["published"]["samples"] == 600_000
    at_600k = plan(kimi, 600_000, compare=False)
    assert comparison["this_plan"]["gpu_hours"] == at_600k["total"]["gpu_hours"]
    assert comparison["this_plan"]["tokens"] == at_600k["tokens"]["captured"]


def test_the_kubernetes_deployment_lets_the_pilot_finish(kimi):
    """One train attempt covers the 37K pilot's planned training with room, and no DAG's deadline alerts
    before the plan's hours are up (a train timeout shorter than the planned training could never finish)."""
    checks = deployment_fit(
        plan(kimi, 37_000),
        load_deployment(REPO / "configs/deployment/kubernetes.yaml").plan_limits(),
        kimi.prompts.shard_size,
    )
    assert [check["limit"] for check in checks] == [
        "stages.train.timeout_minutes",
        "stages.generate.timeout_minutes",
        "stages.capture.timeout_minutes",
        "gpu_pool_slots",
        "deadline_minutes.drafter_data",
        "deadline_minutes.drafter_train",
    ]
    assert all(check["fits"] for check in checks), checks
    train = checks[0]
    assert train["hours"] >= 1.2 * train["planned_hours"] > 10


def test_a_limit_shorter_than_the_plan_is_named(kimi):
    pilot = plan(kimi, 37_000)
    train_hours = pilot["stages"]["train"]["wall_hours"]
    short = DeploymentConfig.model_validate(
        {"stages": {"train": {"timeout_minutes": 12 * 60}}, "deadline_minutes": {"drafter_data": 600}}
    )
    checks = deployment_fit(pilot, short.plan_limits(), kimi.prompts.shard_size)
    assert [(check["limit"], check["fits"]) for check in checks] == [
        ("stages.train.timeout_minutes", False),
        # the stages' default timeout (60 minutes) under a pilot's shard
        ("stages.generate.timeout_minutes", False),
        ("stages.capture.timeout_minutes", False),
        ("gpu_pool_slots", False),  # 2 by default: the plan counts on 3 capture clients at once
        ("deadline_minutes.drafter_data", False),
    ]
    text = format_fit(checks, "short.yaml")
    assert f"12.0 h  planned {train_hours:.1f} h: TOO SHORT" in text
    assert "2    planned 3: TOO FEW: needs 3 capture shard tasks at once" in text
    assert "to fit: gpu_pool_slots of at least 3, and the pool as large" in text


KUBERNETES = load_deployment(REPO / "configs/deployment/kubernetes.yaml")
KUBERNETES_LIMITS = KUBERNETES.plan_limits()


def _configure(overrides, limits=KUBERNETES_LIMITS, dag_id="drafter_data"):
    from pipeline.tasks import configure_run

    plan_request = {"config_path": str(KIMI_CONFIG), "overrides": overrides, "run_id": "r1"}
    return configure_run(plan_request, None, {**KUBERNETES.usage_table(), "limits": limits}, dag_id)


def test_the_committed_production_config_fits_its_deployment_at_the_missions_scale(kimi):
    """configs/kimi-k2.5.yaml at 200,000 samples: generation and capture inside the data DAG's deadline,
    one train attempt inside its timeout (what `drafter plan --samples 200000 --deployment ...` prints)."""
    assert kimi.prompts.num_samples == 200_000
    checks = deployment_fit(plan(kimi, 200_000), KUBERNETES_LIMITS, kimi.prompts.shard_size)
    assert all(check["fits"] for check in checks), checks
    _configure([])  # and configure lets it start


def test_configure_refuses_a_data_run_past_its_deadline_and_says_what_fits():
    """Two capture servers, as the config had before: 860.8 h of generation and capture against 168 h.
    Refused before anything starts, naming the binding stage and each way to fit."""
    two = [f"http://sglang-capture-aux-{i}.sglang-capture-aux.sglang.svc:30000" for i in range(2)]
    with pytest.raises(ConfigError) as refused:
        _configure([f"capture.sglang.urls=[{','.join(two)}]"])
    text = str(refused.value)
    assert "cannot finish within the deployment's limits at 200,000 samples" in text
    assert "deadline_minutes.drafter_data is 168.0 h; the plan needs 860.8 h" in text
    assert "capture binds (777.5 h, bound by transport): 19 capture servers" in text
    assert "capture.engine inprocess (its plan: 13.3 h" in text
    assert "deadline_minutes.drafter_data of at least 51,648" in text


def test_configure_refuses_shards_that_cannot_finish_within_their_tasks_timeout():
    """Two capture servers shared by 4 shard tasks at once (the runbook's 2-4): each of the 100 shards of
    2,000 takes 777.5 h x 4 / 100 = 31.1 h against the capture task's 24 h, and a timeout kills the shard
    task. Refused, with the shard size, servers or timeout that fit."""
    two = [f"http://sglang-capture-aux-{i}.sglang-capture-aux.sglang.svc:30000" for i in range(2)]
    limits = {**KUBERNETES_LIMITS, "shards_in_flight": 4, "deadline_minutes": {}}
    with pytest.raises(ConfigError) as refused:
        _configure([f"capture.sglang.urls=[{','.join(two)}]"], limits)
    text = str(refused.value)
    assert (
        "stages.capture.timeout_minutes is 24.0 h; the plan needs 31.1 h (1.2 x one shard's time, 4 of"
        in text
    )
    assert "capture shards take 31.1 h: prompts.shard_size of at most 1,286 (it is 2,000)" in text
    assert "or 4 capture servers" in text and "or stages.capture.timeout_minutes of at least 2,240" in text
    # the committed fleet of 20 at the same 4 in flight: 3.1 h a shard
    _configure([], limits)


def test_the_runbook_sizes_the_gpu_pool_as_the_plan_assumes():
    runbook = (REPO / "docs" / "RUNBOOK.md").read_text()
    sizes = {int(found) for found in re.findall(r"airflow pools set drafter_gpu (\d+)", runbook)}
    assert sizes == {KUBERNETES.gpu_pool_slots}


def test_configure_checks_only_the_limits_on_its_own_dags_stages():
    """A train timeout shorter than the planned training refuses drafter_train's configure (with the nodes
    that would fit) and not drafter_data's, whose stages it does not limit."""
    short = {**KUBERNETES_LIMITS, "train_timeout_minutes": 60 * 60}
    _configure([], short, "drafter_data")
    with pytest.raises(ConfigError) as refused:
        _configure([], short, "drafter_train")
    text = str(refused.value)
    assert "stages.train.timeout_minutes is 60.0 h; the plan needs 117.6 h" in text
    assert "train binds (117.6 h, bound by S3 bandwidth): train.nodes 3 (the plan has 1)" in text


def test_configure_refuses_a_run_it_cannot_plan(tmp_path):
    """A target whose sizes neither the config declares nor a model directory holds: configure says the plan
    cannot be made instead of letting the run start unchecked."""
    with pytest.raises(
        ConfigError, match="capacity plan, which cannot be made: planning needs target.hidden_size"
    ):
        _configure(["target.hidden_size=null", f"target.model_path={tmp_path}"])
