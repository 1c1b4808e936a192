"""Drafter registry in the object store: immutable versions, aliases that point at them, verified pull.

drafters/<target>/versions/<version>/   config.json, model.safetensors, capture_contract.json,
                                        target_config.json (the target's config.json, recorded at export),
                                        README.md, manifest.json (lineage + sha256 of every file)
drafters/<target>/aliases/<alias>.json  {"version": ...}
drafters/<target>/history/<time>-<alias>.json   one record per alias move (append-only)
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pipeline import layout
from pipeline.config import TargetConfig
from pipeline.drafter.export import CONFIG_NAME, DRAFTER_FILES, WEIGHTS_NAME, read_drafter_dir
from pipeline.drafter.servable import require_servable
from pipeline.ids import validate_id
from pipeline.manifest import MANIFEST_NAME, manifest_exists, now_iso, publish, read_manifest
from pipeline.storage import ObjectStore, PreconditionFailed, StorageError, atomic_write, sha256_file

log = logging.getLogger(__name__)
README_NAME = "README.md"
SHOWN_ALIASES = ("production", "previous", "candidate")  # what `drafter list` and `drafter status` show


class RegistryError(RuntimeError):
    pass


def sglang_flags(drafter_path: str, steps: int, topk: int = 1, draft_tokens: int | None = None) -> list[str]:
    draft_tokens = draft_tokens or (steps + 1 if topk == 1 else steps * topk)
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        drafter_path,
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
    ]


def serving_flags(drafter_path: str, serving: dict[str, int]) -> list[str]:
    """SGLang flags for a version's benchmarked setting ({"steps", "topk", "draft_tokens"})."""
    return sglang_flags(drafter_path, serving["steps"], serving.get("topk", 1), serving.get("draft_tokens"))


def target_flags(target: TargetConfig) -> list[str]:
    """What SGLang needs to serve the target itself: its tensor parallelism, and --trust-remote-code for a
    target that ships its own code (Kimi-K2.5). No --context-length: the drafter has the target's context."""
    flags = ["--tp", str(target.tensor_parallel)]
    if target.trust_remote_code:
        flags.append("--trust-remote-code")
    return flags


def server_flags(target: TargetConfig, drafter_path: str, serving: dict[str, int]) -> list[str]:
    """Every flag after --model-path that serves the target with a version's drafter at its benchmarked
    setting: the target's own, then the speculative ones."""
    return [*target_flags(target), *serving_flags(drafter_path, serving)]


def launch_command(target: TargetConfig, drafter_path: str, serving: dict[str, int]) -> list[str]:
    """The whole SGLang command that serves the target with a version's drafter."""
    model_path = target.model_path or f"<{target.name} model directory>"
    return [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        *server_flags(target, drafter_path, serving),
    ]


def write_serving_flags(path: str | Path, flags: list[str]) -> None:
    """The flags as one shell-quoted line, replaced atomically (a server reading it sees all or nothing)."""
    import shlex

    with atomic_write(path) as partial:
        partial.write_text(shlex.join(flags) + "\n")


def model_card(target: str, version: str, lineage: dict[str, Any], flags: list[str]) -> str:
    evaluation = lineage.get("eval", {})
    bench = lineage.get("bench", {})
    lines = [
        f"# EAGLE-3 drafter for `{target}`, version `{version}`",
        "",
        "Load with SGLang (the target's own embedding is shared with the drafter):",
        "",
        "```",
        "python -m sglang.launch_server --model-path <target> " + " ".join(flags),
        "```",
        "",
        "## Metrics (held-out captures of the target's own outputs)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| cond_acc by step | {evaluation.get('cond_acc')} |",
        f"| simulated acceptance length | {evaluation.get('tau_simulated')} |",
        f"| measured acceptance length | {bench.get('tau_measured')} |",
        f"| baseline tok/s | {bench.get('baseline_tok_s')} |",
        f"| drafter tok/s | {bench.get('drafter_tok_s')} |",
        f"| benchmark engine | {bench.get('engine')} |",
        "",
        "## Capture contract",
        "",
        "```json",
        json.dumps(lineage.get("contract", {}), indent=2),
        "```",
        "",
        "## Lineage",
        "",
        f"- run: `{lineage.get('run_id')}`",
        f"- dataset: `{lineage.get('dataset')}`",
        f"- code version: `{lineage.get('code_version')}`",
        "",
    ]
    return "\n".join(lines)


def _version_id(weights_sha: str) -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S") + f"-{weights_sha[:10]}"


class AliasConflict(RegistryError):
    """Another promotion or rollback moved the alias first; nothing was changed by this one."""


ANY_VERSION = object()  # move_alias without an expectation about the alias's current version


def read_alias(store: ObjectStore, target: str, alias: str) -> dict[str, Any] | None:
    found = store.read_with_tag(layout.alias_key(target, alias))
    return json.loads(found[0]) if found else None


