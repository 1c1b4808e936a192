"""Process death: `drafter <stage>` is SIGKILLed at a random point of its work (chosen by a seeded
draw among the progress marks it leaves), then run again. The end state must equal an uninterrupted
run's: the same sample ids, the same manifests, no orphans listed, training resumed from its checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.data.jsonl import decode_jsonl
from pipeline.manifest import read_listed, read_manifest
from pipeline.storage import open_store
from tests.conftest import REPO, storage_config, tiny_config_dict

pytestmark = pytest.mark.fault

RUN = "death"
SEED = int(os.environ.get("DRAFTER_FAULT_SEED", "20261130"))


def _config_file(tmp: Path) -> Path:
    data = tiny_config_dict(storage_config("file", tmp, None))
    data["prompts"].update(num_samples=48, shard_size=12)
    data["generate"]["checkpoint_every"] = 4
    data["capture"]["batch_size"] = 4
    data["train"].update(epochs=2, checkpoint_every_steps=4, micro_batch_size=1)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _drafter(config: Path, stage: str) -> subprocess.Popen:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", stage, "--config", str(config), "--run-id", RUN],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _finish(config: Path, stage: str) -> None:
    process = _drafter(config, stage)
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err.decode()[-3000:]


def _kill_when(config: Path, stage: str, marks, wanted: int, timeout: float = 600) -> int:
    """Start the stage, SIGKILL its process group once `marks()` counts `wanted` progress marks."""
    process = _drafter(config, stage)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            seen = marks()
            if seen >= wanted:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=60)
                return seen
            if process.poll() is not None:
                pytest.fail(
                    f"{stage} finished before reaching {wanted} progress marks: "
                    f"{process.stderr.read().decode()[-2000:]}"
                )
            time.sleep(0.01)  # the window between a progress mark and the next one can be a few tens of ms
        pytest.fail(f"{stage} did not reach {wanted} progress marks in {timeout:.0f}s")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_dir):
    """An uninterrupted run and the run that gets killed, side by side."""
    clean = _config_file(tmp_path_factory.mktemp("clean"))
    killed = _config_file(tmp_path_factory.mktemp("killed"))
    return {"clean": clean, "killed": killed, "rng": random.Random(SEED)}


def _store(config: Path):
    return open_store(load_config(config).storage)


def _ids(config: Path, prefix: str, kind: str) -> list[str]:
    store = _store(config)
    manifest = read_manifest(store, prefix, kind=kind)
    return [
        r["id"]
        for s in manifest["shards"]
        for r in decode_jsonl(read_listed(store, prefix, manifest, s["name"]))
    ]


def _files(config: Path, prefix: str) -> list[str]:
    return sorted(key[len(prefix) + 1 :] for key in _store(config).list(prefix))


def _compare(runs, prefix: str, kind: str) -> tuple[list[str], int, int]:
    clean, got = _ids(runs["clean"], prefix, kind), _ids(runs["killed"], prefix, kind)
    lost = len(set(clean) - set(got))
    duplicated = sum(n - 1 for n in Counter(got).values())
    assert got == clean and lost == 0 and duplicated == 0
    assert _files(runs["killed"], prefix) == _files(runs["clean"], prefix)  # no orphan parts or temp objects
    return got, lost, duplicated


def _count(root: Path, pattern: str) -> int:
    return len(list(root.glob(pattern))) if root.exists() else 0


def _root(config: Path) -> Path:
    return Path(yaml.safe_load(config.read_text())["storage"]["root"])


def test_sigkill_during_prompts_then_rerun(tmp_path_factory, runs, record):
    configs = {}
    for name in ("clean", "killed"):
        path = _config_file(tmp_path_factory.mktemp(f"prompts-{name}"))
        data = yaml.safe_load(path.read_text())
        data["prompts"].update(num_samples=400, shard_size=8)  # 50 shards: a wide window to die in
        path.write_text(yaml.safe_dump(data))
        configs[name] = path
    _finish(configs["clean"], "prompts")
    wanted = runs["rng"].randint(1, 20)
    root = _root(configs["killed"]) / "prompts" / RUN
    seen = _kill_when(configs["killed"], "prompts", lambda: _count(root, "*.jsonl"), wanted)
    assert not (root / "manifest.json").exists()  # it died before publishing
    _finish(configs["killed"], "prompts")
    ids, lost, dup = _compare(
        {"clean": configs["clean"], "killed": configs["killed"]}, f"prompts/{RUN}", "prompts"
    )
    record(
        "process death",
        f"SIGKILL during prompts (after {seen} shards written, before the manifest), then rerun",
        f"the rerun rewrote the snapshot; the same {len(ids)} sample ids and files as a clean run",
        lost=lost,
        duplicated=dup,
    )


def test_sigkill_during_generate_then_rerun(runs, record):
    _finish(runs["clean"], "prompts")
    _finish(runs["killed"], "prompts")
    _finish(runs["clean"], "generate")
    wanted = runs["rng"].randint(1, 6)
    root = _root(runs["killed"]) / "responses" / "tiny-test" / RUN
    seen = _kill_when(
        runs["killed"],
        "generate",
        lambda: _count(root, "*.parts/part-*.jsonl") + 4 * _count(root, "*.done.json"),
        wanted,
    )
    _finish(runs["killed"], "generate")
    ids, lost, dup = _compare(runs, f"responses/tiny-test/{RUN}", "responses")
    record(
        "process death",
        f"SIGKILL during generate (after {seen} finished parts), then rerun",
        f"resumed from the finished parts; the same {len(ids)} conversations, manifests and files "
        "as a clean run",
        lost=lost,
        duplicated=dup,
    )


def test_sigkill_during_capture_then_rerun(runs, record):
    _finish(runs["clean"], "capture")
    wanted = runs["rng"].randint(1, 3)
    root = _root(runs["killed"]) / "captures" / "tiny-test" / RUN
    seen = _kill_when(runs["killed"], "capture", lambda: _count(root, "*.done.json"), wanted)
    _finish(runs["killed"], "capture")
    store_clean, store_killed = _store(runs["clean"]), _store(runs["killed"])
    prefix = f"captures/tiny-test/{RUN}"
    clean, killed = (
        read_manifest(store_clean, prefix, kind="capture"),
        read_manifest(store_killed, prefix, kind="capture"),
    )
    assert [(s["name"], s["samples"], s["tokens"]) for s in killed["shards"]] == [
        (s["name"], s["samples"], s["tokens"]) for s in clean["shards"]
    ]
    assert killed["counts"] == clean["counts"]
    assert _files(runs["killed"], prefix) == _files(runs["clean"], prefix)
    samples = sum(s["samples"] for s in killed["shards"])
    record(
        "process death",
        f"SIGKILL during capture (after {seen} finished shards), then rerun",
        f"finished shards kept, the rest captured; {samples} samples in the same shards as a clean run",
    )


def test_sigkill_during_train_resumes_from_the_checkpoint(runs, record):
    if not (_root(runs["killed"]) / "datasets").exists():
        _finish(runs["killed"], "capture")
        _finish(runs["killed"], "dataset")
    cache = Path(yaml.safe_load(runs["killed"].read_text())["storage"]["local_cache"]) / "runs" / RUN
    before = {p for p in cache.glob("train-*")}
    # killed once the first checkpoint (step 4 of 36) is committed: `latest` is replaced atomically after all
    # ranks wrote their files, so a directory alone is not yet a checkpoint
    _kill_when(
        runs["killed"],
        "train",
        lambda: sum(1 for p in cache.glob("train-*/checkpoints/latest") if p.parent.parent not in before),
        1,
    )
    _finish(runs["killed"], "train")
    store = _store(runs["killed"])
    manifest = read_manifest(store, f"runs/{RUN}/train", kind="train")
    result = json.loads(read_listed(store, f"runs/{RUN}/train", manifest, "train_result.json"))
    assert result["epochs_run"] == 2 and result["stop_reason"] == "completed"
    # the rerun resumed from the checkpoint: it trained, but not from step 0
    assert 0 < result["steps_this_attempt"] < result["global_steps"], result
    record(
        "process death",
        "SIGKILL during train (after its first checkpoint), then rerun",
        f"resumed at step {result['global_steps'] - result['steps_this_attempt']} "
        f"of {result['global_steps']}; "
        "2 epochs completed; no training process outlived the kill",
    )


def test_sigkill_during_promote_leaves_no_listed_orphan(runs, record):
    from pipeline.ops import registry

    for stage in ("evaluate", "gate", "benchmark"):
        _finish(runs["killed"], stage)
    store = _store(runs["killed"])
    delay = runs["rng"].uniform(0.0, 1.5)
    process = _drafter(runs["killed"], "promote")
    deadline = time.monotonic() + 120
    while not store.list("drafters") and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the upload of the version has begun
    time.sleep(delay)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    _finish(runs["killed"], "promote")
    versions = registry.list_versions(store, "tiny-test")
    production = registry.read_alias(store, "tiny-test", "production")
    assert [v["version"] for v in versions] == [production["version"]]  # one listed version, the served one
    assert registry.verify_dir(
        registry.pull(store, "tiny-test", "production", _root(runs["killed"]).parent / "served")
    )
    record(
        "process death",
        f"SIGKILL during promote ({delay:.2f} s into the version upload), then rerun",
        "exactly one listed version and production points at it; the pulled copy verifies",
    )
