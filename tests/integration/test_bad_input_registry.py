"""Bad input to the registry, as a careless or hostile user gives it: `drafter pull` pointed at a directory it
did not write, publishes racing on the same weights, directories that do not match their manifest, pulls
killed mid-download, corrupt aliases and manifests. Every case ends in an error that names its source, one
line and no traceback from the CLI, and nothing is lost or changed that the user did not ask to change."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import layout
from pipeline.ops import registry
from pipeline.ops.registry import list_versions, promote, publish_version, pull, verify_dir
from pipeline.storage import FileStore
from tests.builders import SERVING, drafter_dir
from tests.conftest import REPO

pytestmark = pytest.mark.fault

LOCAL = REPO / "configs" / "local.yaml"
TARGET = "tgt"


def drafter(store_root, command, *argv):
    """`drafter COMMAND --config configs/local.yaml` on the registry of TARGET at store_root."""
    args = [command, "--config", str(LOCAL), f"storage.root={store_root}", f"target.name={TARGET}", *argv]
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def drafter_verify(directory, *argv):
    """`drafter verify DIRECTORY`."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "verify", str(directory), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_line_error(result) -> str:
    """The CLI's one line of error for a refused command (non-zero exit, no traceback)."""
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def snapshot(directory):
    return {
        str(path.relative_to(directory)): (None if path.is_dir() else path.read_bytes())
        for path in sorted(directory.rglob("*"))
    }


@pytest.fixture
def file_registry(tmp_path):
    """A file store with one version of TARGET behind production: (store, version)."""
    store = FileStore(tmp_path / "store")
    version = promote(store, TARGET, drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)[
        "version"
    ]
    return store, version


# ---- 1. pull never deletes what it did not write ---------------------------------------------------------


def test_pull_into_a_model_directory_is_refused_and_deletes_nothing(file_registry, tmp_path, record):
    store, _ = file_registry
    dest = tmp_path / "Kimi-K2.5"
    dest.mkdir()
    (dest / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    (dest / "model-00001-of-00064.safetensors").write_bytes(os.urandom(1 << 20))
    (dest / "NOTES.md").write_text("downloaded by hand, 3 days\n")
    before = snapshot(dest)
    error = one_line_error(drafter(store.root, "pull", "--alias", "production", "--dest", str(dest)))
    assert f"{dest} is not empty and was not written by `drafter pull`" in error
    assert snapshot(dest) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".Kimi-K2.5.pull-")] == []
    record(
        "bad input",
        "`drafter pull --dest` pointed at a model directory (config.json, a 1 MB shard, a notes file)",
        "exit 1 with one line naming the dest; the directory byte-identical, nothing downloaded beside it",
    )


# ---- 2. a version's objects never change once its manifest exists -----------------------------------------


# dt as pipeline.ops.registry reads it, stopped at one second: every publish happens within it
FROZEN_CLOCK = SimpleNamespace(
    UTC=dt.UTC, datetime=SimpleNamespace(now=lambda tz=None: dt.datetime(2026, 12, 1, 12, tzinfo=tz))
)


class Race:
    """The racers' writes, in the order they completed, and what holds each racer back: every racer first
    makes its checks and reaches its first write; then all write at once (`together`), or the first racer
    publishes while the others wait for its manifest, then write theirs (the interleaving that corrupted a
    version: their checks found no manifest, their writes land after it)."""

    def __init__(self, racers: int, together: bool):
        self.together = together
        self.lock = threading.Lock()
        self.keys: list[str] = []
        self.checked = threading.Barrier(racers)
        self.first_published = threading.Event()

    def changed_after_their_manifest(self) -> list[str]:
        """Keys written under a version prefix after that prefix's manifest.json was."""
        published: set[str] = set()
        late = []
        for key in self.keys:
            prefix = key.rsplit("/", 1)[0]
            if prefix in published:
                late.append(key)
            if key.endswith("/manifest.json"):
                published.add(prefix)
        return late


class RacingStore:
    """One racer's view of the store, held back and logged as its Race says."""

    def __init__(self, store, race: Race, first: bool):
        self.store, self.race, self.first = store, race, first
        self.started = False

    def __getattr__(self, name):
        return getattr(self.store, name)

    def _start(self):
        if self.started:
            return
        self.started = True
        self.race.checked.wait(60)
        if not (self.race.together or self.first):
            assert self.race.first_published.wait(60)

    def _written(self, key):
        with self.race.lock:
            self.race.keys.append(key)

    def put_file(self, key, path):
        self._start()
        info = self.store.put_file(key, path)
        self._written(key)
        return info

    def put_bytes(self, key, data):
        self._start()
        info = self.store.put_bytes(key, data)
        self._written(key)
        return info

    def put_if(self, key, data, expected_tag):
        self._start()
        try:
            tag = self.store.put_if(key, data, expected_tag)
        finally:
            if self.first:  # won or lost, the others go on
                self.race.first_published.set()
        self._written(key)
        return tag


