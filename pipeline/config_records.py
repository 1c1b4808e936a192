"""The config a run's artifacts are made with, recorded beside them, and the refusal to continue them under
another one.

Stages reuse what a run id already made: a published snapshot, the finished shards of an interrupted one,
a published training. A rerun of the run id under a changed config would reuse them silently and mix two
configs in one run. So a stage records the config it makes something with before it writes the first of it
(the prompts, responses and captures of a snapshot: `<prefix>/run_config.json`; a training run:
runs/<run_id>/config.json), and every attempt compares its own config with that record before it writes or
reuses anything: the same config (a retry, a scheduler's retry, a resumed run) goes on as before; another one
is refused, naming the settings that differ. An attempt that failed before it made anything leaves no record,
so a corrected rerun is not held to it. A new run (a fresh run id) starts clean.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline import layout
from pipeline.config import ConfigError, RunConfig, load_config
from pipeline.credentials import without_credentials
from pipeline.storage import ObjectStore, PreconditionFailed

_CLIENTS = ("generate.sglang", "capture.sglang", "generate.vllm_server")
_PATIENCE = ("concurrency", "timeout_s", "retries", "deadline_s")

# Settings a run may change between attempts: none of them changes what a stage makes. A dotted path covers
# everything under it.
EXEMPT_SETTINGS: dict[str, str] = {
    "tracking": "where training curves are reported (TensorBoard uploads, MLflow), not what is trained",
    "plan": "`drafter plan`'s assumptions: no stage reads them",
    "storage": "where and how artifacts are stored, reached and cached (a store copied elsewhere continues)",
    **{
        f"train.{name}": "where the training nodes run and meet (the training fingerprint leaves it out "
        "too: pipeline.stages.train.PLACEMENT_SETTINGS)"
        for name in (
            "launcher",
            "rendezvous_endpoint",
            "rendezvous_port",
            "rendezvous_timeout_s",
            "kubernetes_job",
        )
    },
    **{
        f"{client}.{name}": "how many requests are in flight, how long they are waited for, how often retried"
        for client in _CLIENTS
        for name in _PATIENCE
    },
    **{f"{client}.urls": "where the servers are: the target they serve is target.*" for client in _CLIENTS},
    "capture.sglang.last_hidden_urls": "where the servers are: the target they serve is target.*",
}


class ConfigChanged(ConfigError):
    """A rerun of a run id under another config than the one its artifacts were made with."""


def exempt(path: str) -> bool:
    return any(path == setting or path.startswith(f"{setting}.") for setting in EXEMPT_SETTINGS)


_NOT_SET = object()


def _compared(value: Any) -> str:
    """A setting's value as compared and shown: JSON, with the credentials of any URL in it masked (which
    credentials reach a server does not change what it makes)."""
    return "(not set)" if value is _NOT_SET else without_credentials(json.dumps(value, sort_keys=True))


def _sections(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def differences(recorded: Any, current: Any, path: str = "") -> list[str]:
    """`dotted.path: recorded -> now` for every setting that differs, the exempt ones left out; sections in
    a list are compared by index (prompts.sources.0.kind)."""
    if path and exempt(path):
        return []
    if isinstance(recorded, dict) and isinstance(current, dict):
        return [
            line
            for key in sorted(recorded.keys() | current.keys())
            for line in differences(
                recorded.get(key, _NOT_SET), current.get(key, _NOT_SET), f"{path}.{key}" if path else str(key)
            )
        ]
    if _sections(recorded) and _sections(current) and len(recorded) == len(current):
        return [
            line
            for index, (before, after) in enumerate(zip(recorded, current, strict=True))
            for line in differences(before, after, f"{path}.{index}")
        ]
    before, after = _compared(recorded), _compared(current)
    if before == after:
        return []
    return [f"{path}: {_cut(before)} -> {_cut(after)}"]


def _cut(text: str) -> str:
    return text if len(text) <= 120 else f"{text[:117]}..."


def _as_loaded(recorded: dict[str, Any]) -> dict[str, Any]:
    """A recorded config with today's defaults filled in, so that a setting added since it was written does
    not count as a change; as written when it no longer loads (a setting since removed is a difference)."""
    try:
        return load_config(data=recorded).dump()
    except ConfigError:
        return recorded


def _recorded(store: ObjectStore, key: str) -> dict[str, Any] | None:
    if not store.exists(key):
        return None
    try:
        recorded = json.loads(store.get_bytes(key))
    except ValueError as err:
        raise ConfigChanged(
            f"the config record {store.uri(key)} is not JSON ({err}): restore it or start a new run"
        ) from err
    if not isinstance(recorded, dict):
        raise ConfigChanged(
            f"the config record {store.uri(key)} is not a config: restore it or start a new run"
        )
    return recorded


Record = tuple[str, str]  # (key of a config record, what it is the record of, as errors name it)


def artifact_record(store: ObjectStore, prefix: str, kind: str) -> Record:
    """The record of the prompts, responses or captures of a snapshot (`kind`) under `prefix`."""
    return layout.config_record_key(prefix), f"the {kind} {store.uri(prefix)}"


def run_record(run_id: str) -> Record:
    """The record of a training run: the run's config file, runs/<run_id>/config.json."""
    return layout.run_file_key(run_id, "config.json"), f"run {run_id}"


def require_same(store: ObjectStore, record: Record, config: RunConfig) -> bool:
    """Refuse (ConfigChanged) when `record` names another config than `config`; whether it exists."""
    key, what = record
    found = _recorded(store, key)
    if found is None:
        return False
    changed = differences(_as_loaded(found), config.dump())
    if changed:
        raise ConfigChanged(
            f"{what} was made with another config than this one (recorded in {store.uri(key)}); refusing "
            "to continue or reuse it under this one. The settings that differ (recorded -> now):\n  "
            + "\n  ".join(changed)
            + "\nRerun with the recorded config to continue it, or start a new run under a new run id (in "
            "Airflow, trigger a new DAG run)"
        )
    return True


def claim(store: ObjectStore, record: Record, config: RunConfig) -> None:
    """Before a stage makes or reuses what `record` is the record of: record `config` when nothing is
    recorded yet, else refuse another config than the recorded one (`require_same`)."""
    if require_same(store, record, config):
        return
    # credentials in URLs never reach the record (it is shown in reports); comparisons mask them too
    dump = without_credentials(json.dumps(config.dump(), indent=2))
    try:
        store.put_if(record[0], dump.encode(), None)
    except PreconditionFailed:  # another task of the run recorded it first (mapped shards start together)
        require_same(store, record, config)
