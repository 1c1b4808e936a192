"""Bad input, second round (issue 55): what a hostile or careless user tried on the registry, the trigger
form, the checkpoints, the config readers and the S3 client, each replayed as it was tried. Nothing the tool
did not write is deleted, no alias write goes without its compare-and-swap, no secret in a URL is kept or
shown, and every refusal names its file and says what to do, with no traceback."""

from __future__ import annotations

import errno
import http.server
import json
import logging
import os
import threading
import uuid

import pytest
import yaml

from pipeline import layout
from pipeline.config import ConfigError, load_config
from pipeline.drafter.export import DrafterFormatError
from pipeline.drafter.servable import NoTargetConfig, given_target_config
from pipeline.failures import EXIT_BAD_INPUT, EXIT_FAILED
from pipeline.manifest import publish
from pipeline.ops import registry
from pipeline.ops.registry import (
    AliasConflict,
    RegistryError,
    list_versions,
    promote,
    pull,
    read_alias,
    rollback,
    verify_dir,
)
from pipeline.storage import FileStore, NoS3Credentials, S3Store, StorageError
from pipeline.training.checkpoint_digests import CheckpointRefused, DigestRecords, resume_point
from pipeline.user_files import MAX_JSON_DEPTH, MAX_USER_FILE_BYTES
from tests.builders import SERVING, drafter_dir
from tests.conftest import BUCKET, REPO, storage_config, tiny_config_dict

pytestmark = pytest.mark.fault

TARGET = "tgt"
DEEP = "[" * 200_000 + "]" * 200_000  # what the red team nested: far past Python's recursion limit


@pytest.fixture
def promoted(tmp_path):
    """A file store with one version of TARGET behind production: (store, version)."""
    store = FileStore(tmp_path / "store")
    version = promote(store, TARGET, drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)
    return store, version["version"]


def tree(directory):
    return {
        str(path.relative_to(directory)): (None if path.is_dir() else path.read_bytes())
        for path in sorted(directory.rglob("*"))
    }


# ---- 1. a pull removes only what pulls made ----------------------------------------------------------------


def test_a_pull_keeps_siblings_that_are_only_named_like_its_leftovers(promoted, tmp_path, record):
    store, version = promoted
    dest = tmp_path / "m"
    siblings = [tmp_path / ".m.pull-backup01", tmp_path / ".m.old-7", tmp_path / ".m.pull-4242-0a1b2c3d"]
    for sibling in siblings:
        sibling.mkdir()
        (sibling / "model.safetensors").write_bytes(os.urandom(4096))
        (sibling / "NOTES.md").write_text("a backup kept by hand\n")
    before = {sibling.name: tree(sibling) for sibling in siblings}
    pull(store, TARGET, "production", dest)
    assert {sibling.name: tree(sibling) for sibling in siblings} == before
    assert verify_dir(dest)["version"] == version
    record(
        "bad input",
        "`drafter pull --dest m` beside directories named like its leftovers (.m.pull-backup01/, .m.old-7/, "
        ".m.pull-<pid>-<hex>/), each holding files",
        "all three kept byte for byte: a pull removes only holders its marker says a pull made",
    )


# ---- 2. every alias write is compare-and-swap -------------------------------------------------------------


class RollbackAtFirstAliasWrite(FileStore):
    """A store on which a rollback runs the moment a promotion has made its first alias write."""

    def __init__(self, root, target):
        super().__init__(root)
        self.target, self.armed, self.rollback_said = target, False, None

    def put_if(self, key, data, expected_tag):
        tag = super().put_if(key, data, expected_tag)
        if self.armed and "/aliases/" in key:
            self.armed = False
            try:
                rollback(self, self.target)
                self.rollback_said = "rolled back"
            except RegistryError as err:
                self.rollback_said = str(err)
        return tag