@pytest.mark.parametrize("racers, together", [(2, False), (3, True)], ids=["one-after-another", "together"])
def test_concurrent_publishes_of_the_same_weights_never_change_a_published_version(
    store, tmp_path, monkeypatch, racers, together, record
):
    monkeypatch.setattr(registry, "dt", FROZEN_CLOCK)
    weights = drafter_dir(tmp_path, 1)
    race = Race(racers, together)
    outcomes: dict[int, object] = {}

    def publish(index):
        racer = RacingStore(store, race, first=index == 0)
        try:
            outcomes[index] = publish_version(racer, TARGET, weights, {"run_id": f"r{index}"}, SERVING)[0]
        except Exception as error:  # noqa: BLE001 (the assertion below shows it)
            outcomes[index] = error

    threads = [threading.Thread(target=publish, args=(index,)) for index in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert all(isinstance(outcome, str) for outcome in outcomes.values()), outcomes
    assert len(set(outcomes.values())) == racers
    assert race.changed_after_their_manifest() == []
    listed = [row["version"] for row in list_versions(store, TARGET)]
    assert sorted(listed) == sorted(outcomes.values())
    for version in listed:
        pulled = pull(store, TARGET, version, tmp_path / "pulled" / version)
        assert verify_dir(pulled)["lineage"]["run_id"] in {f"r{index}" for index in range(racers)}
    record(
        "bad input",
        f"{racers} publishes of the same weights in the same second"
        + (", all writing at once" if together else ", each starting once the first's manifest exists"),
        f"{racers} distinct versions; no object written under a prefix after its manifest; each pulls and "
        "verifies",
        tried=racers,
    )


# ---- 5. verify compares the directory with the manifest both ways ---------------------------------------


def test_verify_refuses_a_required_file_left_out_of_the_manifest(file_registry, tmp_path, record):
    store, _ = file_registry
    dest = pull(store, TARGET, "production", tmp_path / "served")
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["objects"] = [o for o in manifest["objects"] if o["name"] != "model.safetensors"]
    (dest / "manifest.json").write_text(json.dumps(manifest))
    error = one_line_error(drafter_verify(dest))
    assert "model.safetensors is not listed in manifest.json" in error and str(dest) in error
    record(
        "bad input",
        "`drafter verify` of a directory whose manifest leaves out model.safetensors",
        "exit 1, naming the file the manifest does not list",
    )


def test_verify_refuses_an_unlisted_weights_file(file_registry, tmp_path, record):
    store, _ = file_registry
    dest = pull(store, TARGET, "production", tmp_path / "served")
    tensors = load_file(str(dest / "model.safetensors"))
    save_file(
        {name: torch.zeros_like(t) for name, t in tensors.items()},
        str(dest / "model-00002-of-00002.safetensors"),
    )
    error = one_line_error(drafter_verify(dest))
    assert "model-00002-of-00002.safetensors is in the directory but not listed in manifest.json" in error
    record(
        "bad input",
        "`drafter verify` of a directory with an extra *.safetensors of zeroed weights, which SGLang loads",
        "exit 1, naming the unlisted file",
    )


# ---- 8. a killed pull's leftovers, and modes others can read --------------------------------------------

SLOW_PULL = """
import sys, time
from pipeline.storage import FileStore

download = FileStore.get_file_verified


def slowly(self, key, dest, sha256):  # the file in place under its name, then the pause
    download(self, key, dest, sha256)
    time.sleep(float(sys.argv[1]))


FileStore.get_file_verified = slowly
from pipeline.cli import main

sys.exit(main(sys.argv[2:]))
"""


def slow_pull(store_root, dest, pause_s):
    """`drafter pull` in its own process, pausing pause_s after each file it puts in place."""
    argv = ["pull", "--config", str(LOCAL), f"storage.root={store_root}", f"target.name={TARGET}"]
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_PULL, str(pause_s), *argv, "--dest", str(dest)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def staging_copies(dest):
    return sorted(p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.pull-"))


def wait_for_a_downloaded_file(process, dest):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        for holder in staging_copies(dest):  # the pull's holder; what it downloads goes into drafter/
            staging = holder / "drafter"
            if staging.is_dir() and any(not p.name.startswith(".") for p in staging.iterdir()):
                return holder
        time.sleep(0.05)
    pytest.fail(f"the pull into {dest} downloaded nothing in 120 s")


def test_a_pull_killed_mid_download_leaves_nothing_after_the_next_pull(file_registry, tmp_path, record):
    store, version = file_registry
    dest = tmp_path / "served"
    killed = slow_pull(store.root, dest, 60)
    staging = wait_for_a_downloaded_file(killed, dest)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert staging.is_dir() and not dest.exists()
    old = os.umask(0o022)
    try:
        pull(store, TARGET, "production", dest)
    finally:
        os.umask(old)
    assert staging_copies(dest) == []
    assert verify_dir(dest)["version"] == version
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in dest.iterdir()} == {0o644}
    record(
        "bad input",
        "`drafter pull` killed with SIGKILL mid-download, then pulled again",
        "the killed pull's staging copy removed; the dest 0755 with files 0644, readable by a server running "
        "as another user",
    )


def test_a_live_pull_is_waited_for_not_cleaned_up(file_registry, tmp_path, record):
    store, version = file_registry
    dest = tmp_path / "served"
    live = slow_pull(store.root, dest, 0.5)
    staging = wait_for_a_downloaded_file(live, dest)
    outcome = []
    second = threading.Thread(target=lambda: outcome.append(pull(store, TARGET, "production", dest)))
    second.start()
    while live.poll() is None:
        assert staging.is_dir() or dest.is_dir()  # the live copy is never taken away from under it
        time.sleep(0.05)
    out, err = live.communicate()
    assert live.returncode == 0, err
    second.join(120)
    assert outcome == [dest] and verify_dir(dest)["version"] == version
    assert staging_copies(dest) == []
    record(
        "bad input",
        "two pulls into one dest at once, the first slowed",
        "the second waits for the first (its staging copy untouched), then replaces its pull; both exit 0",
    )


# ---- 9. errors that name their source ------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, reason, what",
    [
        (b"{not json", "is not valid JSON", "an alias file that is not JSON"),
        (b'{"alias": "production", "reason": "by hand"}', 'has no "version"', 'an alias without "version"'),
        (b'{"version": "../../etc"}', "version", "an alias whose version would climb out of the registry"),
    ],
)
@pytest.mark.parametrize("command", ["pull", "list"])
def test_a_corrupt_alias_is_an_error_naming_it(
    file_registry, tmp_path, content, reason, what, command, record
):
    store, _ = file_registry
    store.put_bytes(layout.alias_key(TARGET, "production"), content)
    argv = ["--dest", str(tmp_path / "served")] if command == "pull" else []
    error = one_line_error(drafter(store.root, command, *argv))
    assert store.uri(layout.alias_key(TARGET, "production")) in error and reason in error
    assert not (tmp_path / "served").exists()
    record("bad input", f"`drafter {command}` with {what}", "exit 1, one line naming the alias file")


