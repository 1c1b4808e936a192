"""`drafter plan`: storage per encoding measured with the real shard writer, compute from rates and
replica counts, S3 cost; checked on Kimi-K2.5's config, where nothing can run here."""

import subprocess
import sys

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.ops.capacity import PlanError, plan, shard_bytes_per_token
from tests.conftest import REPO

KIMI = REPO / "configs" / "kimi-k2.5.yaml"


@pytest.fixture(scope="module")
def kimi():
    return load_config(KIMI)


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


def test_fleets_cost_their_stage_plus_loading_and_would_idle_left_up(kimi_plan):
    fleets, stages = kimi_plan["fleets"], kimi_plan["stages"]
    load_hours = kimi_plan["assumptions"]["server_load_minutes"] / 60
    for name in ("generate", "capture"):
        row = fleets["servers"][name]
        assert row["gpus"] == stages[name]["gpus"]
        assert row["up_hours"] == pytest.approx(stages[name]["wall_hours"] + load_hours, abs=0.1)
    assert fleets["always_on_gpus"] == 48 and fleets["always_on_gpu_hours_per_week"] == 48 * 168
    up = sum(row["gpus"] * row["up_hours"] for row in fleets["servers"].values())
    assert fleets["idle_gpu_hours_per_week"] == pytest.approx(48 * 168 - up, abs=0.5)


def test_replicas_trade_wall_time_not_gpu_hours(kimi, kimi_plan):
    wider = plan(kimi, 200_000, generate_servers=8, capture_servers=4, train_nodes=2)
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
        load_config(KIMI, ["plan.gpu_hours_usd=3"])  # a misspelt assumption is an error, not a silent default
    three = plan(load_config(KIMI, ["train.nodes=3", "train.launcher=kubernetes"]), 1000)
    assert three["stages"]["train"]["gpus"] == 24


def test_cli_prints_the_plan_table():
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", "--config", str(KIMI), "--samples", "200000"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for text in (
        "kimi-k2.5, 200,000 conversations",
        "fp8+topk",
        "<- config",
        "generate",
        "capture",
        "train",
        "GPU-hours",
        "S3:",
        "(configured)",
    ):
        assert text in result.stdout, text
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", "--config", str(KIMI), "--samples", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "--samples must be at least 1" in bad.stderr
