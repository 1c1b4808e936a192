"""Object-store layout (DESIGN.md): every key the pipeline reads or writes is built here.

    prompts/<snapshot>/                     prompt shards
    responses/<target>/<snapshot>/          the target's own answers
    captures/<target>/<snapshot>/           hidden-state shards
    datasets/<target>/<dataset>/            a dataset's manifest
    runs/<run_id>/<stage>/                  what a run-scoped stage published (RUN_STAGES)
    runs/<run_id>/train/checkpoints/        the digests of every checkpoint training committed
    runs/<run_id>/<file>                    the run's config and summary (RUN_FILES)
    drafters/<target>/versions/<version>/   the registry's immutable versions
    drafters/<target>/aliases/<alias>.json  what an alias points at
    drafters/<target>/history/              every move of an alias
    watches/<target>/<watch>.json           what a retraining watch has fired on (pipeline.ops.watch)

Every id that becomes a key component is validated (pipeline.ids).
"""

from __future__ import annotations

from typing import Literal

from pipeline.ids import validate_id

RunStage = Literal["train", "eval", "gate", "bench", "promote", "report"]
RunFile = Literal["config.json", "summary.json", "trigger.json"]
TargetData = Literal["responses", "captures", "datasets"]
RegistryPart = Literal["versions", "aliases", "history"]
WatchName = Literal["served_acceptance", "target_revision"]


def prompts_prefix(snapshot: str) -> str:
    return f"prompts/{validate_id(snapshot, 'snapshot')}"


def target_data_prefix(kind: TargetData, target: str, name: str | None = None) -> str:
    """responses/, captures/ or datasets/ of a target; with `name`, one snapshot or dataset of them."""
    prefix = f"{kind}/{validate_id(target, 'target')}"
    return prefix if name is None else f"{prefix}/{validate_id(name, 'snapshot')}"


def responses_prefix(target: str, snapshot: str) -> str:
    """Regenerated conversations (the target's own answers), input of capture."""
    return target_data_prefix("responses", target, snapshot)


def captures_prefix(target: str, snapshot: str) -> str:
    return target_data_prefix("captures", target, snapshot)


def dataset_prefix(target: str, dataset: str) -> str:
    return target_data_prefix("datasets", target, dataset)


RUNS = "runs"


def run_prefix(run_id: str) -> str:
    return f"{RUNS}/{validate_id(run_id, 'run id')}"


def published_run_ids(keys: list[str], stage: RunStage) -> set[str]:
    """The run ids among `keys` (a listing of RUNS) whose `stage` published its manifest."""
    return {
        key.split("/")[1]
        for key in keys
        if key.startswith(f"{RUNS}/") and key.endswith(f"/{stage}/manifest.json")
    }


def run_stage_prefix(run_id: str, stage: RunStage) -> str:
    """What a run-scoped stage published: train (drafter, metrics, result), eval, gate, bench, promote,
    report."""
    return f"{run_prefix(run_id)}/{stage}"


def run_file_key(run_id: str, name: RunFile) -> str:
    """The run's resolved config (recorded by train: pipeline.config_records), `drafter run`'s summary, or
    what started the run (pipeline.tasks.record_trigger)."""
    return f"{run_prefix(run_id)}/{name}"


def config_record_key(prefix: str) -> str:
    """The config the prompts, responses or captures under `prefix` are made with (pipeline.config_records;
    a training run's is its run file config.json)."""
    return f"{prefix}/run_config.json"


def train_worker_spec_key(run_id: str) -> str:
    """What every training node reads first: no filesystem is shared for it."""
    return f"{run_stage_prefix(run_id, 'train')}/worker_spec.json"


def checkpoint_digests_key(run_id: str, attempt: str, tag: str) -> str:
    """The sha256 of every file of checkpoint `tag` of a training attempt (its work dir's name), recorded
    when the run committed it: what a resume checks the shared checkpoint volume against."""
    attempt_id, tag_id = validate_id(attempt, "training attempt"), validate_id(tag, "checkpoint tag")
    return f"{run_stage_prefix(run_id, 'train')}/checkpoints/{attempt_id}/{tag_id}.json"


def shard_marker_key(prefix: str, shard_name: str) -> str:
    """The record that one shard of a stage's output is finished (generate, capture)."""
    return f"{prefix}/{validate_id(shard_name, 'shard')}.done.json"


def shard_parts_prefix(prefix: str, shard_name: str) -> str:
    """Parts of a shard written by earlier attempts at it (generate)."""
    return f"{prefix}/{validate_id(shard_name, 'shard')}.parts"


def registry_prefix(target: str, part: RegistryPart) -> str:
    return f"drafters/{validate_id(target, 'target')}/{part}"


def drafter_version_prefix(target: str, version: str) -> str:
    return f"{registry_prefix(target, 'versions')}/{validate_id(version, 'version')}"


def alias_key(target: str, alias: str) -> str:
    return f"{registry_prefix(target, 'aliases')}/{validate_id(alias, 'alias')}.json"


def alias_history_key(target: str, stamp: str, alias: str, version: str) -> str:
    """One move of an alias (append-only: every move is a new object)."""
    name = f"{validate_id(stamp, 'stamp')}-{validate_id(alias, 'alias')}-{validate_id(version, 'version')}"
    return f"{registry_prefix(target, 'history')}/{name}.json"


def watch_state_key(target: str, watch: WatchName) -> str:
    """What a retraining watch has fired on, kept where a restarted triggerer finds it."""
    return f"watches/{validate_id(target, 'target')}/{watch}.json"
