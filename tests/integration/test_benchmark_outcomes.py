"""The benchmark stage on the tiny target, then promotion, when the benchmark's budget is too small to
decide: the record says `inconclusive` with the widths reached and needed, `drafter promote` ends with its
own exit code and one line saying what to do, nothing is promoted, the DAG's promote task returns that
outcome and its own alert, and the report and the run summary say so. A candidate measured slower is
refused as slower, with the exit code of a rejected candidate (pipeline.failures)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import yaml

from pipeline import layout
from pipeline.config import load_config
from pipeline.drafter.export import export_drafter
from pipeline.failures import EXIT_GATE, EXIT_INCONCLUSIVE
from pipeline.manifest import manifest_exists, publish, read_manifest
from pipeline.ops import registry
from pipeline.promotion import BenchmarkInconclusive, PromotionRefused
from pipeline.records import (
    AcceptanceMetrics,
    BenchRecord,
    IncumbentEval,
    RunSummary,
    publish_record,
    read_record,
)
from pipeline.run import RunResult, format_table, stop_summary
from pipeline.stages import run_stage
from pipeline.storage import open_store
from pipeline.tasks import inconclusive_notice, promotion_notice, promotion_outcome
from tests.builders import AUX, eval_record, random_drafter
from tests.conftest import REPO, storage_config, tiny_config_dict

# the fields of a run summary that come before the benchmark (the data and training stages')
SUMMARY_OF_DATA = {
    "samples": 96,
    "tokens": 9000,
    "cond_acc": [0.8],
    "stop_reason": "epochs",
    "report": "file:///r.html",
}


def too_small_to_decide(data: dict) -> dict:
    """Benchmark settings that cannot decide whether the candidate beats an incumbent that is the same
    drafter, on any machine: the budget stops the measurement at its minimum of 3 rounds, and at a
    confidence of 1 - 1e-5 the interval of 3 rounds reaches about 180 times their spread either side of
    the ratio, so it holds the ratio of two equal drafters, 1, the incumbent threshold. Baseline and
    n-gram need nothing."""
    data["benchmark"].update(
        num_prompts=2,
        max_new_tokens=8,
        auto_select=False,
        draft_steps=2,
        ngram_settings=[{"min_match": 1, "max_match": 3, "steps": 3}],
        budget_s=0.01,
        confidence=1 - 1e-5,
        min_speedup_vs_baseline=0.0,
        min_speedup_vs_ngram=0.0,
        min_speedup_vs_incumbent=1.0,
    )
    return data


def publish_inputs(config, store, run_id: str, target_dir) -> str:
    """What the benchmark reads of run `run_id`: its held-out prompts (the prompts stage), an untrained
    drafter where the train stage publishes one, the same drafter promoted before as the incumbent, and an
    evaluation scoring both alike; then the real gate on that. Returns the incumbent's version."""
    run_stage("prompts", config, run_id, store)
    work = config.storage.run_workdir(run_id)
    drafter = export_drafter(
        random_drafter(target_dir), {"aux_layer_ids": AUX}, work / "exported", "float32", target_dir
    )
    serving = {"steps": 2, "topk": 1, "draft_tokens": 3}
    incumbent = registry.promote(
        store, config.target.name, drafter, {"run_id": "earlier"}, config.registry.alias, serving
    )["version"]
    prefix = layout.run_stage_prefix(run_id, "train")
    objects = [store.put_file(f"{prefix}/drafter/{path.name}", path) for path in sorted(drafter.iterdir())]
    publish(store, prefix, "train", objects, {"run_id": run_id})
    scored = eval_record()
    same = IncumbentEval(version=incumbent, **scored.model_dump(include=set(AcceptanceMetrics.model_fields)))
    evaluation = scored.model_copy(update={"incumbent": same})
    publish_record(store, layout.run_stage_prefix(run_id, "eval"), evaluation, {"run_id": run_id})
    assert run_stage("gate", config, run_id, store).passed
    return incumbent


