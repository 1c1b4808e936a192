"""train: a dataset snapshot -> a trained, exported drafter and its metrics in runs/<run_id>/train/.

Every epoch is scored on the dataset's eval split, and the drafter exported is the epoch with the best
held-out simulated acceptance (tau_simulated); the result names it (`chosen_epoch`).

This side stays light: it checks the capture contract, fixes the draft vocabulary (counting assistant
tokens with ranged reads, or reusing a warm start's mapping), writes the worker spec to the object store,
starts the training nodes through a launcher (pipeline.training.nodes: torchrun agents running
`drafter train-worker` on this machine, or in the pods of a Kubernetes Job) and waits for them. Training
never runs inside the calling process, so an Airflow worker only supervises it. This process is also
the one that publishes: the drafter, metrics and result rank 0 wrote into the work directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.config_records import claim, require_same, run_record
from pipeline.data.capture_contract import require_same_contract
from pipeline.drafter.export import DRAFTER_FILES, read_drafter_dir
from pipeline.drafter.vocab import build_mapping, mapping_from_d2t
from pipeline.engines.target import describe_target
from pipeline.manifest import MANIFEST_NAME, publish
from pipeline.records import (
    DatasetRecord,
    InitChoice,
    InitProbe,
    VocabularyCoverage,
    WorkerSpec,
    read_dataset,
)
from pipeline.stages import StageInputs, StageOutput, already_published
from pipeline.stages.capture import contract_for
from pipeline.storage import ObjectStore
from pipeline.training.checkpoint_digests import CHECKPOINTS_DIR, DigestRecords, resume_point
from pipeline.training.init_choice import (
    decide_auto,
    fixed_choice,
    probe_bar,
    restart_choice,
    warm_restart_bar,
)
from pipeline.training.nodes import TrainingFailed, node_launcher
from pipeline.training.stream import ShardRef, assistant_token_counts
from pipeline.training.tracking import TENSORBOARD_DIR, TRACKING_FILE, TrackingUnavailable, open_mlflow_run
from pipeline.training.worker import check_warm_start_architecture, check_warm_start_contract

log = logging.getLogger(__name__)


class Inputs(StageInputs):
    dataset_uri: str


Output = StageOutput


def expected_contract(config: RunConfig) -> dict[str, Any]:
    """What this config's target and capture settings say the features must be."""
    return contract_for(config, describe_target(config), None).model_dump()


def draft_vocabulary(
    config: RunConfig, store: ObjectStore, dataset: DatasetRecord, init_dir: Path | None
) -> list[int]:
    """Target ids of the draft vocabulary: a warm start's own mapping, else the most frequent assistant
    tokens."""
    vocab_size = dataset.contract.vocab_size
    if init_dir is not None:
        init_config, tensors, init_contract = read_drafter_dir(init_dir)
        check_warm_start_architecture(init_config, config.drafter.architecture)
        check_warm_start_contract(init_contract, dataset.contract.model_dump(mode="json"))
        return mapping_from_d2t(tensors["d2t"], vocab_size).used_ids.tolist()
    shards = [ShardRef.from_manifest(entry) for entry in dataset.train_shards]
    counts = assistant_token_counts(store, shards, vocab_size)
    return build_mapping(counts, config.drafter.draft_vocab_size).used_ids.tolist()


# Who starts the nodes and where they meet change nothing that is trained: an attempt on another
# rendezvous port resumes the same checkpoints. The node and rank counts do count (one ZeRO shard per rank).
PLACEMENT_SETTINGS = {
    "launcher",
    "rendezvous_endpoint",
    "rendezvous_port",
    "rendezvous_timeout_s",
    "kubernetes_job",
}


def training_fingerprint(config: RunConfig, dataset: DatasetRecord) -> str:
    """What a training run depends on. Checkpoints in a work dir are resumed only under the same one,
    so a rerun with another dataset or other settings never continues someone else's optimizer state."""
    inputs = {
        "dataset": dataset.uri,
        "dataset_created": dataset.created_at,
        "shards": [s.sha256 for s in dataset.train_shards],
        # the eval shards and settings score every epoch, and so choose the epoch exported
        "eval_shards": [s.sha256 for s in dataset.eval_shards],
        "evaluate": config.evaluate.model_dump(mode="json"),
        "train": config.train.model_dump(mode="json", exclude=PLACEMENT_SETTINGS),
        "drafter": config.drafter.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]