def test_a_rollback_between_a_promotions_alias_writes_loses_no_version(tmp_path, record):
    store = RollbackAtFirstAliasWrite(tmp_path / "store", TARGET)
    a = promote(store, TARGET, drafter_dir(tmp_path, 1), {"run_id": "a"}, "production", SERVING)["version"]
    b = promote(store, TARGET, drafter_dir(tmp_path, 2), {"run_id": "b"}, "production", SERVING)["version"]
    assert (
        read_alias(store, TARGET, "production")["version"],
        read_alias(store, TARGET, "previous")["version"],
    ) == (
        b,
        a,
    )
    store.armed = True
    try:
        c = promote(store, TARGET, drafter_dir(tmp_path, 3), {"run_id": "c"}, "production", SERVING)[
            "version"
        ]
        promoted_c = True
    except AliasConflict:
        promoted_c = False
    production = read_alias(store, TARGET, "production")["version"]
    previous = read_alias(store, TARGET, "previous")["version"]
    if promoted_c:  # the promotion won: the rollback stood aside, and B is one rollback away
        assert (production, previous) == (c, b), store.rollback_said
    else:  # the rollback won: its aliases stand, and the promotion said it changed nothing
        assert (production, previous) == (a, b)
    record(
        "bad input",
        "a rollback run between a promotion's two alias writes (production=B, previous=A; promote C)",
        "no version dropped off the aliases: production=C, previous=B (the rollback refused: previous "
        "already moved), where the promotion wrote production first and previous unconditionally lost C",
    )


# ---- 3. verify refuses links ------------------------------------------------------------------------------


def test_verify_refuses_weights_that_are_a_link_out_of_the_directory(promoted, tmp_path, record):
    store, _ = promoted
    dest = pull(store, TARGET, "production", tmp_path / "served")
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(dest / "model.safetensors", outside)
    os.symlink(outside, dest / "model.safetensors")
    with pytest.raises(RegistryError, match="model.safetensors is a symbolic link") as refused:
        verify_dir(dest)
    assert str(outside) in str(refused.value)
    record(
        "bad input",
        "`drafter verify` of a directory whose model.safetensors is a symlink to a file outside it "
        "(same bytes)",
        "refused, naming the link and its target: what it points at could change after verification",
    )


# ---- 4. the trigger form cannot repoint the store; a checkpoint tag that is a link -------------------------


@pytest.mark.parametrize(
    "override",
    [
        "storage.root=s3://attacker-bucket/p",
        "storage.endpoint_url=http://10.0.0.9:9000",
        'storage={"root": "file:///tmp/other"}',
        'generate.sglang.urls=["http://169.254.169.254"]',
        'capture.sglang.urls=["http://10.0.0.9:30000"]',
    ],
)
def test_the_trigger_form_may_not_repoint_the_store_or_the_servers(override, record):
    from pipeline.tasks import param_overrides

    with pytest.raises(ConfigError, match="the store and servers the run's data goes to"):
        param_overrides({"overrides": [override]})
    record(
        "bad input",
        f"trigger form override `{override.split('=')[0]}=...` (the store checkpoint digests and the "
        "registry trust, or a server the prompts go to)",
        "refused before the run is planned, naming the setting",
    )


def test_a_checkpoint_tag_replaced_by_a_link_is_refused(tmp_path, record):
    store = FileStore(tmp_path / "store")
    records = DigestRecords(store, "r1", "attempt-0")
    ckpt = tmp_path / "checkpoints"
    elsewhere = tmp_path / "planted" / "step4"
    elsewhere.mkdir(parents=True)
    (elsewhere / "mp_rank_00_model_states.pt").write_bytes(b"planted")
    from pipeline.storage import sha256_file

    records.write(
        "step4", {"mp_rank_00_model_states.pt": sha256_file(elsewhere / "mp_rank_00_model_states.pt")}
    )
    ckpt.mkdir()
    (ckpt / "latest").write_text("step4")
    os.symlink(elsewhere, ckpt / "step4")
    with pytest.raises(CheckpointRefused, match="not a plain directory"):
        resume_point(ckpt, records)
    record(
        "bad input",
        "a checkpoint tag directory replaced by a symlink to files whose digests match the record",
        "CheckpointRefused naming the tag; nothing loaded",
    )


