"""A run id continues only under the config it was made with (pipeline.config_records): what counts as a
change, how it is named, and what may change between attempts."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import BaseModel

from pipeline.config import CODE_SETTINGS, RunConfig, load_config, overridden_code_settings
from pipeline.config_records import (
    EXEMPT_SETTINGS,
    ConfigChanged,
    artifact_record,
    claim,
    differences,
    run_record,
)
from pipeline.storage import FileStore
from tests.conftest import REPO

LOCAL = REPO / "configs" / "local.yaml"


def names_a_setting(path: str) -> bool:
    """Whether the dotted path names a field of RunConfig (through its sections, optional ones included)."""
    model: type[BaseModel] | None = RunConfig
    for part in path.split("."):
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        sections = [
            kind
            for kind in (typing.get_args(annotation) or (annotation,))
            if isinstance(kind, type) and issubclass(kind, BaseModel)
        ]
        model = sections[0] if sections else None
    return True


@pytest.mark.parametrize("path", [*EXEMPT_SETTINGS, *CODE_SETTINGS])
def test_every_listed_setting_is_a_setting(path):
    assert names_a_setting(path), path


def test_differences_name_each_setting_by_its_dotted_path_with_both_values():
    recorded = load_config(LOCAL).dump()
    current = load_config(
        LOCAL, ["train.epochs=9", "prompts.sources=[{kind: demo, max_samples: 5}]", "gate.min_cond_acc=[0.5]"]
    ).dump()
    assert differences(recorded, current) == [
        "gate.min_cond_acc: [0.3] -> [0.5]",
        "prompts.sources.0.max_samples: null -> 5",
        f"train.epochs: {recorded['train']['epochs']} -> 9",
    ]
    assert differences(recorded, recorded) == []


def test_credentials_are_masked_and_settings_that_change_nothing_made_are_left_out():
    recorded = {"generate": {"sglang": None}, "storage": {"root": "s3://b/p", "endpoint_url": "http://a"}}
    current = {
        "generate": {"sglang": {"urls": ["http://user:secret@gpu-0:30000"]}},
        "storage": {"root": "s3://b/p", "endpoint_url": "http://user:secret@b"},
        "tracking": {"mlflow_uri": "http://mlflow:5000"},
    }
    changed = differences(recorded, current)
    assert changed == ['generate.sglang: null -> {"urls": ["http://***@gpu-0:30000"]}']
    assert "secret" not in "".join(changed)
    assert differences({"train": {"rendezvous_port": 1}}, {"train": {"rendezvous_port": 2}}) == []
    assert differences({"train": {"hostfile": "h"}}, {"train": {}}) == ['train.hostfile: "h" -> (not set)']


def test_a_run_record_is_written_once_and_another_config_is_refused(tmp_path):
    store = FileStore(tmp_path)
    config = load_config(LOCAL)
    record = artifact_record(store, "prompts/r1", "prompts snapshot")
    claim(store, record, config)
    written = store.get_bytes("prompts/r1/run_config.json")
    assert json.loads(written) == config.dump()
    claim(store, record, config)  # a retry
    samples = config.prompts.num_samples
    with pytest.raises(ConfigChanged, match=rf"prompts\.num_samples: {samples} -> 7") as refused:
        claim(store, record, load_config(LOCAL, ["prompts.num_samples=7"]))
    assert "prompts/r1" in str(refused.value) and "a new run id" in str(refused.value)
    assert store.get_bytes("prompts/r1/run_config.json") == written
    claim(store, record, load_config(LOCAL, ["tracking.tensorboard=false"]))  # exempt


def test_a_setting_added_since_the_record_was_written_is_no_change(tmp_path):
    store = FileStore(tmp_path)
    config = load_config(LOCAL)
    older = config.dump()
    del older["benchmark"]["acceptance_tolerance"]  # written before the setting existed (at its default)
    store.put_bytes("runs/r1/config.json", json.dumps(older).encode())
    claim(store, run_record("r1"), config)
    with pytest.raises(ConfigChanged, match="benchmark.acceptance_tolerance: 0.02 -> 0.05"):
        claim(store, run_record("r1"), load_config(LOCAL, ["benchmark.acceptance_tolerance=0.05"]))


def test_a_record_that_is_not_a_config_is_refused_by_name(tmp_path):
    store = FileStore(tmp_path)
    store.put_bytes("runs/r1/config.json", b"{not json")
    with pytest.raises(ConfigChanged, match="runs/r1/config.json is not JSON"):
        claim(store, run_record("r1"), load_config(LOCAL))


@pytest.mark.parametrize(
    "override, refused",
    [
        ("generate.vllm.python=/tmp/x", ["generate.vllm.python"]),
        ("generate.vllm={python: /tmp/x}", ["generate.vllm.extra_engine_args", "generate.vllm.python"]),
        ("benchmark.vllm.extra_engine_args.worker_cls=evil.Worker", ["benchmark.vllm.extra_engine_args"]),
        ("target={name: t}", ["target.model_path", "target.trust_remote_code"]),
        ("generate.vllm.dtype=float32", []),
        ("train.epochs=2", []),
        ("train.kubernetes_jobs=x", []),
    ],
)
def test_an_override_sets_a_code_setting_itself_inside_it_or_by_replacing_its_section(override, refused):
    assert sorted(overridden_code_settings(override)) == refused


def test_the_trigger_form_refuses_code_settings_that_the_operators_command_line_may_set():
    from pipeline.config import ConfigError
    from pipeline.tasks import param_overrides

    with pytest.raises(ConfigError, match=r"benchmark\.sglang\.launch, generate\.vllm\.python"):
        param_overrides(
            {"epochs": 2, "overrides": ["generate.vllm.python=/x", "benchmark.sglang.launch=[sh]"]}
        )
    assert param_overrides({"epochs": 2, "overrides": ["generate.max_new_tokens=64"]}) == [
        "train.epochs=2",
        "generate.max_new_tokens=64",
    ]
    assert load_config(LOCAL, ["generate.vllm.python=/opt/vllm/bin/python"]).generate.vllm is not None
