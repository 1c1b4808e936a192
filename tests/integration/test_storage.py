"""Storage and manifests, on both backends (a temp dir and moto's S3 server over HTTP)."""

import json
import os

import pytest

from pipeline.ids import InvalidIdError
from pipeline.manifest import (
    ManifestError,
    fetch_listed,
    manifest_exists,
    publish,
    read_listed,
    read_manifest,
)
from pipeline.storage import ObjectMissingError, StorageError


def test_bytes_roundtrip_ranges_listing_and_delete(store):
    info = store.put_bytes("a/b/data.bin", b"0123456789")
    assert info.bytes == 10 and len(info.sha256) == 64
    assert store.get_bytes("a/b/data.bin") == b"0123456789"
    assert store.get_bytes("a/b/data.bin", 2, 5) == b"234"
    assert store.get_bytes("a/b/data.bin", 7) == b"789"
    store.put_bytes("a/c.txt", b"x")
    assert store.list("a") == ["a/b/data.bin", "a/c.txt"]
    assert store.exists("a/c.txt")
    store.delete("a/c.txt")
    assert not store.exists("a/c.txt")
    with pytest.raises(ObjectMissingError):
        store.get_bytes("a/c.txt")


def test_large_file_upload_and_verified_download(store, tmp_path):
    # 12 MB crosses the 5 MB multipart threshold the S3 fixture sets
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(12 * 1024 * 1024))
    info = store.put_file("blobs/big.bin", source)
    dest = tmp_path / "copy.bin"
    store.get_file_verified("blobs/big.bin", dest, info.sha256)
    assert dest.read_bytes() == source.read_bytes()


def test_checksum_mismatch_leaves_destination_untouched(store, tmp_path):
    store.put_bytes("x/obj", b"real content")
    (tmp_path / "downloads").mkdir()
    dest = tmp_path / "downloads" / "obj"
    dest.write_bytes(b"previous copy")
    with pytest.raises(StorageError, match="checksum mismatch"):
        store.get_file_verified("x/obj", dest, "0" * 64)
    assert dest.read_bytes() == b"previous copy"
    assert [p.name for p in dest.parent.iterdir()] == ["obj"]


@pytest.mark.parametrize("key", ["../etc/passwd", "/abs", "a/../../b", "a//b", "a/", "", "a/.hidden/..x"])
def test_unsafe_keys_are_refused(store, key):
    with pytest.raises(InvalidIdError):
        store.put_bytes(key, b"x")


def test_uris_outside_the_root_are_refused(store):
    assert store.key_for(store.uri("prompts/s1")) == "prompts/s1"
    with pytest.raises(StorageError, match="outside"):
        store.key_for("s3://other-bucket/prompts/s1")
    with pytest.raises(StorageError, match="outside"):
        store.key_for("file:///etc/prompts")


def test_publish_writes_manifest_last_and_readers_trust_only_it(store):
    objects = [store.put_bytes("art/one.json", b'{"a": 1}'), store.put_bytes("art/two.json", b"[]")]
    store.put_bytes("art/stray.part", b"junk from a killed writer")
    assert not manifest_exists(store, "art")
    manifest = publish(store, "art", "example", objects, {"counts": {"n": 2}})
    again = read_manifest(store, "art", kind="example")
    assert again["objects"] == manifest["objects"]
    assert [o["name"] for o in again["objects"]] == ["one.json", "two.json"]
    assert json.loads(read_listed(store, "art", again, "one.json")) == {"a": 1}
    with pytest.raises(ManifestError, match="not listed"):
        read_listed(store, "art", again, "stray.part")
    with pytest.raises(ManifestError, match="expected 'other'"):
        read_manifest(store, "art", kind="other")


def test_corrupted_object_is_detected_on_read(store, tmp_path):
    manifest = publish(store, "art", "example", [store.put_bytes("art/one.bin", b"good")], {})
    store.put_bytes("art/one.bin", b"evil")  # rewritten behind the manifest's back
    with pytest.raises(StorageError, match="checksum mismatch"):
        read_listed(store, "art", manifest, "one.bin")
    with pytest.raises(StorageError, match="checksum mismatch"):
        fetch_listed(store, "art", manifest, "one.bin", tmp_path / "one.bin")
    assert not (tmp_path / "one.bin").exists()


def test_missing_manifest_is_a_clear_error(store):
    with pytest.raises(ManifestError, match="did not finish"):
        read_manifest(store, "nothing/here")


def test_conditional_writes_create_once_and_update_only_what_was_read(store):
    from pipeline.storage import PreconditionFailed

    assert store.read_with_tag("alias/x.json") is None
    first = store.put_if("alias/x.json", b"v1", None)
    with pytest.raises(PreconditionFailed):
        store.put_if("alias/x.json", b"v1 again", None)  # If-None-Match: the object exists
    data, tag = store.read_with_tag("alias/x.json")
    assert data == b"v1" and tag == first
    second = store.put_if("alias/x.json", b"v2", tag)
    with pytest.raises(PreconditionFailed):
        store.put_if("alias/x.json", b"stale", first)  # If-Match with the tag of an older read
    assert store.read_with_tag("alias/x.json") == (b"v2", second)