def resolve_init_dir(config: RunConfig, store: ObjectStore, workdir: Path) -> Path | None:
    """A local directory holding the warm-start drafter (a local path or a registry reference)."""
    if config.train.init != "warm":
        return None
    located = locate_init_source(config, store, config.train.init_from or "", workdir)
    if located is None:
        raise TrainingFailed(f"train.init_from {config.train.init_from!r}: the registry has no such drafter")
    return located[0]


def locate_init_source(
    config: RunConfig, store: ObjectStore, source: str, workdir: Path
) -> tuple[Path, str | None] | None:
    """(local directory, registry version or None) of a warm-start source: a drafter directory, or
    registry:<alias or version> pulled into the work dir; None when the registry has no such name."""
    if source.startswith("registry:"):
        from pipeline.ops.registry import RegistryError, pull, resolve

        try:
            version = resolve(store, config.target.name, source[len("registry:") :])
        except RegistryError:
            return None
        return pull(store, config.target.name, version, workdir / "init_drafter"), version
    path = Path(source)
    if not path.is_dir():
        raise TrainingFailed(
            f"train.init_from {source!r} is neither a drafter directory nor registry:<alias>"
        )
    return path, None


def choose_init(
    config: RunConfig, store: ObjectStore, dataset: DatasetRecord, workdir: Path
) -> tuple[Path | None, InitChoice]:
    """The warm-start directory (None: scratch) and the choice's record (pipeline.training.init_choice)."""
    if config.train.init != "auto":
        return resolve_init_dir(config, store, workdir), fixed_choice(config)
    source = config.train.init_from or f"registry:{config.registry.alias}"
    located = locate_init_source(config, store, source, workdir)
    data_contract = dataset.contract.model_dump(mode="json")
    if located is None:
        return None, decide_auto(source, None, None, data_contract, _no_probe, check_warm_start_contract)
    directory, version = located
    incumbent_config, _, incumbent_contract = read_drafter_dir(directory)

    def check_compatible(init_contract: dict[str, Any], data: dict[str, Any]) -> None:
        check_warm_start_architecture(incumbent_config, config.drafter.architecture)
        check_warm_start_contract(init_contract, data)

    choice = decide_auto(
        source,
        version,
        incumbent_contract,
        data_contract,
        lambda: probe_incumbent(config, store, dataset, directory),
        check_compatible,
        lambda: vocabulary_coverage(config, store, dataset, directory),
        config.train.auto_init.max_vocabulary_gap,
    )
    if choice.chosen == "scratch":
        log.info("train.init auto: scratch (%s)", choice.reason)
        return None, choice
    bar = warm_restart_bar(config, own_heldout_cond_acc0(directory))
    log.info(
        "train.init auto: warm (%s); a stall under %.3f restarts it (%s)",
        choice.reason,
        bar.cond_acc0,
        bar.reason,
    )
    return directory, choice.model_copy(update={"restart_under": bar})


