"""Lineage of a stage task (pipeline.ops.lineage): what it read and published, named as OpenLineage
datasets. The DAGs report it through Airflow's OpenLineage provider (tests/system/test_dag_runs.py runs
both DAGs with its file transport and follows the chain from prompts to the drafter version)."""

from __future__ import annotations

import pytest


def test_a_stage_task_reads_its_inputs_and_publishes_its_output_and_a_promoted_version():
    from pipeline.ops.lineage import stage_lineage

    trained = {"uri": "s3://b/p/runs/r/train", "kind": "train", "read": ["s3://b/p/datasets/t/d"]}
    assert stage_lineage(trained) == (["s3://b/p/datasets/t/d"], ["s3://b/p/runs/r/train"])
    promoted = {
        "uri": "s3://b/p/runs/r/promote",
        "kind": "promote",
        "read": ["s3://b/p/runs/r/train", "s3://b/p/runs/r/bench"],
        "registry_uri": "s3://b/p/drafters/t/versions/v0002-ab",
    }
    assert stage_lineage(promoted)[1] == ["s3://b/p/runs/r/promote", "s3://b/p/drafters/t/versions/v0002-ab"]
    # a shard's result, a refused promotion's, or no result at all: nothing to report
    assert stage_lineage({"shard": "0001", "rows": 3}) == ([], [])
    assert stage_lineage(None) == ([], [])
    assert stage_lineage({**promoted, "registry_uri": None})[1] == ["s3://b/p/runs/r/promote"]


def test_object_store_uris_are_named_as_openlineage_names_them():
    from pipeline.ops.lineage import dataset_name

    assert dataset_name("s3://drafter-pipeline/kimi/datasets/kimi-k2.5/d1") == (
        "s3://drafter-pipeline",
        "kimi/datasets/kimi-k2.5/d1",
    )
    assert dataset_name("file:///data/store/prompts/p1") == ("file", "/data/store/prompts/p1")
    with pytest.raises(ValueError, match="not an object-store URI"):
        dataset_name("/data/store/prompts/p1")
