"""Bad input: every case ends in a clear error naming the problem, and nothing is written or replaced."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import layout
from pipeline.config import ConfigError, load_config
from pipeline.drafter.export import DrafterFormatError, read_drafter_dir
from pipeline.ids import InvalidIdError
from pipeline.ops.registry import RegistryError, promote, pull, verify_dir
from pipeline.stages import run_stage
from tests.builders import SERVING, drafter_dir
from tests.conftest import REPO, published, storage_config, tiny_config_dict

pytestmark = pytest.mark.fault

LOCAL = REPO / "configs" / "local.yaml"


@pytest.mark.parametrize(
    "overrides, message, what",
    [
        (["train.epochz=3"], "epochz", "an unknown key (train.epochz)"),
        (["train.epochs=many"], "epochs", "a wrong type (train.epochs=many)"),
        (["capture.encoding=fp4"], "encoding", "an unsupported capture encoding (fp4)"),
        (
            ["capture.aux_layer_ids=[1,2,99]", "target.num_layers=8"],
            "out of range",
            "a capture contract naming layers the target does not have",
        ),
        (
            ["target.vocab_size=1024", "drafter.draft_vocab_size=4096"],
            "draft_vocab_size exceeds",
            "a draft vocabulary larger than the target's",
        ),
        (["target.name=../../etc"], "target.name", "a target name that climbs out of the store"),
        (["storage.root=ftp://host/x"], "file:// or s3://", "a storage root with an unknown scheme"),
    ],
)
def test_malformed_configs_are_refused_by_name(overrides, message, what, record):
    with pytest.raises(ConfigError, match=message):
        load_config(LOCAL, overrides)
    record("bad input", f"config with {what}", f"ConfigError naming `{message}`")


def test_yaml_that_is_not_a_config_is_refused(tmp_path, record):
    bad = tmp_path / "bad.yaml"
    bad.write_text("storage: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)
    record("bad input", "a config file that is not valid YAML", "ConfigError naming the file")


@pytest.mark.parametrize("run_id", ["../escape", "a/b", "..", "x" * 300, "-rf"])
def test_run_ids_that_would_become_bad_paths_are_refused(run_id, record):
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "gate", "--config", str(LOCAL), "--run-id", run_id],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and (
        "run id" in result.stderr or "expected one argument" in result.stderr
    ), result.stderr
    record(
        "bad input",
        f"run id {run_id[:20]!r}{'...' if len(run_id) > 20 else ''} on the command line",
        "exit 2 with the reason; nothing written",
    )


@pytest.mark.parametrize("key", ["../x", "a/../../b", "/abs/path", "a//b"])
def test_object_keys_that_escape_the_root_are_refused(store, key, record):
    from pipeline.ids import validate_key

    with pytest.raises(InvalidIdError):
        validate_key(key)
    with pytest.raises(InvalidIdError):
        store.put_bytes(key, b"x")
    record("bad input", f"object key {key!r} (path traversal)", "InvalidIdError before any write")


def _prompts(tmp_path, lines, **settings):
    from pipeline.storage import open_store

    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(lines) + "\n")
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["prompts"] = {"sources": [{"kind": "jsonl", "path": str(source)}], "eval_fraction": 0.0, **settings}
    config = load_config(data=data)
    store = open_store(config.storage)
    return published(store, run_stage("prompts", config, "bad-input", store))


GOOD = [json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) for i in range(10)]


def test_malformed_prompt_records_are_counted_and_skipped(tmp_path, record):
    bad = [
        json.dumps({"messages": "not a list"}),
        json.dumps({"conversations": []}),
        json.dumps({"messages": [{"role": "wizard", "content": "?"}]}),
        json.dumps({"text": 5}),
    ]
    manifest = _prompts(tmp_path, GOOD[:5] + bad + GOOD[5:])
    assert sum(s["samples"] for s in manifest["shards"]) == 10
    rejected = {k: v for k, v in manifest["counts"].items() if k.startswith("rejected.")}
    assert sum(rejected.values()) == 4 and manifest["counts"]["kept"] == 10, manifest["counts"]
    record(
        "bad input",
        "a prompt file with 4 malformed records among 10 good ones",
        f"the 10 good ones kept; the 4 counted by reason in the manifest ({', '.join(sorted(rejected))})",
        tried=4,
    )


def test_an_unparseable_prompt_file_is_a_clear_error(tmp_path, record):
    from pipeline.stages.prompts import PromptSourceError

    bad_line = re.escape(f"{tmp_path / 'prompts.jsonl'}:6")
    with pytest.raises(PromptSourceError, match=rf"{bad_line}\b.*raise prompts\.max_bad_fraction"):
        _prompts(tmp_path, GOOD[:5] + ["{not json"] + GOOD[5:], max_bad_fraction=0.05)
    assert not (tmp_path / "store" / "prompts").exists()
    record(
        "bad input",
        "a prompt file with 1 line in 11 that is not JSON, more than prompts.max_bad_fraction (5%)",
        "PromptSourceError naming file:line of the bad line and the setting to raise; nothing published",
    )


def test_a_few_unparseable_prompt_lines_are_counted_and_skipped(tmp_path, record):
    cut_off = '{"messages": [{"role": "user", "content": "def cut(x'
    manifest = _prompts(
        tmp_path, GOOD[:3] + ["{not json"] + GOOD[3:7] + [cut_off] + GOOD[7:], max_bad_fraction=0.2
    )
    counts = manifest["counts"]
    assert counts["kept"] == 10 and counts["rejected.malformed_json"] == 2, counts
    assert sum(v for k, v in counts.items() if k != "read") == counts["read"]  # nothing vanishes
    source = tmp_path / "prompts.jsonl"
    assert manifest["rejected_examples"]["malformed_json"] == [f"{source}:4", f"{source}:9"]
    record(
        "bad input",
        "a prompt file with 2 lines in 12 that are not JSON, within prompts.max_bad_fraction (20%)",
        "the 10 good ones kept; the 2 counted as rejected.malformed_json, their file:line in the manifest",
        tried=2,
    )


@pytest.mark.parametrize(
    "damage, message, what",
    [
        (lambda t: t.pop("midlayer.mlp.up_proj.weight"), "missing tensor", "a missing tensor"),
        (
            lambda t: t.__setitem__("fc.weight", torch.zeros(16, 32)),
            "fc.weight has shape",
            "a mis-shaped tensor",
        ),
        (
            lambda t: t.__setitem__("norm.weight", torch.full((16,), float("nan"))),
            "non-finite",
            "NaN weights",
        ),
    ],
)
def test_broken_drafter_directories_are_refused(tmp_path, damage, message, what, store, record):
    directory = drafter_dir(tmp_path, 1)
    tensors = load_file(str(directory / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(DrafterFormatError, match=message):
        read_drafter_dir(directory)
    with pytest.raises((DrafterFormatError, RegistryError)):
        promote(store, "tgt", directory, {"run_id": "r1"}, "production", SERVING)
    assert store.list("drafters") == []
    record("bad input", f"a drafter directory with {what}", f"refused ('{message}'); nothing published")


def test_checksum_mismatch_on_pull_keeps_the_served_copy(store, tmp_path, record):
    good = promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)["version"]
    served = pull(store, "tgt", "production", tmp_path / "served")
    before = (served / "model.safetensors").read_bytes()
    bad = promote(store, "tgt", drafter_dir(tmp_path, 2), {"run_id": "r2"}, "production", SERVING)["version"]
    key = f"{layout.drafter_version_prefix('tgt', bad)}/model.safetensors"
    store.put_bytes(key, store.get_bytes(key)[:-8] + b"\x00" * 8)
    with pytest.raises(RegistryError, match="checksum mismatch"):
        pull(store, "tgt", "production", served)
    assert (served / "model.safetensors").read_bytes() == before
    assert verify_dir(served)["version"] == good
    assert (
        sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".served")) == []
    )  # no partial download
    record(
        "bad input",
        "a registry object whose bytes no longer match the manifest sha256, on pull",
        "RegistryError 'checksum mismatch'; the served copy stays as it was",
    )


def _shard(tmp_path):
    from pipeline.data.capture_shards import CaptureSample
    from pipeline.data.shard_writer import write_shard

    sample = CaptureSample(
        "s0",
        torch.randint(0, 100, (12,)),
        torch.ones(12, dtype=torch.uint8),
        torch.randn(12, 48),
        None,
        torch.randint(0, 100, (12, 4)),
        torch.randn(12, 4),
    )
    path = tmp_path / "train-00000.safetensors"
    write_shard([sample], path, "fp8")
    return path


def test_a_dataset_shard_that_does_not_match_its_manifest_is_refused(store, tmp_path, record):
    from pipeline.storage import StorageError
    from pipeline.training.stream import ShardCache, ShardRef

    path = _shard(tmp_path)
    info = store.put_file("captures/t/s/train-00000.safetensors", path)
    store.put_bytes(
        "captures/t/s/train-00000.safetensors", path.read_bytes()[:-16] + b"\x00" * 16
    )  # torn rewrite
    cache = ShardCache(store, tmp_path / "cache", 1 << 30)
    ref = ShardRef(
        key="captures/t/s/train-00000.safetensors", sha256=info.sha256, bytes=info.bytes, samples=1
    )
    with pytest.raises(StorageError, match="checksum mismatch"):
        cache.fetch(ref)
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-written is left to train on
    record(
        "bad input",
        "a dataset shard whose bytes differ from the dataset manifest's sha256",
        "StorageError 'checksum mismatch'; nothing cached for training",
    )


@pytest.mark.parametrize(
    "damage, message, what",
    [
        (lambda raw: b"\x00" * 64, "implausibly large|not a capture shard|Expecting|header", "random bytes"),
        (
            lambda raw: raw.replace(b'"format"', b'"formax"', 1),
            "not a capture shard",
            "a shard without its format tag",
        ),
    ],
)
def test_files_that_are_not_capture_shards_are_refused(tmp_path, damage, message, what, record):
    from pipeline.data.capture_shards import ShardFormatError, ShardReader

    path = _shard(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises((ShardFormatError, ValueError), match=message):
        ShardReader.from_file(path)
    record("bad input", f"a dataset shard that is {what}", "ShardFormatError naming what is wrong")


def test_a_manifest_of_the_wrong_kind_is_refused(store, record):
    from pipeline.manifest import publish, read_manifest

    publish(store, "datasets/t/fake", "prompts", [], {})
    with pytest.raises(Exception, match="kind|prompts"):
        read_manifest(store, "datasets/t/fake", kind="dataset")
    record(
        "bad input", "a dataset URI whose manifest is another kind (prompts)", "refused, naming both kinds"
    )
