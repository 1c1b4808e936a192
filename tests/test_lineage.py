"""Lineage of a stage task (pipeline.ops.lineage): what it read and published, named as OpenLineage
datasets. The DAGs report it through Airflow's OpenLineage provider (tests/test_dags.py runs both DAGs
with its file transport and follows the chain from prompts to the drafter version)."""

from __future__ import annotations

import pytest

from tests.conftest import storage_config, tiny_config_dict


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


def test_every_stage_output_names_the_artifacts_it_read(tmp_path, tiny_target_dir):
    from pipeline.config import load_config
    from pipeline.stages import run_stage
    from pipeline.storage import open_store

    config = load_config(data=tiny_config_dict(storage_config("file", tmp_path, None)))
    store = open_store(config.storage)
    prompts = run_stage("prompts", config, "snap", store)
    assert prompts.read == []  # its sources are files, not artifacts
    generated = run_stage("generate", config, "snap", store)
    assert generated.read == [prompts.uri]
