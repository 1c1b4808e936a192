"""Lineage of a stage task (pipeline.ops.lineage): what it read and published, named as OpenLineage
datasets. The DAGs report it through Airflow's OpenLineage provider (tests/system/test_dag_runs.py runs
both DAGs with its file transport and follows the chain from prompts to the drafter version)."""

from __future__ import annotations

from tests.conftest import storage_config, tiny_config_dict


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
