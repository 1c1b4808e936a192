"""promote: a gated, benchmarked candidate -> an immutable registry version and a moved alias. Whether it is
promotable is the stored gate and benchmark decisions' (pipeline.promotion.require_promotable)."""

from __future__ import annotations

import logging

from pydantic import Field

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.data.capture_contract import CaptureContract
from pipeline.manifest import code_version, read_manifest
from pipeline.ops import registry
from pipeline.promotion import require_passed, require_promotable
from pipeline.records import (
    AliasRecord,
    BenchRecord,
    BenchSummary,
    EvalRecord,
    GateRecord,
    GateSummary,
    Lineage,
    PromoteRecord,
    publish_record,
    read_record,
)
from pipeline.stages import StageInputs, StageOutput
from pipeline.stages.evaluate import local_drafter_dir
from pipeline.storage import ObjectStore

log = logging.getLogger(__name__)


class Inputs(StageInputs):
    train_uri: str
    eval_uri: str
    gate_uri: str
    bench_uri: str


class Output(StageOutput):
    promoted: bool
    version: str | None = None
    registry_uri: str | None = None
    alias: str | None = None
    # what a promotion alert states: the candidate's speedup over each method it was measured against,
    # on the benchmark's engine
    speedups: dict[str, float] = Field(default_factory=dict)
    bench_engine: str | None = None


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    """A gated, benchmarked candidate -> an immutable registry version, and the alias moved to it."""
    gate = read_record(store, inputs.gate_uri, GateRecord)
    require_passed(gate)
    bench = read_record(store, inputs.bench_uri, BenchRecord)
    require_promotable(gate, bench)
    train = read_manifest(store, store.key_for(inputs.train_uri), kind="train")
    evaluation = read_record(store, inputs.eval_uri, EvalRecord)
    prefix = layout.run_stage_prefix(run_id, "promote")
    lineage = Lineage(
        run_id=run_id,
        dataset=train["dataset"],
        contract=CaptureContract.model_validate(train["contract"]),
        train=inputs.train_uri,
        training_config=train["config"],
        drafter_config=train["drafter_config"],
        code_version=code_version(),
        eval=evaluation.summary(),
        gate=GateSummary(passed=gate.passed, reasons=gate.reasons),
        bench=bench.summary(),
    )
    if not config.registry.promote:
        outcome = PromoteRecord(promoted=False, reason="registry.promote is false")
    else:
        drafter_dir = local_drafter_dir(
            store, store.key_for(inputs.train_uri), config.storage.run_workdir(run_id)
        )
        promoted = registry.promote(
            store,
            config.target.name,
            drafter_dir,
            lineage.model_dump(mode="json"),
            config.registry.alias,
            serving=serving_setting(bench),
        )
        outcome = PromoteRecord(
            promoted=True,
            version=promoted["version"],
            alias=config.registry.alias,
            registry_uri=promoted["uri"],
            alias_record=AliasRecord.model_validate(promoted["alias"]),
        )
        log.info(
            "promoted %s version %s as %s (%s)",
            config.target.name,
            promoted["version"],
            config.registry.alias,
            promoted["uri"],
        )
    manifest = publish_record(store, prefix, outcome, {"run_id": run_id, **outcome.model_dump(mode="json")})
    return Output(
        uri=store.uri(prefix),
        kind=manifest["kind"],
        promoted=outcome.promoted,
        version=outcome.version,
        registry_uri=outcome.registry_uri,
        alias=outcome.alias,
        speedups={method: interval.ratio for method, interval in bench.speedups.items()},
        bench_engine=bench.engine,
    )


def serving_setting(bench: BenchSummary) -> dict[str, int]:
    """What the serving pods run the version at: the benchmarked setting, and (SGLang) the
    --max-running-requests every benchmark server ran with."""
    serving = {"steps": bench.draft_steps, "topk": bench.topk, "draft_tokens": bench.draft_tokens}
    if bench.max_running_requests is not None:
        serving["max_running_requests"] = bench.max_running_requests
    return serving
