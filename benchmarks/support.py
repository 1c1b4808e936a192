"""Shared set-up for the benchmark scripts: the embedded default config on a scratch store."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

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


def captured_dataset(samples: int, overrides: list[str] | None = None):
    """(config, store, dataset uri) of a fresh captured dataset of the tiny target's own answers."""
    config = scratch_config(
        [
            f"prompts.num_samples={samples}",
            "prompts.eval_fraction=0.1",
            "capture.parity.samples=0",
            *(overrides or []),
        ]
    )
    from pipeline.stages import capture, generate, prompts
    from pipeline.storage import open_store

    store = open_store(config.storage)
    responses = generate.run(config, prompts.run(config, "bench", store).uri, "bench", store)
    captured = capture.run(config, responses.uri, "bench", store)
    return config, store, capture.publish_dataset(config, [captured.uri], "bench", store).uri


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
