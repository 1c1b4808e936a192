"""`drafter plan`: storage per encoding measured with the real shard writer, compute from rates and
replica counts, S3 cost; checked on Kimi-K2.5's config, where nothing can run here."""

import subprocess
import sys

import pytest

from pipeline.config import load_config
from pipeline.ops.capacity import PlanError, plan
from tests.conftest import KIMI_CONFIG, REPO


@pytest.fixture(scope="module")
def kimi():
    return load_config(KIMI_CONFIG)


def test_cli_prints_the_plan_table():
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", "--config", str(KIMI_CONFIG), "--samples", "200000"],
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
        "bound by transport",
        "in-process (capture.engine inprocess):",
        "beside TorchSpec's published Kimi-K2.5 drafter",
    ):
        assert text in result.stdout, text
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", "--config", str(KIMI_CONFIG), "--samples", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "argument --samples: 0 is not between 1 and" in bad.stderr


def test_benchmarked_transport_replaces_the_assumptions_at_the_targets_width(kimi, tmp_path):
    from pipeline.ops.capacity import transport_rates

    figures = {
        "width": 3 * 7168,
        "capture_tok_s_ceiling_per_server": 500.0,
        "client_tok_s_per_core": 700.0,
        "shard_encode_tok_s_per_core": 400.0,
    }
    measured = plan(kimi, 1000, transport=transport_rates(figures, kimi, "t.json"))
    assert measured["capture_paths"]["http"]["tok_s_per_server"] == 500.0
    assert measured["rates_source"]["transport_tok_s_per_server"] == "benchmarked"
    assert measured["assumptions"]["shard_encode_tok_s_per_core"] == 400.0
    with pytest.raises(PlanError, match="--width 21504"):
        transport_rates({**figures, "width": 192}, kimi, "t.json")
    with pytest.raises(PlanError, match="not bench_capture_transport"):
        transport_rates({"width": 21504}, kimi, "t.json")
    (tmp_path / "t.json").write_text(__import__("json").dumps(figures))
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plan", "--config", str(KIMI_CONFIG), "--samples", "37000"]
        + ["--transport", str(tmp_path / "t.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "transport_tok_s_per_server 500.0 (benchmarked)" in result.stdout
    assert f"transport benchmarked in {tmp_path / 't.json'}" in result.stdout
