"""Artifact manifests: data objects first, manifest.json last; readers trust only what it lists."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from pipeline.ids import validate_key
from pipeline.storage import ObjectInfo, ObjectMissingError, ObjectStore, StorageError
from pipeline.user_files import parse_json

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1


class ManifestError(StorageError):
    """A manifest that is missing, malformed or of the wrong kind."""


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def code_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("drafter-pipeline")
    except PackageNotFoundError:
        return "unknown"


def object_entry(prefix: str, info: ObjectInfo) -> dict[str, Any]:
    if not info.key.startswith(prefix + "/"):
        raise ManifestError(f"object {info.key} is not under the artifact prefix {prefix}")
    return {"name": info.key[len(prefix) + 1 :], "bytes": info.bytes, "sha256": info.sha256}


def publish(
    store: ObjectStore,
    prefix: str,
    kind: str,
    objects: list[ObjectInfo],
    fields: dict[str, Any],
    exclusive: bool = False,
) -> dict[str, Any]:
    """Write the manifest of already-uploaded objects under prefix; returns the manifest.

    exclusive: the manifest must not exist yet (immutable artifacts); a concurrent publisher that got
    there first makes this raise PreconditionFailed.
    """
    validate_key(prefix)
    manifest = {
        "kind": kind,
        "schema_version": SCHEMA_VERSION,
        "created_at": now_iso(),
        "code_version": code_version(),
        "uri": store.uri(prefix),
        **fields,
        "objects": [object_entry(prefix, info) for info in objects],
    }
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    if exclusive:
        store.put_if(f"{prefix}/{MANIFEST_NAME}", data, None)
    else:
        store.put_bytes(f"{prefix}/{MANIFEST_NAME}", data)
    return manifest


def read_manifest(store: ObjectStore, prefix: str, kind: str | None = None) -> dict[str, Any]:
    key = f"{validate_key(prefix)}/{MANIFEST_NAME}"
    try:
        raw = store.get_bytes(key)
    except ObjectMissingError as err:
        raise ManifestError(
            f"no manifest at {store.uri(key)}: the artifact does not exist or its stage did not finish"
        ) from err
    manifest = parse_json(raw, f"manifest {store.uri(key)}", ManifestError)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("objects"), list):
        raise ManifestError(f"manifest {store.uri(key)} has no object list")
    if kind is not None and manifest.get("kind") != kind:
        raise ManifestError(f"{store.uri(key)} is a {manifest.get('kind')!r} manifest, expected {kind!r}")
    for entry in manifest["objects"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ManifestError(f"manifest {store.uri(key)} lists an object without a name: {entry!r:.200}")
        validate_key(entry["name"])
    return manifest


def manifest_exists(store: ObjectStore, prefix: str) -> bool:
    return store.exists(f"{validate_key(prefix)}/{MANIFEST_NAME}")


def listed_object(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    for entry in manifest["objects"]:
        if entry["name"] == name:
            return entry
    raise ManifestError(f"{name} is not listed in the manifest at {manifest.get('uri')}")


def listed_shard(
    store: ObjectStore, uri: str, kind: str, name: str
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(prefix, manifest, shard entry) of shard `name` of the published `kind` artifact at `uri`
    (a scheduler maps one task per shard)."""
    prefix = store.key_for(uri)
    manifest = read_manifest(store, prefix, kind=kind)
    for shard in manifest["shards"]:
        if shard["name"] == name:
            return prefix, manifest, shard
    raise ManifestError(f"{manifest.get('uri')} has no shard {name!r}")


def read_listed(store: ObjectStore, prefix: str, manifest: dict[str, Any], name: str) -> bytes:
    entry = listed_object(manifest, name)
    return store.get_verified(f"{prefix}/{entry['name']}", entry["sha256"])


def fetch_listed(
    store: ObjectStore, prefix: str, manifest: dict[str, Any], name: str, dest: str | Path
) -> Path:
    entry = listed_object(manifest, name)
    store.get_file_verified(f"{prefix}/{entry['name']}", dest, entry["sha256"])
    return Path(dest)
