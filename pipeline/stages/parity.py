"""parity: the capture engine against an independent reference forward on a few samples, on its own.

Capture runs the same check before it captures anything; as a stage of its own a scheduler can run it
before a long capture and stop early. SGLang servers' settings are checked against the capture contract
too (pipeline.stages.capture.verify_engine). Raises ParityFailed or ContractMismatch on a disagreement.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import ConfigError, RunConfig
from pipeline.engines.inprocess import needs_rank_job
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
    in_prefix = store.key_for(inputs.responses_uri)
    responses = read_manifest(store, in_prefix, kind="responses")
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir, config.target.trust_remote_code)
    if needs_rank_job(config.capture):
        raise ConfigError(
            f"the parity stage runs in one process, and capture.inprocess.tp_size is "
            f"{config.capture.inprocess.tp_size}: the capture stage checks parity itself in its job of ranks "
            "(capture.parity.samples)"
        )
    with workspace(config, target) as (engine, _):
        contract = contract_for(config, target, engine).model_dump(mode="json")
        report = verify_engine(config, engine, target, contract, tokenizer, store, in_prefix, responses)
    return Output(uri=inputs.responses_uri, kind="parity", parity=report)