def own_heldout_cond_acc0(directory: Path) -> float | None:
    """The held-out cond_acc_0 a drafter reached on its own target's data, from the registry manifest a pull
    writes beside it (its lineage's evaluation); None for a drafter directory without one."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return float(json.loads(path.read_text())["lineage"]["eval"]["cond_acc"][0])
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise TrainingFailed(f"{path}: the lineage's held-out cond_acc_0 cannot be read ({err})") from err


def vocabulary_coverage(
    config: RunConfig, store: ObjectStore, dataset: DatasetRecord, directory: Path
) -> VocabularyCoverage:
    """Shares of the new dataset's held-out assistant tokens outside the incumbent's draft vocabulary and
    outside the one scratch would build from the new data (token counts only: no hidden states read)."""
    held = [ShardRef.from_manifest(entry) for entry in dataset.eval_shards or dataset.train_shards]
    counts = assistant_token_counts(store, held, dataset.contract.vocab_size)
    total = max(1, int(counts.sum()))

    def outside(used_ids: list[int]) -> float:
        return round(1.0 - int(counts[used_ids].sum()) / total, 4)

    return VocabularyCoverage(
        incumbent_outside=outside(draft_vocabulary(config, store, dataset, directory)),
        fresh_outside=outside(draft_vocabulary(config, store, dataset, None)),
    )


def _no_probe() -> InitProbe:
    raise AssertionError("there is no incumbent to probe")


def probe_incumbent(
    config: RunConfig, store: ObjectStore, dataset: DatasetRecord, directory: Path
) -> InitProbe:
    """The incumbent scored on the new dataset's held-out split (the evaluate stage's own counts)."""
    from pipeline.stages.evaluate import evaluate_drafter, heldout_shards

    if not dataset.eval_shards:
        raise TrainingFailed(
            "train.init auto must probe an incumbent of another target on held-out data, and the dataset has "
            "no eval shards; raise prompts.eval_fraction or set train.init"
        )
    result = evaluate_drafter(
        directory,
        heldout_shards(config, store, dataset),
        describe_target(config).model_dir,
        config.evaluate.ttt_steps or config.train.ttt_steps,
        config.evaluate.micro_batch_size,
        config.train.attention_chunk,
    )
    return InitProbe(
        cond_acc=result["cond_acc"], tau_simulated=result["tau_simulated"], bar=probe_bar(config)
    )


def worker_spec(
    config: RunConfig,
    store: ObjectStore,
    dataset: DatasetRecord,
    run_id: str,
    workdir: Path,
    init: tuple[Path | None, InitChoice],
) -> WorkerSpec:
    """What every rank needs. Its local paths (work dir, shard cache, target, warm start) are the same on
    every node: the node pods mount the cache and weight volumes where this pod does."""
    init_dir, choice = init
    return WorkerSpec(
        config=config,
        run_id=run_id,
        workdir=str(workdir),
        train_shards=dataset.train_shards,
        eval_shards=dataset.eval_shards,
        shard_cache=str((Path(config.storage.local_cache) / "shards").resolve()),
        target_dir=str(describe_target(config).model_dir.resolve()),
        contract=dataset.contract,
        init_dir=str(init_dir.resolve()) if init_dir else None,
        draft_vocab=draft_vocabulary(config, store, dataset, init_dir),
        warm_restart_bar=choice.restart_under.cond_acc0 if choice.restart_under else None,
    )


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    """Trains (or reuses a published training) and records the run's config beside its artifacts, once it
    trains with it; a rerun of the run id with another config than recorded is refused first."""
    dataset_uri = inputs.dataset_uri
    require_same(store, run_record(run_id), config)
    dataset_prefix = store.key_for(dataset_uri)
    dataset = read_dataset(store, dataset_prefix)
    contract = dataset.contract.model_dump(mode="json")
    require_same_contract(expected_contract(config), contract, f"training on {dataset_uri}")
    prefix = layout.run_stage_prefix(run_id, "train")
    if published := already_published(store, prefix, "train"):
        return published
    workdir = (
        config.storage.run_workdir(run_id) / f"train-{training_fingerprint(config, dataset)}"
    ).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if config.tracking.mlflow_uri:  # an unreachable tracking server fails here, before any node starts
        try:
            open_mlflow_run(config.tracking, run_id)
        except TrackingUnavailable as err:
            raise TrainingFailed(str(err)) from err
    claim(store, run_record(run_id), config)  # what its checkpoints and results are made with
    spec_object, workdir, attempts = _train(config, store, dataset, run_id, workdir)
    earlier = _store_attempt_metrics(store, prefix, attempts)
    return _publish(
        config,
        store,
        prefix,
        workdir,
        [spec_object, *earlier],
        {
            "run_id": run_id,
            "dataset": store.uri(dataset_prefix),
            "contract": contract,
            "init_from": attempts[-1]["init"]["source"] if attempts[-1]["init"]["chosen"] == "warm" else None,
            "init": attempts[-1]["init"],
            "attempts": attempts,
        },
    )


def _train(
    config: RunConfig, store: ObjectStore, dataset: DatasetRecord, run_id: str, workdir: Path
) -> tuple[Any, Path, list[dict[str, Any]]]:
    """The attempts of one training: from where train.init says, then, if train.init auto's warm start
    stalled (stop_reason warm_plateau), from scratch in a work dir of its own. Returns the last attempt's
    worker spec object and work dir, and every attempt's record."""
    init = choose_init(config, store, dataset, workdir)
    spec_object, result = _attempt(config, store, worker_spec(config, store, dataset, run_id, workdir, init))
    attempts = [_attempt_record(init[1], result, workdir)]
    if result["stop_reason"] != "warm_plateau":
        return spec_object, workdir, attempts
    restart = restart_choice(init[1], result["global_steps"], _last_cond_acc0(workdir))
    log.info("train.init auto: %s", restart.reason)
    workdir = workdir.with_name(f"{workdir.name}-scratch")
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = worker_spec(config, store, dataset, run_id, workdir, (None, restart))
    spec_object, result = _attempt(config, store, scratch)
    return spec_object, workdir, attempts + [_attempt_record(restart, result, workdir)]