def _record_history(store: ObjectStore, target: str, alias: str, record: dict[str, Any]) -> None:
    """Append-only: every move gets its own new object (a conditional create never overwrites)."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    key = layout.alias_history_key(target, stamp, alias, record["version"])
    store.put_if(key, json.dumps(record).encode(), None)


def move_alias(
    store: ObjectStore, target: str, alias: str, version: str, reason: str, expected: Any = ANY_VERSION
) -> dict[str, Any]:
    """Point `alias` at `version` with one conditional write.

    `expected` is the version the caller based its decision on (None: the alias must not exist yet).
    If the alias is not there any more, or another writer moves it between our read and our write,
    AliasConflict is raised and the alias keeps the other writer's value: it is never torn.
    """
    validate_id(alias, "alias")
    if not manifest_exists(store, layout.drafter_version_prefix(target, version)):
        raise RegistryError(f"cannot point {alias} at {version}: no such version of {target}")
    key = layout.alias_key(target, alias)
    found = store.read_with_tag(key)
    current = json.loads(found[0])["version"] if found else None
    if expected is not ANY_VERSION and current != expected:
        raise AliasConflict(
            f"{target} {alias} is at {current}, not {expected}: another promotion or rollback "
            "moved it first; nothing changed"
        )
    record = {
        "alias": alias,
        "version": version,
        "previous_version": current,
        "updated_at": now_iso(),
        "reason": reason,
    }
    try:
        store.put_if(key, json.dumps(record, indent=2).encode(), found[1] if found else None)
    except PreconditionFailed as err:
        raise AliasConflict(
            f"{target} {alias} was moved by a concurrent promotion or rollback while this one "
            "was writing; nothing changed"
        ) from err
    _record_history(store, target, alias, record)
    return record


def earlier_attempt(
    store: ObjectStore, target: str, weights_sha: str, run_id: Any
) -> tuple[str, dict] | None:
    """A version an earlier, interrupted attempt of this same promotion published (same run, same
    weights), so that a rerun reuses it instead of listing a second copy."""
    prefix = layout.registry_prefix(target, "versions")
    depth = len(prefix.split("/"))
    candidates = sorted(
        {
            key.split("/")[depth]
            for key in store.list(prefix)
            if key.split("/")[depth].endswith(f"-{weights_sha[:10]}")
        }
    )
    for version in candidates:
        version_prefix = layout.drafter_version_prefix(target, version)
        if not manifest_exists(store, version_prefix):
            continue
        manifest = read_manifest(store, version_prefix, kind="drafter")
        weights: dict[str, Any] = next((o for o in manifest["objects"] if o["name"] == WEIGHTS_NAME), {})
        if weights.get("sha256") == weights_sha and manifest["lineage"].get("run_id") == run_id:
            return version, manifest
    return None


def publish_version(
    store: ObjectStore, target: str, drafter_dir: Path, lineage: dict[str, Any], serving: dict[str, int]
) -> tuple[str, dict[str, Any]]:
    """Upload a validated drafter directory as a new immutable version; returns (version, manifest).
    A version an interrupted attempt of the same promotion already published is reused. A drafter the
    target's SGLang server would refuse with these flags (checked against the target config recorded at
    export) is not published."""
    read_drafter_dir(drafter_dir)
    require_servable(drafter_dir, serving=serving)
    weights_sha = sha256_file(drafter_dir / WEIGHTS_NAME)
    if lineage.get("run_id") is not None:
        earlier = earlier_attempt(store, target, weights_sha, lineage["run_id"])
        if earlier is not None:
            log.info(
                "reusing version %s, published by an earlier attempt of run %s", earlier[0], lineage["run_id"]
            )
            return earlier
    version = _version_id(weights_sha)
    prefix = layout.drafter_version_prefix(target, version)
    if manifest_exists(store, prefix):
        raise RegistryError(f"version {version} of {target} already exists; versions are immutable")
    flags = serving_flags("<drafter-dir>", serving)
    objects = [store.put_file(f"{prefix}/{name}", drafter_dir / name) for name in DRAFTER_FILES]
    objects.append(
        store.put_bytes(f"{prefix}/{README_NAME}", model_card(target, version, lineage, flags).encode())
    )
    try:
        manifest = publish(
            store,
            prefix,
            "drafter",
            objects,
            {
                "target": target,
                "version": version,
                "lineage": lineage,
                "sglang_flags": flags,
                "serving": serving,
            },
            exclusive=True,
        )
    except PreconditionFailed as err:
        raise RegistryError(
            f"version {version} of {target} was published concurrently; versions are immutable"
        ) from err
    return version, manifest


def promote(
    store: ObjectStore,
    target: str,
    drafter_dir: Path,
    lineage: dict[str, Any],
    alias: str,
    serving: dict[str, int],
) -> dict[str, Any]:
    """Publish a version and move `alias` to it; the old target of `production` becomes `previous`.

    The alias moves only if it still points where it pointed when this promotion started; a racing
    promotion that got there first makes this one fail with AliasConflict (its version stays published,
    unaliased).
    """
    before = read_alias(store, target, alias)
    before_version = before["version"] if before else None
    version, manifest = publish_version(store, target, drafter_dir, lineage, serving)
    if before_version == version:  # an earlier attempt of this promotion moved the alias already
        return {
            "version": version,
            "alias": before,
            "uri": store.uri(layout.drafter_version_prefix(target, version)),
            "manifest": manifest,
        }
    record = move_alias(
        store,
        target,
        alias,
        version,
        reason=f"promoted from run {lineage.get('run_id')}",
        expected=before_version,
    )
    if alias == "production" and before_version is not None:
        move_alias(store, target, "previous", before_version, reason=f"demoted by {version}")
    return {
        "version": version,
        "alias": record,
        "uri": store.uri(layout.drafter_version_prefix(target, version)),
        "manifest": manifest,
    }


def rollback(store: ObjectStore, target: str) -> dict[str, Any]:
    """production -> previous; the rolled-back version becomes `previous`."""
    production, previous = read_alias(store, target, "production"), read_alias(store, target, "previous")
    if production is None or previous is None:
        raise RegistryError(f"{target} needs both a production and a previous alias to roll back")
    record = move_alias(
        store, target, "production", previous["version"], reason="rollback", expected=production["version"]
    )
    move_alias(store, target, "previous", production["version"], reason="rolled back")
    return record


def list_versions(store: ObjectStore, target: str) -> list[dict[str, Any]]:
    prefix = layout.registry_prefix(target, "versions")
    versions = sorted({key.split("/")[len(prefix.split("/"))] for key in store.list(prefix)})
    rows = []
    for version in versions:
        version_prefix = layout.drafter_version_prefix(target, version)
        if manifest_exists(store, version_prefix):
            manifest = read_manifest(store, version_prefix, kind="drafter")
            rows.append(
                {
                    "version": version,
                    "created_at": manifest["created_at"],
                    "run_id": manifest["lineage"].get("run_id"),
                    "tau_simulated": manifest["lineage"].get("eval", {}).get("tau_simulated"),
                }
            )
    return rows


def resolve(store: ObjectStore, target: str, alias_or_version: str) -> str:
    record = read_alias(store, target, alias_or_version)
    if record is not None:
        return record["version"]
    if manifest_exists(store, layout.drafter_version_prefix(target, alias_or_version)):
        return alias_or_version
    raise RegistryError(f"{target} has no alias or version named {alias_or_version!r}")


def verify_dir(directory: str | Path, target_config: str | Path | None = None) -> dict[str, Any]:
    """Check every file listed by the directory's manifest.json against its sha256 and size, the drafter's
    format, and that the target's SGLang server would serve it with the version's flags: checked against
    target_config (a model directory or its config.json) when given, else the target config recorded at
    export (DraftModelRefused names SGLang's reasons)."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RegistryError(f"{directory} has no readable {MANIFEST_NAME}: {err}") from err
    problems = []
    for entry in manifest.get("objects", []):
        path = directory / validate_id(entry["name"], "file name")
        if not path.is_file():
            problems.append(f"missing {entry['name']}")
        elif path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            problems.append(f"checksum mismatch for {entry['name']}")
    if problems:
        raise RegistryError(f"drafter directory {directory} failed verification: " + "; ".join(problems))
    read_drafter_dir(directory)
    require_servable(directory, target_config, manifest.get("serving"))
    return manifest


def pull(
    store: ObjectStore,
    target: str,
    alias_or_version: str,
    dest: str | Path,
    target_config: str | Path | None = None,
) -> Path:
    """Download a version to dest atomically; on any mismatch, or a drafter the target's SGLang server would
    refuse (verify_dir; target_config as there), dest is left as it was."""
    version = resolve(store, target, alias_or_version)
    prefix = layout.drafter_version_prefix(target, version)
    manifest = read_manifest(store, prefix, kind="drafter")
    dest = Path(dest).resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.pull-"))
    try:
        for entry in manifest["objects"]:
            store.get_file_verified(f"{prefix}/{entry['name']}", staging / entry["name"], entry["sha256"])
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        verify_dir(staging, target_config)
        _swap_into_place(staging, dest)
    except (StorageError, RegistryError, ValueError) as err:
        raise RegistryError(
            f"pull of {target}:{alias_or_version} ({version}) refused, {dest} unchanged: {err}"
        ) from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("pulled %s version %s into %s", target, version, dest)
    return dest


def pull_incumbent(
    store: ObjectStore, target: str, alias: str, workdir: Path, target_config: str | Path | None = None
) -> tuple[str, Path] | None:
    """The drafter currently behind `alias` (what a candidate must beat), or None if there is none; checked
    against target_config as `pull` does."""
    record = read_alias(store, target, alias)
    if record is None:
        return None
    return record["version"], pull(
        store, target, record["version"], workdir / "incumbent_drafter", target_config
    )


def _swap_into_place(staging: Path, dest: Path) -> None:
    if not dest.exists():
        os.replace(staging, dest)
        return
    if not dest.is_dir() or (not (dest / CONFIG_NAME).exists() and any(dest.iterdir())):
        raise RegistryError(f"{dest} exists and is not a drafter directory; refusing to replace it")
    retired = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    os.replace(dest, retired)
    os.replace(staging, dest)
    shutil.rmtree(retired, ignore_errors=True)
