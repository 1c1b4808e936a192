"""dataset: published captures -> a dataset snapshot, the capture shards a training run reads.

Every capture in a dataset has the same capture contract; its shards keep their train/eval split. The
dataset manifest is all a dataset is: training and evaluation read the shards it lists.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.data.capture_contract import CaptureContract, require_same_contract
from pipeline.manifest import MANIFEST_NAME, publish, read_manifest
from pipeline.records import DatasetContent, DatasetRecord, DatasetShard, SplitTotals
from pipeline.stages import StageInputs, StageOutput
from pipeline.storage import ObjectStore


class Inputs(StageInputs):
    capture_uris: list[str]
    snapshot: str  # the dataset's name


Output = StageOutput


class DatasetFailed(RuntimeError):
    pass


def _shards_by_split(
    store: ObjectStore, capture_uris: list[str], dataset: str
) -> tuple[dict[str, Any], dict[str, list[DatasetShard]]]:
    contract: dict[str, Any] | None = None
    splits: dict[str, list[DatasetShard]] = {"train": [], "eval": []}
    for uri in capture_uris:
        capture_prefix = store.key_for(uri)
        manifest = read_manifest(store, capture_prefix, kind="capture")
        if contract is None:
            contract = manifest["contract"]
        require_same_contract(contract, manifest["contract"], f"dataset {dataset}: {uri}")
        by_name = {o["name"]: o for o in manifest["objects"]}
        for shard in manifest["shards"]:
            obj = by_name[shard["name"]]
            entry = {
                "key": f"{capture_prefix}/{shard['name']}",
                "bytes": obj["bytes"],
                "sha256": obj["sha256"],
            }
            splits[shard["split"]].append(DatasetShard.model_validate({**entry, **shard}))
    assert contract is not None  # capture_uris is not empty
    return contract, splits


def _totals(shards: list[DatasetShard]) -> SplitTotals:
    return SplitTotals(
        samples=sum(s.samples for s in shards),
        tokens=sum(s.tokens for s in shards),
        assistant_tokens=sum(s.assistant_tokens for s in shards),
    )


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    """The dataset `inputs.snapshot` of the target: every shard of the given captures."""
    if not inputs.capture_uris:
        raise DatasetFailed(f"dataset {inputs.snapshot}: no captures given")
    contract, splits = _shards_by_split(store, inputs.capture_uris, inputs.snapshot)
    if not splits["train"]:
        raise DatasetFailed(f"dataset {inputs.snapshot} would have no training shards")
    content = DatasetContent(
        dataset=inputs.snapshot,
        target=config.target.name,
        captures=list(inputs.capture_uris),
        contract=CaptureContract.model_validate(contract),
        train_shards=splits["train"],
        eval_shards=splits["eval"],
        totals={"train": _totals(splits["train"]), "eval": _totals(splits["eval"])},
    )
    prefix = layout.dataset_prefix(config.target.name, inputs.snapshot)
    manifest = publish(store, prefix, DatasetRecord.KIND, [], content.model_dump(mode="json"))
    return Output(uri=store.uri(prefix), kind=manifest["kind"])


def latest_dataset(config: RunConfig, store: ObjectStore) -> str:
    """URI of the most recently published dataset of the configured target."""
    base = layout.target_data_prefix("datasets", config.target.name)
    manifests = [key for key in store.list(base) if key.endswith("/" + MANIFEST_NAME)]
    if not manifests:
        raise DatasetFailed(
            f"no dataset has been published for target {config.target.name} under {store.uri(base)}"
        )
    newest = max(manifests, key=lambda key: json.loads(store.get_bytes(key))["created_at"])
    return store.uri(newest.rsplit("/", 1)[0])
