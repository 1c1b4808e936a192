"""Resumability: an interrupted generate or a SIGKILLed capture, rerun, loses and duplicates nothing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.data.capture_shards import ShardReader
from pipeline.manifest import fetch_listed, read_listed, read_manifest
from pipeline.stages import generate, run_stage
from tests.builders import response_ids
from tests.conftest import REPO, published, storage_config, tiny_config_dict


class CrashAfter:
    """An engine that dies (like a killed worker) after `calls` successful batches."""

    def __init__(self, engine, calls):
        self.engine, self.calls = engine, calls
        self.name, self.version = engine.name, engine.version

    def generate(self, prompts_, params):
        if self.calls == 0:
            raise KeyboardInterrupt("simulated crash")
        self.calls -= 1
        return self.engine.generate(prompts_, params)


def test_interrupted_generation_resumes_without_loss_or_duplicates(
    store, storage, monkeypatch, tiny_target_dir
):
    data = tiny_config_dict(storage)
    data["prompts"].update({"num_samples": 40, "shard_size": 40, "eval_fraction": 0.0})
    data["generate"].update({"batch_size": 8, "checkpoint_every": 8, "max_new_tokens": 8})
    config = load_config(data=data)
    prompt_set = run_stage("prompts", config, "resume", store)
    real = generate.make_engine(config)
    monkeypatch.setattr(generate, "make_engine", lambda _config: CrashAfter(real, 2))
    with pytest.raises(KeyboardInterrupt):
        run_stage("generate", config, "resume", store, prompts_uri=prompt_set.uri)
    monkeypatch.setattr(generate, "make_engine", lambda _config: real)
    result = run_stage("generate", config, "resume", store, prompts_uri=prompt_set.uri)
    counts = published(store, result)["counts"]
    assert counts == {"input": 40, "succeeded": 24, "skipped": 16, "failed": 0}
    ids = response_ids(store, result.uri)
    assert len(ids) == len(set(ids)) == 40
    uninterrupted = run_stage("generate", config, "straight", store, prompts_uri=prompt_set.uri)
    assert sorted(response_ids(store, uninterrupted.uri)) == sorted(ids)
    assert not [k for k in store.list(store.key_for(result.uri)) if ".parts/" in k]


def drafter(args, config_path):
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", *args, "--config", str(config_path), "--run-id", "kill"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )


def test_capture_killed_mid_run_resumes_to_exactly_one_copy(tmp_path, tiny_target_dir):
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["prompts"].update({"num_samples": 96, "shard_size": 12, "eval_fraction": 0.0})
    data["generate"]["max_new_tokens"] = 16
    data["capture"]["batch_size"] = 2
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    for stage in ("prompts", "generate"):
        assert drafter([stage], config_path).wait(300) == 0
    from pipeline.storage import StorageConfig, open_store

    store = open_store(StorageConfig(**data["storage"]))
    # a capture shard per prompt shard: 96 conversations in shards of 12 per domain (the demo corpus has two)
    prompt_shards = len(read_manifest(store, "prompts/kill", kind="prompts")["shards"])
    store_root = Path(data["storage"]["root"])
    captures = store_root / "captures" / "tiny-test" / "kill"
    process = drafter(["capture"], config_path)
    deadline = time.monotonic() + 300
    while not list(captures.glob("*.done.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    done_at_kill = len(list(captures.glob("*.done.json")))
    assert not (captures / "manifest.json").exists() and 0 < done_at_kill < 8
    rerun = drafter(["capture"], config_path)
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err.decode()[-2000:]

    manifest = read_manifest(store, "captures/tiny-test/kill", kind="capture")
    listed = [o["name"] for o in manifest["objects"] if o["name"].endswith(".safetensors")]
    assert len(listed) == len(set(listed)) == prompt_shards >= 8
    ids = []
    for name in listed:
        fetch_listed(store, "captures/tiny-test/kill", manifest, name, tmp_path / name)  # checksums hold
        reader = ShardReader.from_file(tmp_path / name)
        ids += reader.sample_ids
        reader.close()
    assert len(ids) == len(set(ids))
    expected = response_ids(store, store.uri("responses/tiny-test/kill"))
    quarantined = (
        [
            json.loads(line)["id"]
            for line in read_listed(
                store, "captures/tiny-test/kill", manifest, "quarantine.jsonl"
            ).splitlines()
        ]
        if any(o["name"] == "quarantine.jsonl" for o in manifest["objects"])
        else []
    )
    assert sorted(ids + quarantined) == sorted(expected)