# ---- 5. the mounted-volume check works `..` out first ------------------------------------------------------


def test_a_path_that_climbs_out_of_a_mount_is_not_mounted(tmp_path, record):
    from pipeline.tasks import _require_mounted

    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["prompts"]["sources"] = [{"kind": "jsonl", "path": "/data/prompts/../../root/.aws/credentials"}]
    config = load_config(data=data)
    with pytest.raises(ConfigError, match="no task pod mounts"):
        _require_mounted(config, "run.yaml", ["/data/prompts", str(REPO)])
    data["prompts"]["sources"] = [{"kind": "jsonl", "path": "/data/prompts/./a/../b.jsonl"}]
    _require_mounted(load_config(data=data), "run.yaml", ["/data/prompts", str(REPO)])  # within it after all
    record(
        "bad input",
        "a prompt source /data/prompts/../../root/.aws/credentials with mounts [/data/prompts]",
        "ConfigError: not mounted (the path's `..` worked out before the comparison)",
    )


# ---- 6. tokens in a URL's query string ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "override",
    [
        'tracking.mlflow_uri="https://mlflow.example/?token=S3KR1T-9f2e"',
        'tracking.mlflow_uri="https://mlflow.example/#access_token=S3KR1T-9f2e"',
        'storage.endpoint_url="https://minio.example/?X-Amz-Security-Token=S3KR1T-9f2e"',
    ],
)
def test_a_token_in_a_urls_query_is_refused_and_never_shown(override, tmp_path, record):
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    with pytest.raises(ConfigError) as refused:
        load_config(data=data, overrides=[override])
    assert "must not hold credentials" in str(refused.value) and "S3KR1T" not in str(refused.value)
    assert not (tmp_path / "store").exists()  # nothing was written, run_config.json included
    record(
        "bad input",
        f"`{override.split('=')[0]}` with a token in its query or fragment",
        "ConfigError, the URL shown masked; nothing stored",
    )


def test_a_watch_url_with_a_token_is_refused_masked(tmp_path, record):
    from pipeline.ops.deployment import load_deployment
    from tests.conftest import REPO

    deployment = yaml.safe_load((REPO / "configs/deployment/kubernetes.yaml").read_text())
    deployment["watch"]["served_acceptance"]["replicas_url"] = "http://sglang:30000/metrics?token=S3KR1T-9f2e"
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(deployment))
    with pytest.raises(ConfigError) as refused:
        load_deployment(path)
    assert "must not hold credentials" in str(refused.value) and "S3KR1T" not in str(refused.value)
    record("bad input", "a watch URL with ?token= in the deployment config", "refused, the URL shown masked")


# ---- 7 and 9. bounded reads: size, devices, nesting --------------------------------------------------------


def cli(argv, capsys):
    """`drafter ARGV` in this process: (exit code, stderr), stderr as a fresh run's logging writes it (its
    handler, bound to this test's captured stderr, removed again afterwards)."""
    from pipeline.cli import main

    kept = list(logging.root.handlers)
    for handler in kept:
        logging.root.removeHandler(handler)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exited:  # argparse's refusal of an argument
        code = exited.code
    finally:
        for handler in list(logging.root.handlers):
            logging.root.removeHandler(handler)
        for handler in kept:
            logging.root.addHandler(handler)
    return code, capsys.readouterr().err


def test_a_config_that_is_a_device_or_too_large_is_refused_unread(tmp_path, capsys, record):
    large = tmp_path / "large.yaml"
    with open(large, "wb") as handle:
        handle.truncate(MAX_USER_FILE_BYTES + 1)
    for path, said in (("/dev/zero", "is not a regular file"), (str(large), "is larger than 16 MiB")):
        code, err = cli(["list", "--config", path], capsys)
        assert code == EXIT_BAD_INPUT and said in err and path in err and "Traceback" not in err, err
    record(
        "bad input",
        "`drafter list --config /dev/zero`, and a 16 MiB + 1 byte config",
        "exit 2 at once, naming the file: not a regular file / larger than 16 MiB (read without limit "
        "before)",
        tried=2,
    )