def drafter_cli(stage: str, config_path, run_id: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", stage, "--config", str(config_path), "--run-id", run_id],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )


def benchmarked(tmp_path, target_dir, **settings):
    """A run benchmarked by `drafter benchmark` with too_small_to_decide's settings and `settings` over
    them: (config path, config, store, run id, the incumbent's version, the bench record)."""
    data = too_small_to_decide(tiny_config_dict(storage_config("file", tmp_path, None)))
    data["benchmark"].update(settings)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    config = load_config(config_path)
    store = open_store(config.storage)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    incumbent = publish_inputs(config, store, run_id, target_dir)
    bench = drafter_cli("benchmark", config_path, run_id)
    assert bench.returncode == 0, bench.stderr[-3000:]  # the measurement itself succeeded
    record = read_record(store, layout.run_stage_prefix(run_id, "bench"), BenchRecord)
    return config_path, config, store, run_id, incumbent, record


def test_a_benchmark_too_short_to_decide_is_inconclusive_and_promotes_nothing(tmp_path, tiny_target_dir):
    config_path, config, store, run_id, incumbent, record = benchmarked(tmp_path, tiny_target_dir)
    decision, interval = record.decision, record.speedups["incumbent"]
    assert interval.rounds == 3  # stopped by its budget at the minimum
    assert not decision.promotable and decision.verdict == "inconclusive"
    [undecided] = decision.undecided
    assert (undecided.comparison, undecided.required) == ("candidate/incumbent", 1.0)
    assert undecided.width_reached == pytest.approx((interval.ci_high - interval.ci_low) / interval.ratio)
    assert undecided.width_reached > max(config.benchmark.ci_rel_width, undecided.width_needed)
    assert "rerun on a quiet machine, or raise benchmark.budget_s (now 0.01 s)" in decision.next_step
    manifest = read_manifest(store, layout.run_stage_prefix(run_id, "bench"), kind="bench")
    assert manifest["summary"]["decision"]["verdict"] == "inconclusive"

    promote = drafter_cli("promote", config_path, run_id)
    assert promote.returncode == EXIT_INCONCLUSIVE == 4, promote.stderr[-3000:]
    said = [line for line in promote.stderr.splitlines() if " ERROR " in line or " WARNING " in line]
    assert len(said) == 1 and "Traceback" not in promote.stderr
    assert "inconclusive, not promoted" in said[0] and decision.next_step in said[0]
    # nothing promoted: no new version, the alias where it was, no promote record
    assert [entry["version"] for entry in registry.list_versions(store, config.target.name)] == [incumbent]
    assert registry.read_alias(store, config.target.name, config.registry.alias)["version"] == incumbent
    assert not manifest_exists(store, layout.run_stage_prefix(run_id, "promote"))

    # the DAG's promote task: an outcome, not a failure, alerted as its own event with what to do
    unsure = promotion_outcome(config, run_id)
    assert unsure["promoted"] is False and unsure["outcome"] == "inconclusive, not promoted"
    assert unsure["next_step"] == decision.next_step and "uri" not in unsure
    run = {"run_id": run_id, "config": config.dump(), "source": {"config": str(config_path), "overrides": []}}
    alert = inconclusive_notice(run, unsure)
    assert alert is not None and promotion_notice(run, unsure) is None
    assert alert["event"] == "inconclusive" and f"what to do: {decision.next_step}" in alert["lines"]
    assert registry.read_alias(store, config.target.name, config.registry.alias)["version"] == incumbent

    # what `drafter run` makes of this stop: its summary's outcome and what to do, and its exit code
    with pytest.raises(BenchmarkInconclusive) as stopped:
        run_stage("promote", config, run_id, store)
    fields = stop_summary(stopped.value)
    assert fields["outcome"] == "inconclusive, not promoted" and fields["next_step"] == decision.next_step
    summary = RunSummary.model_validate(
        {**SUMMARY_OF_DATA, "run_id": run_id, "target": "tiny-test", **fields}
    )
    assert RunResult(summary, "file:///s.json", stopped.value).exit_code() == EXIT_INCONCLUSIVE
    table = format_table(summary).splitlines()
    assert any(line.split() == ["outcome", "inconclusive,", "not", "promoted"] for line in table)
    assert [line.split(None, 3)[-1] for line in table if line.startswith("what to do")] == [
        decision.next_step
    ]

    # the report names the outcome and what to do
    report = run_stage("report", config, run_id, store)
    assert report.outcome == "inconclusive, not promoted"
    page = store.get_bytes(f"{layout.run_stage_prefix(run_id, 'report')}/report.html").decode()
    assert (
        "inconclusive, not promoted" in page and "What to do: the speedup intervals stayed too wide" in page
    )
    assert "rerun on a quiet machine, or raise benchmark.budget_s (now 0.01 s)" in page


def test_a_candidate_measured_slower_is_refused_as_slower_with_the_rejections_exit_code(
    tmp_path, tiny_target_dir
):
    # no candidate of the tiny target decodes 100 times as fast as plain decoding: its interval, at a
    # confidence of 0.5, lies wholly under that threshold
    config_path, config, store, run_id, incumbent, record = benchmarked(
        tmp_path, tiny_target_dir, confidence=0.5, min_speedup_vs_baseline=100.0
    )
    decision = record.decision
    assert decision.verdict == "slower" and not decision.promotable
    assert decision.undecided == [] and decision.next_step is None
    promote = drafter_cli("promote", config_path, run_id)
    assert promote.returncode == EXIT_GATE == 3, promote.stderr[-3000:]
    assert "refused: slower: the benchmark does not show the candidate faster" in promote.stderr
    assert "inconclusive" not in promote.stderr
    assert registry.read_alias(store, config.target.name, config.registry.alias)["version"] == incumbent
    with pytest.raises(PromotionRefused) as stopped:
        run_stage("promote", config, run_id, store)
    fields = stop_summary(stopped.value)
    assert fields["outcome"] == "refused: slower" and "next_step" not in fields
    summary = RunSummary.model_validate(
        {**SUMMARY_OF_DATA, "run_id": run_id, "target": "tiny-test", **fields}
    )
    assert RunResult(summary, "file:///s.json", stopped.value).exit_code() == EXIT_GATE
    assert run_stage("report", config, run_id, store).outcome == "refused: slower"
