"""S3 faults injected by a proxy on 127.0.0.1 in front of moto's server: throttling, connections
reset mid-upload and mid-download, and a stale read after a rewrite."""

from __future__ import annotations

import hashlib
import os
from collections import Counter

import pytest

from pipeline import layout
from pipeline.data.jsonl import decode_jsonl
from pipeline.manifest import read_listed, read_manifest
from pipeline.ops import registry
from pipeline.stages import run_stage
from pipeline.storage import StorageConfig, open_store
from tests.conftest import storage_config, tiny_config_dict
from tests.faults.plugin import proxied_storage
from tests.faults.proxy import Rule

pytestmark = pytest.mark.fault

SLOWDOWN = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def _prompt_ids(store, snapshot: str) -> list[str]:
    prefix = layout.prompts_prefix(snapshot)
    manifest = read_manifest(store, prefix, kind="prompts")
    return [
        r["id"]
        for shard in manifest["shards"]
        for r in decode_jsonl(read_listed(store, prefix, manifest, shard["name"]))
    ]


def _prompts_run(storage: dict) -> list[str]:
    from pipeline.config import RunConfig

    config = RunConfig.model_validate(tiny_config_dict(storage))
    store = open_store(config.storage)
    run_stage("prompts", config, "faults", store)
    return _prompt_ids(store, "faults")


@pytest.fixture(scope="module")
def clean_prompt_ids(tmp_path_factory, s3_endpoint):
    return _prompts_run(storage_config("s3", tmp_path_factory.mktemp("clean"), s3_endpoint))


def test_throttled_puts_are_retried_and_nothing_is_lost(s3_proxy, tmp_path, clean_prompt_ids, record):
    rule = s3_proxy.add(Rule("status", method="PUT", code=503, body=SLOWDOWN, times=4))
    ids = _prompts_run(proxied_storage(s3_proxy, tmp_path))
    assert rule.fired == 4
    assert sorted(ids) == sorted(clean_prompt_ids)
    duplicated = sum(n - 1 for n in Counter(ids).values())
    record(
        "S3",
        "503 SlowDown on 4 PUTs while the prompts stage writes its shards",
        f"retried with backoff; the same {len(ids)} sample ids as a clean run",
        tried=4,
        lost=len(set(clean_prompt_ids) - set(ids)),
        duplicated=duplicated,
    )


def test_throttled_reads_are_retried(s3_proxy, tmp_path, record):
    store = open_store(StorageConfig(**proxied_storage(s3_proxy, tmp_path)))
    info = store.put_bytes("blob/a.bin", os.urandom(4096))
    rule = s3_proxy.add(Rule("status", method="GET", path="blob/a.bin", code=503, body=SLOWDOWN, times=3))
    assert hashlib.sha256(store.get_verified("blob/a.bin", info.sha256)).hexdigest() == info.sha256
    assert rule.fired == 3
    record("S3", "503 SlowDown on 3 GETs of one object", "retried with backoff; bytes verified", tried=3)


def test_connection_reset_mid_multipart_upload(s3_proxy, tmp_path, record):
    store = open_store(StorageConfig(**proxied_storage(s3_proxy, tmp_path)))
    source = tmp_path / "shard.bin"
    source.write_bytes(os.urandom(12 * 2**20))  # 3 parts at the 5 MB threshold
    rule = s3_proxy.add(Rule("reset_request", method="PUT", path="partNumber=2", times=2))
    info = store.put_file("captures/t/s/train-00000.safetensors", source)
    assert rule.fired == 2
    back = tmp_path / "back.bin"
    store.get_file_verified("captures/t/s/train-00000.safetensors", back, info.sha256)
    assert back.read_bytes() == source.read_bytes()
    record(
        "S3",
        "connection reset twice while uploading part 2 of a 12 MB multipart upload",
        "the part was re-sent; the object's sha256 matches the source",
        tried=2,
    )


def test_connection_reset_mid_download(s3_proxy, tmp_path, record):
    store = open_store(StorageConfig(**proxied_storage(s3_proxy, tmp_path)))
    data = os.urandom(3 * 2**20)
    info = store.put_bytes("blob/b.bin", data)
    rule = s3_proxy.add(Rule("reset_response", method="GET", path="blob/b.bin", times=2))
    assert store.get_verified("blob/b.bin", info.sha256) == data  # get_object, body cut off twice
    assert rule.fired == 2
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(11 * 2**20))
    big_info = store.put_file("blob/c.bin", big)
    rule = s3_proxy.add(Rule("reset_response", method="GET", path="blob/c.bin", times=2))
    store.get_file_verified("blob/c.bin", tmp_path / "c.bin", big_info.sha256)  # ranged multipart download
    assert rule.fired == 2 and (tmp_path / "c.bin").read_bytes() == big.read_bytes()
    record(
        "S3",
        "connection reset mid-body on downloads (a 3 MB GET twice, an 11 MB ranged download twice)",
        "read again; bytes verified against the manifest sha256",
        tried=4,
    )


def test_stale_read_after_a_rewrite_is_read_again(s3_proxy, tmp_path, record):
    store = open_store(StorageConfig(**proxied_storage(s3_proxy, tmp_path)))
    store.put_bytes("runs/r/x.json", b'{"v": 1}')
    store.get_bytes("runs/r/x.json")  # the proxy now holds this as the stale copy
    s3_proxy.add(Rule("stale", method="GET", path="runs/r/x.json", times=2))
    new = store.put_bytes("runs/r/x.json", b'{"v": 2}')
    assert store.get_verified("runs/r/x.json", new.sha256) == b'{"v": 2}'
    record(
        "S3",
        "stale read (the old bytes, twice) after an object was rewritten",
        "the checksum from the manifest caught it; read again until fresh",
        tried=2,
    )


def test_stale_alias_read_cannot_lose_a_promotion(s3_proxy, tmp_path, record):
    from pipeline.ops.registry import AliasConflict

    storage = proxied_storage(s3_proxy, tmp_path)
    stale_view = open_store(StorageConfig(**storage))
    direct = open_store(
        StorageConfig(
            **{**storage, "endpoint_url": f"http://{s3_proxy.upstream_host}:{s3_proxy.upstream_port}"}
        )
    )
    for version in (
        "v1",
        "v2",
        "v3",
    ):  # three published versions (their manifests are what move_alias checks)
        direct.put_bytes(
            f"{layout.drafter_version_prefix('tiny', version)}/manifest.json",
            b'{"kind": "drafter", "schema_version": 1}',
        )
    registry.move_alias(direct, "tiny", "production", "v1", "first", expected=None)
    stale_view.read_with_tag(layout.alias_key("tiny", "production"))
    s3_proxy.add(Rule("stale", method="GET", path=layout.alias_key("tiny", "production"), times=5))
    registry.move_alias(direct, "tiny", "production", "v2", "promoted by another run", expected="v1")
    with pytest.raises(AliasConflict):
        registry.move_alias(stale_view, "tiny", "production", "v3", "promoted on a stale read", expected="v1")
    assert registry.read_alias(direct, "tiny", "production")["version"] == "v2"
    record(
        "S3",
        "stale read of the production alias while another promotion moved it",
        "the conditional write (If-Match on the stale ETag) was refused: AliasConflict, production "
        "kept the other promotion's version",
        tried=1,
    )
