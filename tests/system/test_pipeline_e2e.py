"""`drafter run` end to end on the tiny target, as a user runs it: the CLI in a subprocess, training
in its own torchrun + DeepSpeed process group, everything in S3 (moto's server over HTTP)."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, storage_config, tiny_config_dict


def drafter(*args, env=None, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, s3_endpoint, tiny_target_dir):
    tmp = tmp_path_factory.mktemp("e2e")
    config_path = tmp / "config.yaml"
    data = tiny_config_dict(storage_config("s3", tmp, s3_endpoint))
    data["benchmark"]["serving_sampling"] = {"temperature": 1.0, "top_p": 0.95}
    data["benchmark"].update(batch_sizes=[1, 2], promote_at_batch_sizes=[1, 2])
    config_path.write_text(yaml.safe_dump(data))
    # placement as a deployment states it: the GPUs training and the benchmark hold, and their price
    deployment = tmp / "deployment.yaml"
    deployment.write_text(
        yaml.safe_dump({"gpu_hour_usd": 4.0, "stages": {"train": {"gpus": 2}, "benchmark": {"gpus": 1}}})
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu", DRAFTER_DEPLOYMENT=str(deployment))
    result = drafter("run", "--config", str(config_path), "--run-id", "e2e-run", env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return {"config": config_path, "env": env, "stdout": result.stdout, "tmp": tmp}


def test_run_prints_the_summary_table_and_its_location(e2e):
    lines = e2e["stdout"].strip().splitlines()
    assert lines[-1].startswith("summary=s3://") and lines[-1].endswith("/runs/e2e-run/summary.json")
    table = "\n".join(lines[:-1])
    for row in (
        "samples",
        "tokens",
        "cond_acc_0",
        "tau simulated",
        "tau measured",
        "baseline tok/s",
        "drafter tok/s",
        "promoted version",
        "registry",
    ):
        assert row in table


def test_summary_json_has_real_figures(e2e):
    import boto3

    uri = e2e["stdout"].strip().splitlines()[-1][len("summary=") :]
    bucket, key = uri[len("s3://") :].split("/", 1)
    config = yaml.safe_load(e2e["config"].read_text())
    body = boto3.client("s3", endpoint_url=config["storage"]["endpoint_url"]).get_object(
        Bucket=bucket, Key=key
    )
    summary = json.loads(body["Body"].read())
    for key in (
        "samples",
        "tokens",
        "cond_acc",
        "tau_simulated",
        "tau_measured",
        "baseline_tok_s",
        "drafter_tok_s",
        "promoted_version",
        "registry_uri",
    ):
        assert key in summary
    assert summary["samples"] > 50 and summary["tokens"] > summary["samples"]
    assert len(summary["cond_acc"]) == 3 and 0 < summary["cond_acc"][0] <= 1
    assert summary["tau_simulated"] >= 1 and summary["tau_measured"] >= 1
    assert summary["baseline_tok_s"] > 0 and summary["drafter_tok_s"] > 0
    assert summary["promoted_version"] and summary["registry_uri"].endswith(summary["promoted_version"])


def test_promoted_drafter_can_be_pulled_and_verified(e2e):
    dest = e2e["tmp"] / "pulled"
    result = drafter(
        "pull", "--config", str(e2e["config"]), "--alias", "production", "--dest", str(dest), env=e2e["env"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--speculative-algorithm EAGLE3" in result.stdout and str(dest) in result.stdout
    verified = drafter("verify", str(dest), env=e2e["env"])
    assert verified.returncode == 0 and verified.stdout.startswith("ok:")


def test_a_failing_gate_stops_visibly_with_its_reasons(e2e):
    result = drafter(
        "gate",
        "--config",
        str(e2e["config"]),
        "--run-id",
        "e2e-run",
        "gate.min_cond_acc=[0.999]",
        "gate.min_tau_simulated=9",
        env=e2e["env"],
    )
    assert result.returncode == 3
    assert "gate failed" in result.stderr
    assert "cond_acc_0 =" in result.stderr and "< 0.9990" in result.stderr
    assert "tau_simulated =" in result.stderr and "< 9.0000" in result.stderr


def test_a_deliberately_weak_drafter_fails_the_gate_that_the_trained_one_passes(e2e):
    import boto3

    config = yaml.safe_load(e2e["config"].read_text())
    bucket, prefix = config["storage"]["root"][len("s3://") :].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=config["storage"]["endpoint_url"])
    trained = json.loads(
        s3.get_object(Bucket=bucket, Key=f"{prefix}/runs/e2e-run/eval/eval.json")["Body"].read()
    )
    floor = round(trained["cond_acc"][0] * 0.8, 4)
    dataset = f"s3://{bucket}/{prefix}/datasets/tiny-test/e2e-run"
    weak = ["--run-id", "weak", "train.learning_rate=1e-9", "train.epochs=1"]
    for stage in ("train", "evaluate"):
        result = drafter(stage, "--config", str(e2e["config"]), "--dataset", dataset, *weak, env=e2e["env"])
        assert result.returncode == 0, result.stderr[-3000:]
    gate = [f"gate.min_cond_acc=[{floor}]", "gate.min_tau_simulated=1.0"]
    assert (
        drafter(
            "gate", "--config", str(e2e["config"]), "--run-id", "e2e-run", *gate, env=e2e["env"]
        ).returncode
        == 0
    )
    failed = drafter("gate", "--config", str(e2e["config"]), *weak, *gate, env=e2e["env"])
    assert failed.returncode == 3
    assert "cond_acc_0 =" in failed.stderr and f"< {floor:.4f}" in failed.stderr
    decision = json.loads(
        s3.get_object(Bucket=bucket, Key=f"{prefix}/runs/weak/gate/gate.json")["Body"].read()
    )
    assert decision["passed"] is False and decision["reasons"]
    refused = drafter("promote", "--config", str(e2e["config"]), *weak, env=e2e["env"])
    assert refused.returncode == 3 and "the gate did not pass" in refused.stderr  # a rejected candidate


def test_plan_takes_rates_measured_by_the_finished_run_and_the_transport_benchmark(e2e, tmp_path):
    width = 3 * yaml.safe_load(e2e["config"].read_text())["target"]["tiny"]["hidden_size"]
    bench = subprocess.run(
        [sys.executable, "benchmarks/bench_capture_transport.py", "--width", str(width), "--tokens", "64"]
        + ["--repeats", "1", "--json", str(tmp_path / "transport.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = drafter(
        "plan",
        "--config",
        str(e2e["config"]),
        "--samples",
        "200000",
        "--measured-from",
        "e2e-run",
        "--transport",
        str(tmp_path / "transport.json"),
        "--json",
        env=e2e["env"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    sources = report["rates_source"]
    pilot = ["prompt_tokens_mean", "response_tokens_mean", "generate_tok_s_per_server"]
    pilot += ["capture_tok_s_per_server", "train_tok_s_per_gpu"]
    assert {sources.pop(key) for key in pilot} == {"measured"}, report["rates_source"]
    assert set(sources.values()) == {"benchmarked"}, sources  # transport, client parse, shard encoding
    transport = json.loads((tmp_path / "transport.json").read_text())
    assert report["capture_paths"]["http"]["limits_tok_s_per_server"]["transport"] == pytest.approx(
        transport["capture_tok_s_ceiling_per_server"], rel=1e-3
    )
    assert (
        report["measured_from"]["run_id"] == "e2e-run"
        and report["measured_from"]["capture_shards_timed"] >= 2
    )
    assert all(rate > 0 for rate in report["rates"].values())
    # the measured tokens per conversation are the dataset's own
    summary = json.loads(
        drafter(
            "plan",
            "--config",
            str(e2e["config"]),
            "--samples",
            "1000",
            "--measured-from",
            "e2e-run",
            "--json",
            env=e2e["env"],
        ).stdout
    )
    assert summary["tokens"]["per_sample"] == report["tokens"]["per_sample"] > 0
    assert report["tokens"]["captured"] == pytest.approx(200 * summary["tokens"]["captured"], rel=1e-3)
    assert report["stages"]["capture"]["gpu_hours"] > 0 and report["stages"]["train"]["wall_hours"] > 0


def _run_object(e2e, key: str) -> bytes:
    """An object of the e2e run's S3 store, by its key under the store's prefix."""
    import boto3

    config = yaml.safe_load(e2e["config"].read_text())
    bucket, prefix = config["storage"]["root"][len("s3://") :].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=config["storage"]["endpoint_url"])
    return s3.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()


def _report_html(e2e) -> str:
    return _run_object(e2e, "runs/e2e-run/report/report.html").decode()


def test_run_renders_a_self_contained_report(e2e):
    lines = e2e["stdout"].strip().splitlines()
    assert lines[-2].startswith("report=http://127.0.0.1:") and lines[-2].endswith(
        "/runs/e2e-run/report/report.html"
    )
    page = _report_html(e2e)
    assert (
        page.count("src='data:image/png;base64,") == 4
    )  # training, acceptance, throughput, predicted vs measured
    assert "src='http" not in page and "<script" not in page  # nothing fetched from elsewhere
    for text in (
        "Run e2e-run",
        "promoted ",
        "cond_acc_0",
        "tau_simulated",
        "--speculative-algorithm EAGLE3",
        "--speculative-draft-model-path",
        "aux_layer_ids",
        "Capture contract",
        "learning_rate",
        "domain data-formats (bench)",  # measured per domain beside the pooled figures
        "domain runtime (eval, ",
        "tau measured (temperature 1, top_p 0.95)",  # and at the serving temperature
        "speedup vs baseline (temperature 1, top_p 0.95)",
        "batch sizes (bench)",  # and at batch 2 beside batch 1
        "batch 2 (bench)",
    ):
        assert text in page, text
    # the gate table shows each check with its threshold
    assert "<td>cond_acc_0</td>" in page and "<td>tau_simulated</td>" in page and "FAIL" not in page


def test_the_run_leaves_tensorboard_curves_that_tensorboards_reader_parses(e2e, tmp_path):
    """A point per logging interval in the event files under the run's prefix, as metrics.jsonl has them;
    the report says where they are and how to open them."""
    import boto3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = yaml.safe_load(e2e["config"].read_text())
    bucket, root = config["storage"]["root"][len("s3://") :].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=config["storage"]["endpoint_url"])
    prefix = f"{root}/runs/e2e-run/train"
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/tensorboard/")["Contents"]
    for item in listed:
        s3.download_file(bucket, item["Key"], str(tmp_path / item["Key"].rsplit("/", 1)[1]))
    metrics = s3.get_object(Bucket=bucket, Key=f"{prefix}/metrics.jsonl")["Body"].read().decode()
    intervals = [r for r in map(json.loads, metrics.splitlines()) if r["kind"] == "interval"]
    accumulator = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert len(intervals) > 3
    for tag in ("train/loss_0", "train/cond_acc_0", "train/tau_simulated", "train/lr", "train/tokens_per_s"):
        assert [e.step for e in accumulator.Scalars(tag)] == [line["global_step"] for line in intervals], tag
    page = _report_html(e2e)
    assert f"<code id=tensorboard>s3://{bucket}/{prefix}/tensorboard</code>" in page


def test_the_summary_and_report_show_what_each_stage_held_and_cost(e2e):
    from pipeline.ops.usage import saved_per_1k_tokens

    summary = json.loads(_run_object(e2e, "runs/e2e-run/summary.json"))
    cost = summary["cost"]
    rows = {row["stage"]: row for row in cost["stages"]}
    ran = ["prompts", "generate", "capture", "dataset", "train", "evaluate", "gate", "benchmark", "promote"]
    assert list(rows) == ran  # parity runs inside capture here; the report renders after the summary
    assert all(row["seconds"] > 0 and row["attempts"] == 1 for row in rows.values())
    train, prompts = rows["train"], rows["prompts"]
    assert train["gpu_hours"] == pytest.approx(train["seconds"] / 3600 * 2)
    assert train["cost_usd"] == pytest.approx(train["gpu_hours"] * 4.0)
    assert prompts["gpu_hours"] == 0 and prompts["cost_usd"] == 0
    assert cost["cost_usd"] == pytest.approx(sum(row["cost_usd"] for row in rows.values()))
    saved = saved_per_1k_tokens(summary["baseline_tok_s"], summary["drafter_tok_s"], 1, 4.0)
    assert cost["saved_usd_per_1k_tokens"] == pytest.approx(saved)
    assert "cost: train" in e2e["stdout"] and "cost: total" in e2e["stdout"]
    page = _report_html(e2e)
    assert "<table id=cost>" in page and "<th>cost: benchmark</th>" in page
    assert "serving cost saved per 1K generated tokens" in page


def test_report_pngs_are_published_with_the_manifest(e2e):
    import boto3

    config = yaml.safe_load(e2e["config"].read_text())
    bucket, prefix = config["storage"]["root"][len("s3://") :].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=config["storage"]["endpoint_url"])
    manifest = json.loads(
        s3.get_object(Bucket=bucket, Key=f"{prefix}/runs/e2e-run/report/manifest.json")["Body"].read()
    )
    names = {o["name"] for o in manifest["objects"]}
    assert names == {
        "training.png",
        "acceptance.png",
        "throughput.png",
        "predicted_vs_measured.png",
        "report.html",
    }
    png = s3.get_object(Bucket=bucket, Key=f"{prefix}/runs/e2e-run/report/training.png")["Body"].read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_status_lists_aliases_and_recent_runs(e2e):
    result = drafter("status", "--config", str(e2e["config"]), env=e2e["env"])
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "registry: tiny-test" in out
    production = next(line for line in out.splitlines() if line.strip().startswith("production"))
    run_row = next(line for line in out.splitlines() if line.strip().startswith("e2e-run"))
    version = production.split()[1]
    assert "passed" in run_row and f"promoted {version}" in run_row and "x" in run_row
    # the newest evaluated run in detail: its acceptance on each held-out domain
    detail = out[out.index("latest evaluated run") :]
    assert "domain data-formats (eval" in detail and "domain runtime (eval" in detail
    # the newest benchmarked run (the other runs here stop at the gate): each batch size, beside n-gram
    benchmarked = out[out.index("latest benchmarked run e2e-run, per domain, batch size and sampled:") :]
    batch_line = next(line for line in benchmarked.splitlines() if line.strip().startswith("batch 2 (bench)"))
    assert "chain of " in batch_line and "vs baseline " in batch_line and "vs ngram " in batch_line
    assert "GPU-h" in out and "$" in run_row  # what the run cost
    missing = drafter("report", "--config", str(e2e["config"]), "--run-id", "no-such-run", env=e2e["env"])
    assert missing.returncode == 2 and "has published nothing" in missing.stderr


def test_the_benchmark_reports_every_method_per_domain_beside_the_pooled_figures(e2e):
    record = json.loads(_run_object(e2e, "runs/e2e-run/bench/bench.json"))
    domains = record["domains"]
    assert set(domains) == {
        "data-formats",
        "runtime",
    }  # the demo corpus's, its held-out prompts taken in turn
    for name, pooled in record["methods"].items():
        if pooled is None:
            continue
        assert sum(domains[d][name]["tokens"] for d in domains) == pooled["tokens"], name
    for figures in domains.values():
        candidate = figures["candidate"]
        assert candidate["tau_measured"] >= 1 and len(candidate["acceptance_per_position"]) >= 1
        assert figures["baseline"]["tau_measured"] is None


def test_the_benchmark_also_measures_at_the_serving_temperature(e2e):
    record = json.loads(_run_object(e2e, "runs/e2e-run/bench/bench.json"))
    sampled = record["sampled"]
    assert (sampled["temperature"], sampled["top_p"]) == (1.0, 0.95)
    assert set(sampled["methods"]) == {"baseline", "candidate"} and set(sampled["speedups"]) == {"baseline"}
    candidate = sampled["methods"]["candidate"]
    assert candidate["tau_measured"] >= 1 and candidate["tokens"] > 0
    assert sampled["speedups"]["baseline"]["rounds"] >= 3


def test_the_benchmark_measures_every_batch_size_and_gates_at_those_named(e2e):
    record = json.loads(_run_object(e2e, "runs/e2e-run/bench/bench.json"))
    assert record["batch_size"] == 1
    [batch] = record["batches"]
    assert batch["batch_size"] == 2 and batch["topk"] == 1
    assert batch["draft_tokens"] == batch["draft_steps"] + 1  # the speed model's chain at batch 2
    assert set(batch["speedups"]) == {"baseline", "ngram"} and batch["speedups"]["baseline"]["rounds"] >= 3
    assert batch["predicted_speedup"] > 0 and batch["ranked"][0]["steps"] == batch["draft_steps"]
    assert set(batch["costs"]["verify_chain"]) == {str(s["draft_tokens"]) for s in batch["ranked"]}
    # two batches of 2 prompts decode to what each prompt decodes alone, for every method
    assert batch["methods"]["baseline"]["outputs_sha256"] == record["methods"]["baseline"]["outputs_sha256"]
    assert batch["methods"]["candidate"]["outputs_sha256"] == record["methods"]["baseline"]["outputs_sha256"]
    assert batch["tau_measured"] >= 1
    assert any(
        reason.startswith("candidate/baseline speed at batch 2 ") for reason in record["decision"]["reasons"]
    )
    summary = json.loads(_run_object(e2e, "runs/e2e-run/bench/manifest.json"))["summary"]
    assert [figures["batch_size"] for figures in summary["batch_figures"]] == [2]


def test_the_benchmark_serves_the_fastest_setting_it_timed_within_its_noise(e2e):
    evaluation = json.loads(_run_object(e2e, "runs/e2e-run/eval/eval.json"))
    simulated = {(s["steps"], s["topk"], s["draft_tokens"]): s for s in evaluation["shapes"]}
    # every shape the speed model ranks was simulated on held-out anchors: chains and trees of width 2, 4
    assert {topk for _, topk, _ in simulated} == {1, 2, 4}
    assert all(
        s["anchors"] > 0 and s["tau"] == pytest.approx(1 + sum(s["full_acc"])) for s in simulated.values()
    )
    record = json.loads(_run_object(e2e, "runs/e2e-run/bench/bench.json"))
    model = record["speed_model"]
    choice, calibration = model["choice"], model["calibration"]
    timed = {
        (c["setting"]["steps"], c["setting"]["topk"], c["setting"]["draft_tokens"]): c for c in calibration
    }
    assert len(timed) >= 3 and {topk for _, topk, _ in timed} == {1, 2, 4}  # the best of each width too
    chosen = (record["draft_steps"], record["topk"], record["draft_tokens"])
    assert chosen in timed and choice["chosen"] in choice["tied"] and choice["fastest"] in choice["tied"]
    assert timed[chosen]["phase"] == choice["phases"] >= 1  # chosen among the last phase's settings
    for setting, figures in timed.items():
        assert 1 <= figures["phase"] <= choice["phases"]
        assert figures["speedup"]["rounds"] >= 4  # every calibration prompt, paired
        if figures["phase"] == choice["phases"]:  # timed in the phase the choice was made on
            assert figures["speedup"]["rounds"] == choice["rounds"]
        assert figures["predicted_speedup"] > 0 and figures["seconds_per_cycle"] > 0
        steps, topk, _ = setting
        predicted = simulated[setting]["tau"] if topk > 1 else 1 + sum(evaluation["full_acc"][:steps])
        assert figures["setting"]["tau"] == pytest.approx(predicted, abs=1e-4)
    # the chosen setting is the fastest measured, or within the noise of the fastest
    if figures_of_chosen := timed[chosen]["vs_fastest"]:
        assert figures_of_chosen["ci_high"] >= 1.0
    assert set(model["overhead"]) == {"per_cycle", "per_tree_cycle", "per_draft_token", "per_plain_step"}