def deep_manifest(store, version):
    prefix = layout.drafter_version_prefix(TARGET, version)
    store.put_bytes(f"{prefix}/manifest.json", ('{"kind": "drafter", "objects": ' + DEEP + "}").encode())
    return store.uri(f"{prefix}/manifest.json")


def test_json_nested_200000_deep_is_refused_naming_its_file(promoted, tmp_path, capsys, record):
    store, version = promoted
    served = pull(store, TARGET, "production", tmp_path / "served")
    deep_version = "20261201-120000-0123456789-0a1b2c3d"
    where = deep_manifest(store, deep_version)
    rows = {row["version"]: row for row in list_versions(store, TARGET)}
    assert f"nests its JSON deeper than {MAX_JSON_DEPTH} levels" in rows[deep_version]["unreadable"]
    assert where in rows[deep_version]["unreadable"] and "unreadable" not in rows[version]
    argv = ["--config", "configs/local.yaml", f"storage.root={store.root}", f"target.name={TARGET}"]
    for command in ("list", "status"):
        code, err = cli([command, *argv], capsys)
        assert code == 0 and "Traceback" not in err, err
    store.put_bytes(layout.alias_key(TARGET, "candidate"), DEEP.encode())
    with pytest.raises(RegistryError, match="alias file .*candidate.json nests its JSON deeper"):
        read_alias(store, TARGET, "candidate")
    (served / "manifest.json").write_text(DEEP)
    with pytest.raises(RegistryError, match=f"manifest {served / 'manifest.json'} nests its JSON deeper"):
        verify_dir(served)
    target_config = tmp_path / "config.json"
    target_config.write_text(DEEP)
    with pytest.raises(NoTargetConfig, match=f"target config {target_config} nests its JSON deeper"):
        given_target_config(target_config)
    record(
        "bad input",
        "JSON nested 200,000 deep: a version manifest, an alias, a drafter directory's manifest, "
        "--target-config",
        "each refused naming its file (no bare RecursionError); `drafter list` and `status` list the others",
        tried=4,
    )


# ---- 8. a publish that fails leaves no folder behind -------------------------------------------------------


class FullDisk(FileStore):
    """A store whose disk fills up while the second file of a publish is written."""

    def __init__(self, root):
        super().__init__(root)
        self.files = 0

    def put_file(self, key, path):
        self.files += 1
        if self.files == 2:
            partial = self._path(key).with_name(".partial")
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.unlink(missing_ok=True)  # what atomic_write removes when the write fails
            raise OSError(errno.ENOSPC, "No space left on device", str(self._path(key)))
        return super().put_file(key, path)


def test_a_publish_on_a_full_disk_leaves_no_version_folder(tmp_path, record):
    store = FullDisk(tmp_path / "store")
    with pytest.raises(RegistryError, match="No space left on device") as failed:
        promote(store, TARGET, drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)
    assert "what it had uploaded was removed" in str(failed.value)
    versions = tmp_path / "store" / layout.registry_prefix(TARGET, "versions")
    assert not versions.exists() or list(versions.iterdir()) == []
    assert list_versions(store, TARGET) == [] and read_alias(store, TARGET, "production") is None
    record(
        "bad input",
        "a publish whose disk fills while its second file is written",
        "RegistryError saying so; the objects it had written removed, no version folder without a manifest",
    )


# ---- 10. S3 errors on one line -----------------------------------------------------------------------------


class NotS3(http.server.BaseHTTPRequestHandler):
    """An HTTP server that is not S3: 404 for everything (a storage.endpoint_url with the wrong port)."""

    def do_GET(self):  # noqa: N802 (http.server's names)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_PUT = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