def _attempt(config: RunConfig, store: ObjectStore, spec: WorkerSpec) -> tuple[Any, dict[str, Any]]:
    """One training attempt in its own work dir (`spec.workdir`): the worker spec's object and rank 0's
    result."""
    run_id, workdir = spec.run_id, Path(spec.workdir)
    # a checkpoint to resume from that is not what the run committed is refused here, naming the file,
    # before any node starts (each node checks again before it loads anything)
    resume_point(workdir / CHECKPOINTS_DIR, DigestRecords(store, run_id, workdir.name))
    spec_object = store.put_bytes(layout.train_worker_spec_key(run_id), spec.to_json())
    (workdir / "train_result.json").unlink(missing_ok=True)
    code = node_launcher(config.train, config.storage).train(
        store.uri(spec_object.key), run_id, workdir / "train.log"
    )
    if code != 0:
        raise TrainingFailed(f"training exited with code {code}; full log: {workdir / 'train.log'}")
    if not (workdir / "train_result.json").exists():
        raise TrainingFailed(
            f"training finished without rank 0's result in {workdir}: the nodes must write the "
            "work dir this process reads (storage.local_cache on the volume every node mounts)"
        )
    return spec_object, json.loads((workdir / "train_result.json").read_text())


def _attempt_record(choice: InitChoice, result: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """What the manifest says of one attempt: how it started, why, how it ended, its epochs, and its
    training cond_acc_0 curve ([global step, value] per log interval)."""
    return {
        "init": choice.model_dump(mode="json"),
        "stop_reason": result["stop_reason"],
        "global_steps": result["global_steps"],
        "epochs_run": result["epochs_run"],
        "history": result["history"],
        "cond_acc0_by_step": [[line["global_step"], line["cond_acc"][0]] for line in _intervals(workdir)],
        "workdir": str(workdir),  # replaced by its metrics' URI when published
    }


def _store_attempt_metrics(store: ObjectStore, prefix: str, attempts: list[dict[str, Any]]) -> list[Any]:
    """Each attempt's metrics by URI: the last one's are the run's own metrics.jsonl (published with the
    drafter); an earlier (stalled warm) attempt's are stored now, under attempts/<n>/, and returned."""
    stored = []
    for number, attempt in enumerate(attempts, 1):
        metrics = Path(attempt.pop("workdir")) / "metrics.jsonl"
        if number == len(attempts):
            attempt["metrics"] = store.uri(f"{prefix}/metrics.jsonl")
            continue
        stored.append(store.put_file(f"{prefix}/attempts/{number}/metrics.jsonl", metrics))
        attempt["metrics"] = store.uri(stored[-1].key)
    return stored


def _intervals(workdir: Path) -> list[dict[str, Any]]:
    """The log-interval records of the attempt's metrics.jsonl."""
    lines = [
        json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    return [line for line in lines if line.get("kind") == "interval"]


def _last_cond_acc0(workdir: Path) -> float:
    """Training cond_acc_0 of the attempt's last log interval."""
    intervals = _intervals(workdir)
    return float(intervals[-1]["cond_acc"][0]) if intervals else 0.0


def _publish(
    config: RunConfig, store: ObjectStore, prefix: str, workdir: Path, objects: list, fields: dict[str, Any]
) -> Output:
    """Rank 0's drafter, metrics and result, then the manifest listing them."""
    result = json.loads((workdir / "train_result.json").read_text())
    objects = objects + [
        store.put_file(f"{prefix}/drafter/{name}", workdir / "drafter" / name) for name in DRAFTER_FILES
    ]
    objects.append(store.put_file(f"{prefix}/metrics.jsonl", workdir / "metrics.jsonl"))
    objects.append(store.put_file(f"{prefix}/train_result.json", workdir / "train_result.json"))
    objects += [  # rank 0 copied them while training; listed here as they ended
        store.put_file(f"{prefix}/{TENSORBOARD_DIR}/{path.name}", path)
        for path in sorted((workdir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    ]
    tracking = workdir / TRACKING_FILE
    manifest = publish(
        store,
        prefix,
        "train",
        objects,
        {
            **fields,
            "tracking": json.loads(tracking.read_text()) if tracking.exists() else {},
            "config": config.train.model_dump(mode="json"),
            "drafter_config": config.drafter.model_dump(mode="json"),
            "result": {k: v for k, v in result.items() if k != "history"},
            "history": result["history"],
        },
    )
    return Output(uri=store.uri(prefix), kind=manifest["kind"])
