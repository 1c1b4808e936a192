"""What the stages that work shard by shard (generate, capture) share: a shard task's start, the job one
shard is, and the manifest they publish once every shard is done."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.config_records import Record as ConfigRecord
    from pipeline.progress import Progress
    from pipeline.storage import ObjectInfo, ObjectStore


@dataclass(frozen=True)
class ShardJob:
    """One input shard of a stage that works shard by shard (generate, capture), and where its output
    goes: the stage's output prefix in `store`."""

    store: ObjectStore
    prefix: str
    shard: dict[str, Any]  # the input shard's manifest entry
    records: list[dict[str, Any]]
    progress: Progress


class ShardTask(NamedTuple):
    """A shard task's (generate's or capture's, `shard_task`) output and input."""

    prefix: str  # the output's
    record: ConfigRecord  # the config the output is made with, claimed before its first part is written
    input_prefix: str
    input_manifest: dict[str, Any]
    shard: dict[str, Any]  # the input shard's entry

    def records(self, store: ObjectStore) -> list[dict[str, Any]]:
        """The input shard's records, verified against its manifest."""
        from pipeline.data.jsonl import decode_jsonl
        from pipeline.manifest import read_listed

        return decode_jsonl(read_listed(store, self.input_prefix, self.input_manifest, self.shard["name"]))


# what each shard stage makes, from what
SHARD_INPUTS = {"responses": "prompts", "captures": "responses"}


def shard_task(
    config: RunConfig, store: ObjectStore, kind: str, snapshot: str, input_uri: str, shard: str
) -> ShardTask:
    """The start of a shard task making `kind` (responses, captures) of `snapshot` from its input at
    `input_uri`: the output's config record, checked against `config` (a finished shard is reused only under
    its config: pipeline.config_records), and the input shard `shard`."""
    from pipeline import layout
    from pipeline.config_records import artifact_record, require_same
    from pipeline.manifest import listed_shard

    prefix = (layout.responses_prefix if kind == "responses" else layout.captures_prefix)(
        config.target.name, snapshot
    )
    record = artifact_record(store, prefix, kind)
    require_same(store, record, config)
    return ShardTask(prefix, record, *listed_shard(store, input_uri, SHARD_INPUTS[kind], shard))


def publish_with_left_out(
    store: ObjectStore,
    prefix: str,
    kind: str,
    objects: list[ObjectInfo],
    left_out: tuple[str, list[dict[str, Any]]],
    fields: dict[str, Any],
) -> dict[str, Any]:
    """Publish a shard-by-shard stage's manifest; the records it left out (failed generations, quarantined
    captures), when there are any, go beside it as one JSONL object named left_out[0]."""
    from pipeline.data.jsonl import encode_jsonl
    from pipeline.manifest import publish

    name, records = left_out
    if records:
        objects = [*objects, store.put_bytes(f"{prefix}/{name}", encode_jsonl(records))]
    return publish(store, prefix, kind, objects, fields)
