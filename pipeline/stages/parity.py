"""parity: the capture engine against an independent reference forward on a few samples, on its own.

Capture runs the same check before it captures anything; as a stage of its own a scheduler can run it
before a long capture and stop early. An in-process engine of several tensor-parallel ranks is checked
in a job of its ranks, as capture runs. SGLang servers' settings are checked against the capture contract
too (pipeline.stages.capture.verify_engine). Raises ParityFailed or ContractMismatch on a disagreement.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.engine_requests import EngineError
from pipeline.engines.inprocess import launch_rank_job, needs_rank_job
from pipeline.engines.target import describe_target, load_tokenizer
from pipeline.manifest import read_manifest
from pipeline.stages import StageInputs, StageOutput
from pipeline.stages.capture import contract_for, verify_engine, workspace
from pipeline.storage import ObjectStore


class Inputs(StageInputs):
    responses_uri: str


class Output(StageOutput):
    parity: dict[str, Any]  # the parity report, or why the comparison was skipped


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    settings = config.capture
    if settings.engine == "inprocess" and settings.parity.samples == 0:
        report: dict[str, Any] = {
            "skipped": "capture.parity.samples is 0, and an in-process engine has no servers whose settings "
            "to check"
        }
    elif needs_rank_job(settings):
        report = _checked_by_rank_job(config, inputs.responses_uri)
    else:
        report = check_engine(config, store, inputs.responses_uri)
    return Output(uri=inputs.responses_uri, kind="parity", parity=report)


def check_engine(config: RunConfig, store: ObjectStore, responses_uri: str) -> dict[str, Any]:
    """The capture engine opened and checked against the capture contract and a reference forward (every
    rank of an in-process job runs this in step); the parity report."""
    in_prefix = store.key_for(responses_uri)
    responses = read_manifest(store, in_prefix, kind="responses")
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir, config.target.trust_remote_code)
    with workspace(config, target) as (engine, _):
        contract = contract_for(config, target, engine).model_dump(mode="json")
        return verify_engine(config, engine, target, contract, tokenizer, store, in_prefix, responses)


def _checked_by_rank_job(config: RunConfig, responses_uri: str) -> dict[str, Any]:
    """`check_engine` in a job of capture.inprocess.tp_size ranks; rank 0 writes the report."""
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        report = Path(tmp) / "parity.json"
        args = ["--responses", responses_uri, "--parity-report", str(report)]
        launch_rank_job(config.capture.inprocess.tp_size, args, config.dump())
        if not report.exists():
            raise EngineError("the in-process parity job finished without writing its report")
        return json.loads(report.read_text())
