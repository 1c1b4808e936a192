"""One entry point per stage for schedulers and the CLI: config path + overrides + URIs in, a small
dict of URIs out (XCom-sized). No Airflow import here: DAG files call these."""

from __future__ import annotations

from typing import Any

from pipeline import layout, registry
from pipeline.config import RunConfig, load_config
from pipeline.stages import StageResult
from pipeline.storage import ObjectStore, open_store

STAGES = ("prompts", "generate", "parity", "capture", "dataset", "train", "evaluate", "gate", "benchmark", "promote")


def _out(result: StageResult) -> dict[str, Any]:
    return {"uri": result.uri, "kind": result.manifest.get("kind")}


def _defaults(config: RunConfig, store: ObjectStore, run_id: str, snapshot: str) -> dict[str, str]:
    target = config.target.name
    run = layout.run_prefix(run_id)
    return {
        "prompts_uri": store.uri(layout.prompts_prefix(snapshot)),
        "responses_uri": store.uri(layout.responses_prefix(target, snapshot)),
        "capture_uri": store.uri(layout.captures_prefix(target, snapshot)),
        "dataset_uri": store.uri(layout.dataset_prefix(target, snapshot)),
        "train_uri": store.uri(f"{run}/train"), "eval_uri": store.uri(f"{run}/eval"),
        "gate_uri": store.uri(f"{run}/gate"), "bench_uri": store.uri(f"{run}/bench"),
    }


def run_stage(stage: str, config: RunConfig | str, run_id: str, overrides: list[str] | None = None,
              snapshot: str | None = None, **uris: str | None) -> dict[str, Any]:
    """Run one stage. Inputs not given default to the artifacts of `snapshot` (data) and `run_id`."""
    from pipeline.stages import benchmark, capture, evaluate, gate, generate, promote, prompts, train

    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    if isinstance(config, str):
        config = load_config(config, overrides)
    store = open_store(config.storage)
    snapshot = snapshot or run_id
    inputs = {**_defaults(config, store, run_id, snapshot), **{k: v for k, v in uris.items() if v}}
    workdir = config.storage.run_workdir(run_id)
    if stage == "prompts":
        return _out(prompts.run(config, snapshot, store))
    if stage == "generate":
        return _out(generate.run(config, inputs["prompts_uri"], snapshot, store))
    if stage == "parity":
        return {"uri": inputs["responses_uri"], "parity": capture.parity(config, inputs["responses_uri"], store)}
    if stage == "capture":
        return _out(capture.run(config, inputs["responses_uri"], snapshot, store))
    if stage == "dataset":
        return _out(capture.publish_dataset(config, [inputs["capture_uri"]], snapshot, store))
    if stage == "train":
        return _out(train.run(config, inputs["dataset_uri"], run_id, store))
    incumbent = registry.pull_incumbent(store, config.target.name, config.registry.alias, workdir) \
        if stage in ("evaluate", "benchmark") else None
    if stage == "evaluate":
        return _out(evaluate.run(config, inputs["train_uri"], inputs["dataset_uri"], run_id, store, incumbent))
    if stage == "gate":
        return _out(gate.run(config, inputs["eval_uri"], run_id, store))
    if stage == "benchmark":
        return _out(benchmark.run(config, inputs["train_uri"], inputs["eval_uri"], inputs["prompts_uri"], run_id,
                                  store, incumbent[1] if incumbent else None))
    result = promote.run(config, run_id, inputs["train_uri"], inputs["eval_uri"], inputs["gate_uri"],
                         inputs["bench_uri"], store)
    return {**_out(result), "promoted": result.manifest.get("promoted"), "version": result.manifest.get("version")}


def resolve_dataset(config: RunConfig | str, overrides: list[str] | None, dataset_uri: str | None) -> str:
    """The dataset to train on: the given one, else the newest published dataset of the target."""
    from pipeline.stages.capture import latest_dataset

    if isinstance(config, str):
        config = load_config(config, overrides)
    if dataset_uri:
        return dataset_uri
    return latest_dataset(config, open_store(config.storage))


def prompts_uri_of(config: RunConfig | str, overrides: list[str] | None, dataset_uri: str) -> str:
    """The prompt snapshot a dataset was made from (its held-out prompts feed the benchmark)."""
    from pipeline.manifest import read_manifest

    if isinstance(config, str):
        config = load_config(config, overrides)
    store = open_store(config.storage)
    dataset = read_manifest(store, store.key_for(dataset_uri), kind="dataset")
    capture = read_manifest(store, store.key_for(dataset["captures"][0]), kind="capture")
    responses = read_manifest(store, store.key_for(capture["responses"]), kind="responses")
    return responses["prompts"]