def test_s3_errors_are_one_line_naming_the_bucket_and_what_to_do(s3_endpoint, monkeypatch, record):
    import boto3

    missing = S3Store(f"no-such-bucket-{uuid.uuid4().hex[:8]}", "p", s3_endpoint, max_attempts=1)
    with pytest.raises(StorageError, match="does not exist there: create it, or correct storage.root"):
        missing.list("drafters")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wrong = S3Store(BUCKET, "p", f"http://127.0.0.1:{server.server_port}", max_attempts=1)
        with pytest.raises(StorageError, match="answered 404 Not Found for the bucket"):
            wrong.list("drafters")
    finally:
        server.shutdown()
        server.server_close()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # it would keep the keys it found before
    with pytest.raises(NoS3Credentials, match="no S3 credentials for s3://"):
        S3Store(BUCKET, "p", s3_endpoint, max_attempts=1).list("drafters")
    record(
        "S3",
        "NoSuchBucket, an endpoint that answers 404 (not S3), no credentials at all",
        "a StorageError each, one line naming the bucket and endpoint and what to do (botocore's traceback "
        "before)",
        tried=3,
    )


# ---- 11. a safetensors header that claims 10 GB ------------------------------------------------------------


def test_weights_whose_header_claims_10_gb_are_refused_unread(promoted, tmp_path, record):
    store, _ = promoted
    served = pull(store, TARGET, "production", tmp_path / "served")
    weights = served / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes((10 * 10**9).to_bytes(8, "little") + original[8:])
    with pytest.raises(DrafterFormatError, match="a header of 10,000,000,000 bytes"):
        registry.read_drafter_dir(served)
    bad = tmp_path / "bad"
    bad.mkdir()
    for path in served.iterdir():
        if not path.name.startswith("."):
            (bad / path.name).write_bytes(path.read_bytes())
    version = "20261201-120000-badbadbad0-0a1b2c3d"
    prefix = layout.drafter_version_prefix(TARGET, version)
    manifest = json.loads((served / "manifest.json").read_text())
    objects = [
        store.put_file(f"{prefix}/{entry['name']}", bad / entry["name"]) for entry in manifest["objects"]
    ]
    publish(store, prefix, "drafter", objects, {"target": TARGET, "version": version, "serving": SERVING})
    with pytest.raises(registry.RegistryInputError, match="not a safetensors file"):
        pull(store, TARGET, version, tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()
    record(
        "bad input",
        "a model.safetensors whose header length claims 10 GB, verified and pulled",
        "DrafterFormatError naming the file, before safetensors reads it; the pull refused as bad input",
        tried=2,
    )


# ---- 12. exit codes and bounds -----------------------------------------------------------------------------


def test_an_engine_that_cannot_serve_the_drafter_is_bad_input(tmp_path, capsys, record):
    from pipeline.drafter.export import export_drafter
    from pipeline.engines.tiny_target import KIMI_ROPE_PARAMETERS
    from tests.builders import AUX, SMALL_MLA, kimi_like_target, small_mla_drafter

    yarn = {key: value for key, value in KIMI_ROPE_PARAMETERS.items() if key != "rope_theta"}

    contract = {
        "aux_layer_ids": AUX,
        "hidden_size": 16,
        "num_layers": 6,
        "target": {"model_family": "deepseek"},
    }
    target = kimi_like_target(tmp_path / "target", **SMALL_MLA, num_attention_heads=2)
    exported = export_drafter(
        small_mla_drafter(rope_scaling=yarn), contract, tmp_path / "drafter", "float32", target
    )
    store = FileStore(tmp_path / "store")
    promote(store, TARGET, exported, {"run_id": "mla"}, "production", SERVING)
    served = pull(store, TARGET, "production", tmp_path / "served")
    code, err = cli(["verify", str(served), "--engine", "vllm"], capsys)
    assert code == EXIT_BAD_INPUT and "eagle3-mla drafter" in err and "Traceback" not in err, err
    record(
        "bad input", "`drafter verify --engine vllm` of an MLA drafter vLLM cannot load", "exit 2 (1 before)"
    )


@pytest.mark.parametrize("samples", ["1e20", "100000000000000000000", "0", "-5"])
def test_plan_takes_a_bounded_number_of_samples(samples, capsys, record):
    code, err = cli(["plan", "--config", "configs/local.yaml", "--samples", samples], capsys)
    assert code == EXIT_BAD_INPUT and "--samples" in err and "Traceback" not in err, err
    record(
        "bad input", f"`drafter plan --samples {samples}`", "exit 2 naming --samples (a whole number 1-1e9)"
    )


def test_a_defect_is_one_line_not_a_traceback(monkeypatch, capsys):
    import pipeline.cli

    def broken(args):
        raise KeyError("a defect")

    monkeypatch.setattr(pipeline.cli, "dispatch", broken)
    code, err = cli(["list", "--config", "configs/local.yaml"], capsys)
    assert code == EXIT_FAILED and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "a defect in this tool (KeyError: 'a defect'); rerun with --verbose" in err
    code, err = cli(["--verbose", "list", "--config", "configs/local.yaml"], capsys)
    assert "Traceback" in err  # asked for


# ---- every command, every kind of bad file ---------------------------------------------------------------

# The kinds of bad file a user hands in, as (name, how to make it at a path); None: the path is left missing.
BAD_FILES = {
    "missing": None,
    "a directory": lambda path: path.mkdir(),
    "/dev/zero": lambda path: os.symlink("/dev/zero", path),
    "16 MiB + 1 byte": lambda path: open(path, "wb").truncate(MAX_USER_FILE_BYTES + 1),
    "binary": lambda path: path.write_bytes(b"\xff\xfe\x00\x01" * 256),
    "nested 5,000 deep": lambda path: path.write_text("[" * 5000 + "]" * 5000),
    "empty": lambda path: path.write_bytes(b""),
    "a list, not a mapping": lambda path: path.write_text('["a", "b"]'),
}


def argv_with_bad_file(command: str, bad, tmp_path):
    """`drafter COMMAND` with `bad` where it takes the file a user hands in first: --config for most; the
    drafter directory's manifest.json for verify, --deployment for watches, --spec for train-worker."""
    extra = {
        "pull": ["--dest", str(tmp_path / "dest")],
        "plan": ["--samples", "10"],
        "capture-rank": ["--responses", "file:///nowhere"],
    }
    if command == "verify":
        directory = tmp_path / "drafter"
        directory.mkdir()
        os.replace(bad, directory / "manifest.json") if os.path.lexists(bad) else None
        return ["verify", str(directory)], str(directory / "manifest.json")
    if command == "watches":
        return ["watches", "--deployment", str(bad)], str(bad)
    if command == "train-worker":
        return ["train-worker", "--spec", str(bad)], str(bad)
    return [command, "--config", str(bad), *extra.get(command, [])], str(bad)


def commands():
    from pipeline.cli import build_parser

    parser = build_parser()
    sub = next(action for action in parser._actions if action.dest == "command")
    return sorted(sub.choices)


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_every_command_refuses_every_kind_of_bad_file_in_one_line(kind, tmp_path, capsys, record):
    """Every `drafter` subcommand (read from the CLI's own parser, so a new one is covered), handed each kind
    of bad file: exit 2, an error whose first line names the file, no traceback."""
    names = commands()
    assert {"run", "pull", "verify", "plan", "list", "status", "watches", "train-worker"} <= set(names)
    for command in names:
        case = tmp_path / command
        case.mkdir()
        bad = case / "bad.yaml"
        if BAD_FILES[kind] is not None:
            BAD_FILES[kind](bad)
        argv, named = argv_with_bad_file(command, bad, case)
        code, err = cli(argv, capsys)
        lines = err.strip().splitlines()
        assert code == EXIT_BAD_INPUT, (command, kind, err)
        assert lines and "Traceback" not in err, (command, kind, err)
        # named as given, or as the link resolves; the problems of a config's fields follow, one a line
        assert named in lines[0] or os.path.realpath(named) in lines[0], (command, kind, err)
    record(
        "bad input",
        f"every `drafter` command ({len(names)}) handed a file that is {kind}",
        "exit 2 from each, its first line naming the file, no traceback",
        tried=len(names),
    )