@pytest.mark.parametrize(
    "content, reason",
    [
        ("{", "is not valid JSON"),
        ("[]", "is not a JSON object"),
        ('{"objects": [{"name": "config.json", "bytes": 10}]}', "sha256"),
    ],
    ids=["not JSON", "a list", "an entry without sha256"],
)
def test_a_malformed_manifest_at_verify_is_an_error_naming_it(
    file_registry, tmp_path, content, reason, record
):
    store, _ = file_registry
    dest = pull(store, TARGET, "production", tmp_path / "served")
    (dest / "manifest.json").write_text(content)
    error = one_line_error(drafter_verify(dest))
    assert str(dest / "manifest.json") in error and reason in error
    record(
        "bad input",
        f"`drafter verify` of a directory whose manifest.json {reason.removeprefix('is ')}",
        "exit 1, one line naming the manifest file",
    )


def test_one_corrupt_version_manifest_leaves_list_and_status_working(file_registry, tmp_path, record):
    store, good = file_registry
    bad = promote(store, TARGET, drafter_dir(tmp_path, 2), {"run_id": "r2"}, "candidate", SERVING)["version"]
    store.put_bytes(f"{layout.drafter_version_prefix(TARGET, bad)}/manifest.json", b'{"kind": "drafter", ')
    listed = drafter(store.root, "list")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    rows = {row["version"]: row for row in json.loads(listed.stdout)["versions"]}
    assert set(rows) == {good, bad}
    assert rows[good]["run_id"] == "r1" and "unreadable" not in rows[good]
    assert "is not valid JSON" in rows[bad]["unreadable"]
    status = drafter(store.root, "status")
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    assert f"{bad} unreadable: manifest " in status.stdout and "is not valid JSON" in status.stdout
    assert "2 version(s)" in status.stdout and good in status.stdout
    record(
        "bad input",
        "one version's manifest.json cut off, then `drafter list` and `drafter status`",
        "both exit 0: the other versions listed, this one shown unreadable with the reason",
    )
