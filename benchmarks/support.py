"""Shared set-up for the benchmark scripts: the embedded default config on a scratch store."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.spread import Measurement, RatioEstimate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def scratch_config(overrides: list[str] | None = None, config: str = "configs/local.yaml"):
    """The config with its store in a fresh temp dir; the tiny target cache stays shared (built once)."""
    from pipeline.cli import quiet_libraries
    from pipeline.config import load_config

    quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    base = load_config(REPO / config)
    root = tempfile.mkdtemp(prefix="drafter-bench-")
    cache = (
        str((REPO / base.storage.local_cache).resolve())
        if not Path(base.storage.local_cache).is_absolute()
        else base.storage.local_cache
    )
    return load_config(
        REPO / config, [f"storage.root={root}/store", f"storage.local_cache={cache}", *(overrides or [])]
    )


def report(**values) -> None:
    """Print key=value lines in the given order (the headline goes last)."""
    for key, value in values.items():
        print(f"{key}={round(value, 4) if isinstance(value, float) else value}", flush=True)


def spread_parser(budget_s: float, rel_width: float = 0.1) -> argparse.ArgumentParser:
    """A parser with --budget-s and --rel-width: when `pipeline.spread.measure` stops its interleaved
    rounds. The script adds its own options."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--budget-s",
        type=float,
        default=budget_s,
        help="seconds after which the interleaved measurement stops, warm-up included; it still runs "
        "its minimum of 5 rounds (default %(default)s)",
    )
    parser.add_argument(
        "--rel-width",
        type=float,
        default=rel_width,
        help="stop earlier once every 95%% interval is this narrow relative to its ratio "
        "(default %(default)s)",
    )
    return parser


def report_measurement(measurement: Measurement) -> None:
    """How much the interleaved measurement saw: rounds after warm-up, and what stopped it.

    The scripts print each side's seconds (or rate) as a geometric mean over the rounds: the quotient
    of two such means is exactly the paired ratio that `report_ratio` prints."""
    report(rounds=measurement.rounds, stopped_by=measurement.stopped_by)


def report_ratio(name: str, estimate: RatioEstimate, headline: bool = False) -> None:
    """A timed ratio with its 95% interval: name=, name_ci_low=, name_ci_high= (in that order)."""
    lines = estimate.lines(name)
    # a headline prints its interval first, so the last line is still the headline's name=value
    for line in lines[1:] + lines[:1] if headline else lines:
        print(line, flush=True)


def captured_dataset(
    samples: int, overrides: list[str] | None = None, eval_fraction: float = 0.1, run_id="bench"
):
    """(config, store, dataset uri) of a fresh captured dataset of the tiny target's own answers: `samples`
    conversations, `eval_fraction` of them held out, as the run `run_id` of a scratch store."""
    config = scratch_config(
        [
            f"prompts.num_samples={samples}",
            f"prompts.eval_fraction={eval_fraction}",
            "capture.parity.samples=0",
            *(overrides or []),
        ]
    )
    from pipeline.storage import open_store

    store = open_store(config.storage)
    for name in ("prompts", "generate", "capture"):
        stage(name, config, store, run_id)
    return config, store, stage("dataset", config, store, run_id).uri


def regenerated(samples: int):
    """(config, store, generate output): `samples` demo conversations, all in the training split, with
    the tiny target's own answers, as the run "bench" of a scratch store."""
    from pipeline.storage import open_store

    config = scratch_config([f"prompts.num_samples={samples}", "prompts.eval_fraction=0"])
    store = open_store(config.storage)
    stage("prompts", config, store, "bench")
    return config, store, stage("generate", config, store, "bench")


def stage(name: str, config, store, run_id: str, **inputs):
    """One stage of the stage table (pipeline.stages); inputs not given are the run's own artifacts."""
    from pipeline.stages import run_stage

    return run_stage(name, config, run_id, store, **inputs)


def trained_and_evaluated(config, store, dataset_uri: str, run_id: str, **settings):
    """(train output, evaluation record) of run `run_id`: the config with `settings` ("section.key": value)
    set, trained on `dataset_uri` and evaluated on its held-out split."""
    from pipeline.records import EvalRecord, read_record

    run_config = config.model_copy(deep=True)
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        setattr(getattr(run_config, section), key, value)
    train = stage("train", run_config, store, run_id, dataset_uri=dataset_uri)
    evaluation = stage("evaluate", run_config, store, run_id, dataset_uri=dataset_uri)
    return train, read_record(store, evaluation.uri, EvalRecord)


def published(store, output) -> dict:
    """The manifest a stage published (its output names where)."""
    from pipeline.manifest import read_manifest

    return read_manifest(store, store.key_for(output.uri))


def single_process_group() -> None:
    """torch.distributed with one rank (gloo) so DeepSpeed can run inside a benchmark process."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
        }
    )
