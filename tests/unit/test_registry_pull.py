"""The registry's pull and verify on a file store: what pull may replace, what it leaves behind, the modes it
writes, what verify accepts in a directory, and version ids that are each publish's own."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import layout
from pipeline.ops import registry
from pipeline.ops.registry import RegistryError, promote, publish_version, pull, verify_dir
from pipeline.storage import FileStore, sha256_file
from tests.builders import SERVING, drafter_dir

TARGET = "tgt"


@pytest.fixture
def store(tmp_path):
    return FileStore(tmp_path / "store")


@pytest.fixture
def promoted(store, tmp_path):
    """A version of TARGET behind production; returns it."""
    return promote(store, TARGET, drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)[
        "version"
    ]


def snapshot(directory):
    """Every path under `directory` with its bytes (None for a directory)."""
    return {
        str(path.relative_to(directory)): (None if path.is_dir() else path.read_bytes())
        for path in sorted(directory.rglob("*"))
    }


def beside(dest):
    """The entries beside dest whose names pull gives what it makes for dest (staging and retired copies, its
    lock)."""
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}."))


# ---- what pull may replace -------------------------------------------------------------------------------


def test_a_pull_records_which_registry_version_it_wrote_and_still_verifies(store, promoted, tmp_path):
    dest = pull(store, TARGET, "production", tmp_path / "served")
    marker = json.loads((dest / registry.PULL_MARKER).read_text())
    assert marker["store"] == store.root_uri
    assert (marker["target"], marker["version"]) == (TARGET, promoted)
    assert set(marker["files"]) == {p.name for p in dest.iterdir()} - {registry.PULL_MARKER}
    assert verify_dir(dest)["version"] == promoted
    assert sorted(p.name for p in dest.glob("*.safetensors")) == ["model.safetensors"]  # what a server loads


@pytest.mark.parametrize("lay_out", ["a model directory", "a file of notes only"])
def test_a_non_empty_dest_that_pull_did_not_write_is_refused_and_left_as_it_was(
    store, promoted, tmp_path, lay_out
):
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine\n")
    if lay_out == "a model directory":
        (dest / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
        (dest / "model-00001-of-00002.safetensors").write_bytes(os.urandom(1 << 20))
    before = snapshot(dest)
    with pytest.raises(RegistryError, match=f"{dest} is not empty and was not written by `drafter pull`"):
        pull(store, TARGET, "production", dest)
    assert snapshot(dest) == before
    assert beside(dest) == []


def test_a_dest_that_is_a_file_is_refused(store, promoted, tmp_path):
    dest = tmp_path / "served"
    dest.write_text("not a directory\n")
    with pytest.raises(RegistryError, match=f"{dest} is not a directory"):
        pull(store, TARGET, "production", dest)
    assert dest.read_text() == "not a directory\n"


def test_an_empty_dest_directory_is_pulled_into(store, promoted, tmp_path):
    dest = tmp_path / "served"
    dest.mkdir()
    assert verify_dir(pull(store, TARGET, "production", dest))["version"] == promoted


def test_an_earlier_pull_is_replaced_by_the_next_version(store, promoted, tmp_path):
    dest = pull(store, TARGET, "production", tmp_path / "served")
    second = promote(store, TARGET, drafter_dir(tmp_path, 2), {"run_id": "r2"}, "production", SERVING)
    pull(store, TARGET, "production", dest)
    assert verify_dir(dest)["version"] == second["version"] != promoted
    assert json.loads((dest / registry.PULL_MARKER).read_text())["version"] == second["version"]
    assert beside(dest) == []


def test_an_earlier_pull_holding_a_file_pull_did_not_write_is_refused(store, promoted, tmp_path):
    dest = pull(store, TARGET, "production", tmp_path / "served")
    (dest / "notes.txt").write_text("written by hand after the pull\n")
    before = snapshot(dest)
    with pytest.raises(RegistryError, match=r"notes\.txt, which `drafter pull` did not write"):
        pull(store, TARGET, "production", dest)
    assert snapshot(dest) == before


def _pulled_before_the_marker(dest):
    """dest as the tool's earlier versions left a pull: the version's files and its manifest.json, no
    PULL_MARKER."""
    (dest / registry.PULL_MARKER).unlink()
    return dest


def test_a_pull_made_before_pulls_wrote_a_marker_is_replaced(store, promoted, tmp_path):
    """A retry after an upgrade pulls again into workdir/incumbent_drafter, pulled by the previous version."""
    dest = _pulled_before_the_marker(pull(store, TARGET, "production", tmp_path / "incumbent_drafter"))
    second = promote(store, TARGET, drafter_dir(tmp_path, 2), {"run_id": "r2"}, "production", SERVING)
    pull(store, TARGET, "production", dest)
    assert verify_dir(dest)["version"] == second["version"] != promoted
    assert json.loads((dest / registry.PULL_MARKER).read_text())["version"] == second["version"]


def test_a_markerless_dest_holding_more_than_its_manifest_lists_is_refused(store, promoted, tmp_path):
    dest = _pulled_before_the_marker(pull(store, TARGET, "production", tmp_path / "pulled_drafter"))
    (dest / "notes.txt").write_text("written by hand after the pull\n")
    before = snapshot(dest)
    with pytest.raises(RegistryError, match=f"{dest} is not empty and was not written by `drafter pull`"):
        pull(store, TARGET, "production", dest)
    assert snapshot(dest) == before
    (dest / "notes.txt").unlink()
    (dest / "config.json").unlink()  # less than its manifest lists: not what a pull left either
    with pytest.raises(RegistryError, match="was not written by `drafter pull`"):
        pull(store, TARGET, "production", dest)


# ---- leftovers and modes ---------------------------------------------------------------------------------


def test_leftovers_of_dead_pulls_are_removed_by_the_next_pull(store, promoted, tmp_path):
    dest = tmp_path / "served"
    killed_downloading = registry._make_holder(dest)  # a pull killed mid-download
    (killed_downloading / "drafter").mkdir()
    (killed_downloading / "drafter" / "model.safetensors").write_bytes(b"\0" * 4096)
    killed_swapping = registry._make_holder(dest)  # one killed mid-swap, the dest it retired inside
    (killed_swapping / "retired").mkdir()
    (killed_swapping / "retired" / "config.json").write_text("{}")
    unrelated = tmp_path / ".served.pull-b.pull-12-0a1b2c3d"  # staging of another dest, "served.pull-b"
    unrelated.mkdir()
    pull(store, TARGET, "production", dest)
    assert not killed_downloading.exists() and not killed_swapping.exists()
    assert unrelated.is_dir() and beside(dest) == [unrelated.name]
    assert verify_dir(dest)["version"] == promoted


def test_what_is_only_named_like_a_pulls_leftovers_is_left_alone(store, promoted, tmp_path):
    """A pull removes what pulls made (their holder's marker says so), never a path by its name alone."""
    dest = tmp_path / "served"
    named_alike = [
        tmp_path / f".served.pull-{2**22 + 7}-0a1b2c3d",  # no marker: made by someone else
        tmp_path / ".served.pull-backup01",
        tmp_path / f".served.old-{2**22 + 7}",
    ]
    for path in named_alike:
        path.mkdir()
        (path / "weights.safetensors").write_bytes(b"kept" * 1024)
    forged = registry._make_holder(tmp_path / "elsewhere")  # a marker naming another dest
    forged.rename(tmp_path / f".served.pull-{2**22 + 8}-0a1b2c3d")
    pull(store, TARGET, "production", dest)
    assert all((path / "weights.safetensors").read_bytes() == b"kept" * 1024 for path in named_alike)
    assert (tmp_path / f".served.pull-{2**22 + 8}-0a1b2c3d").is_dir()
    assert verify_dir(dest)["version"] == promoted


def test_a_live_pulls_staging_copy_is_left_alone(store, promoted, tmp_path):
    """A pull into a dest waits for the live pull into it (which holds the dest's pull lock) instead of
    removing its staging copy."""
    dest = tmp_path / "served"
    live = tmp_path / f".served.pull-{os.getpid()}-0a1b2c3d"
    live.mkdir()
    (live / "config.json").write_text("{}")
    done = threading.Event()
    outcome = []
    with open(tmp_path / ".served.pull.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # what a live pull into dest holds
        waiting = threading.Thread(
            target=lambda: (outcome.append(pull(store, TARGET, "production", dest)), done.set()), daemon=True
        )
        waiting.start()
        assert not done.wait(1.5)
        assert (live / "config.json").read_text() == "{}" and not dest.exists()
        live.rename(tmp_path / "finished")  # the live pull ends: its staging copy became its dest
    waiting.join(60)
    assert outcome and verify_dir(dest)["version"] == promoted


def test_pulled_directories_and_files_are_readable_by_other_users(store, promoted, tmp_path):
    old = os.umask(0o022)
    try:
        dest = pull(store, TARGET, "production", tmp_path / "served")
    finally:
        os.umask(old)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in dest.iterdir()} == {
        path.name: 0o644 for path in dest.iterdir()
    }


def test_a_restrictive_umask_is_honoured(store, promoted, tmp_path):
    old = os.umask(0o077)
    try:
        dest = pull(store, TARGET, "production", tmp_path / "served")
    finally:
        os.umask(old)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o700
    assert {stat.S_IMODE(path.stat().st_mode) for path in dest.iterdir()} == {0o600}


# ---- verify: the directory and the manifest, both ways --------------------------------------------------


def rewrite_manifest(directory, change):
    manifest = json.loads((directory / "manifest.json").read_text())
    change(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("left_out", ["model.safetensors", "config.json", "capture_contract.json"])
def test_verify_refuses_a_manifest_that_leaves_out_a_required_file(store, promoted, tmp_path, left_out):
    dest = pull(store, TARGET, "production", tmp_path / "served")
    rewrite_manifest(
        dest,
        lambda manifest: manifest.update(objects=[o for o in manifest["objects"] if o["name"] != left_out]),
    )
    with pytest.raises(RegistryError, match=f"{left_out} is not listed in manifest.json"):
        verify_dir(dest)


def test_verify_refuses_a_file_the_manifest_does_not_list(store, promoted, tmp_path):
    dest = pull(store, TARGET, "production", tmp_path / "served")
    tensors = load_file(str(dest / "model.safetensors"))
    save_file(
        {name: torch.zeros_like(t) for name, t in tensors.items()}, str(dest / "model-00002.safetensors")
    )
    with pytest.raises(RegistryError, match=r"model-00002\.safetensors is in the directory but not listed"):
        verify_dir(dest)


def test_verify_refuses_a_subdirectory_the_manifest_does_not_list(store, promoted, tmp_path):
    dest = pull(store, TARGET, "production", tmp_path / "served")
    (dest / "extra").mkdir()
    with pytest.raises(RegistryError, match="extra is in the directory but not listed"):
        verify_dir(dest)


@pytest.mark.parametrize(
    "content, reason",
    [
        ("{", "is not valid JSON"),
        ("[]", "is not a JSON object"),
        ('{"objects": {"config.json": 1}}', "objects"),
        ('{"objects": [{"name": "config.json", "bytes": 3}]}', "sha256"),
        ('{"objects": [{"name": "../x", "bytes": 3, "sha256": "0"}]}', "../x"),
    ],
)
def test_verify_names_a_malformed_manifest(store, promoted, tmp_path, content, reason):
    dest = pull(store, TARGET, "production", tmp_path / "served")
    (dest / "manifest.json").write_text(content)
    with pytest.raises(RegistryError) as refused:
        verify_dir(dest)
    assert str(dest / "manifest.json") in str(refused.value) and reason in str(refused.value)


# ---- version ids ------------------------------------------------------------------------------------------


def test_each_publish_of_the_same_weights_gets_its_own_version(store, tmp_path):
    directory = drafter_dir(tmp_path, 1)
    first, _ = publish_version(store, TARGET, directory, {"run_id": "r1"}, SERVING)
    second, _ = publish_version(store, TARGET, directory, {"run_id": "r2"}, SERVING)
    assert first != second
    weights = sha256_file(directory / "model.safetensors")[:10]
    assert first.split("-")[2] == second.split("-")[2] == weights
    for version in (first, second):
        assert verify_dir(pull(store, TARGET, version, tmp_path / version))["version"] == version


def test_a_rerun_of_a_promotion_reuses_its_version(store, tmp_path):
    directory = drafter_dir(tmp_path, 1)
    first = promote(store, TARGET, directory, {"run_id": "r1"}, "production", SERVING)
    again = promote(store, TARGET, directory, {"run_id": "r1"}, "production", SERVING)
    assert again["version"] == first["version"]
    assert [row["version"] for row in registry.list_versions(store, TARGET)] == [first["version"]]


def test_a_rerun_finds_a_version_published_with_the_earlier_id_format(store, tmp_path):
    """Versions published before ids carried a per-publish part (<time>-<weights sha>) are still reused."""
    directory = drafter_dir(tmp_path, 1)
    version, _ = publish_version(store, TARGET, directory, {"run_id": "r1"}, SERVING)
    earlier = "-".join(version.split("-")[:3])
    old, new = (tmp_path / "store" / layout.drafter_version_prefix(TARGET, v) for v in (earlier, version))
    new.rename(old)
    assert publish_version(store, TARGET, directory, {"run_id": "r1"}, SERVING)[0] == earlier


def test_a_recorded_load_becomes_the_flag_and_a_version_recording_a_bad_one_is_refused():
    assert registry.serving_flags("/d", {**SERVING, "max_running_requests": 48})[-2:] == [
        "--max-running-requests",
        "48",
    ]
    assert "--max-running-requests" not in registry.serving_flags("/d", SERVING)  # versions promoted before
    manifest = {"objects": [], "serving": {**SERVING, "max_running_requests": "48"}}
    assert registry._drafter_manifest_problems(manifest) == [
        "has a \"serving\" max_running_requests that is no positive count: '48'"
    ]
    assert registry._drafter_manifest_problems({**manifest, "serving": SERVING}) == []
