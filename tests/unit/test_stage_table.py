"""The stage table: every stage has the same shape, and the CLI, `drafter run` and the tasks use it."""

from __future__ import annotations

import sys
import types

import pytest
from pydantic import ValidationError

from pipeline import stages
from pipeline.cli import build_parser
from pipeline.config import load_config
from pipeline.stages import TABLE, Stage, StageInputs, StageOutput, resolve_inputs
from pipeline.storage import open_store
from tests.conftest import storage_config, tiny_config_dict


@pytest.fixture
def config_and_store(tmp_path):
    config = load_config(data=tiny_config_dict(storage_config("file", tmp_path, None)))
    return config, open_store(config.storage)


@pytest.mark.parametrize("entry", TABLE, ids=lambda entry: entry.name)
def test_every_stage_has_inputs_an_output_and_one_run_signature(entry):
    import inspect

    module = entry._load()
    assert issubclass(entry.inputs, StageInputs) and issubclass(entry.output, StageOutput)
    assert list(inspect.signature(module.run).parameters) == ["config", "inputs", "run_id", "store"]
    assert set(entry.inputs.model_fields) <= {"snapshot", *entry.reads}
    assert set(entry.reads) <= set(entry.inputs.model_fields)


def test_every_stage_is_a_cli_command_with_its_inputs_as_options():
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for entry in TABLE:
        options = {o for action in commands[entry.name]._actions for o in action.option_strings}
        assert "--config" in options and "--run-id" in options
        for name in entry.reads:
            stem = name.rsplit("_", 1)[0]
            assert f"--{stem}" in options or f"--{stem}s" in options, (entry.name, name)


def test_inputs_default_to_the_run_and_its_snapshot(config_and_store):
    config, store = config_and_store
    promote = resolve_inputs(stages.stage("promote"), config, store, "r1", "r1", {})
    assert promote.model_dump() == {
        "train_uri": store.uri("runs/r1/train"),
        "eval_uri": store.uri("runs/r1/eval"),
        "gate_uri": store.uri("runs/r1/gate"),
        "bench_uri": store.uri("runs/r1/bench"),
    }
    dataset = resolve_inputs(
        stages.stage("dataset"), config, store, "r2", "snap", {"capture_uris": ["s3://b/captures/x"]}
    )
    assert dataset.model_dump() == {"capture_uris": ["s3://b/captures/x"], "snapshot": "snap"}


def test_unknown_stage_and_unknown_input_are_refused(config_and_store):
    config, store = config_and_store
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        stages.run_stage("nope", config, "r1", store)
    with pytest.raises(ValueError, match="stage gate takes no input dataset_uri"):
        stages.run_stage("gate", config, "r1", store, dataset_uri="file:///x")
    with pytest.raises(ValidationError):
        stages.stage("gate").inputs.model_validate({"eval_uri": "u", "extra": 1})


def test_a_new_stage_is_one_module_and_one_entry(config_and_store, monkeypatch):
    """What the table promises someone adding a stage: a module with Inputs, Output and run."""
    config, store = config_and_store
    module = types.ModuleType("fake_stage")

    class Inputs(StageInputs):
        eval_uri: str

    class Output(StageOutput):
        seen: str

    def run(config, inputs, run_id, store):
        return Output(uri=inputs.eval_uri, kind="fake", seen=run_id)

    module.Inputs, module.Output, module.run = Inputs, Output, run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_stage", module)
    entry = Stage("fake", "fake_stage", "a stage for this test", ("eval_uri",))
    monkeypatch.setattr(stages, "TABLE", (*TABLE, entry))
    output = stages.run_stage("fake", config, "r9", store)
    # what it read (its entry's reads) is on its output: its task reports it as lineage
    evaluation = store.uri("runs/r9/eval")
    assert output.model_dump() == {"uri": evaluation, "kind": "fake", "seen": "r9", "read": [evaluation]}

    def wrong(config, inputs, run_id, store):
        return StageOutput(uri="u", kind="fake")

    module.run = wrong  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="stage fake returned StageOutput, not Output"):
        stages.run_stage("fake", config, "r9", store)


def test_an_entry_must_declare_the_uris_its_stage_reads():
    entry = Stage("gate", "pipeline.stages.gate", "gate without its reads")
    with pytest.raises(TypeError, match="missing from its entry's reads"):
        _ = entry.inputs
