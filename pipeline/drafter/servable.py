"""Would the target's SGLang server load this drafter? Asked wherever a drafter is handed towards a server:
at export, by `drafter verify` and by `drafter pull` (pipeline.ops.registry).

The answer comes from pipeline.engines.sglang_draft_checks, SGLang 0.5.23's own load-time checks (context
length, widths and vocabularies, the draft config, aux layers, weights, the hot-token map, the speculative
flags), run against the target's config.json. Export records that config next to the drafter as
target_config.json, so a pulled or synced copy can be checked without the target's weights at hand.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.engines.sglang_draft_checks import (
    SGLANG_VERSION,
    DraftModelRefused,
    SpeculativeArgs,
    draft_model_problems,
)
from pipeline.user_files import UserFile

TARGET_CONFIG_NAME = "target_config.json"  # the target's config.json, recorded by export


class NoTargetConfig(ValueError):
    """Nothing says which target the drafter is for, so whether SGLang would serve it cannot be checked."""


def speculative_args(serving: dict[str, Any] | None) -> SpeculativeArgs:
    """The EAGLE3 launch flags of a version's benchmarked setting ({"steps", "topk", "draft_tokens"});
    SGLang's own defaults without one."""
    if not serving:
        return SpeculativeArgs("EAGLE3")
    topk = int(serving.get("topk", 1))
    steps = int(serving["steps"])
    draft_tokens = serving.get("draft_tokens") or (steps + 1 if topk == 1 else steps * topk)
    return SpeculativeArgs("EAGLE3", steps, topk, int(draft_tokens))


def sglang_flags(drafter_path: str, steps: int, topk: int = 1, draft_tokens: int | None = None) -> list[str]:
    """SGLang's EAGLE3 launch flags for a drafter directory at a setting (draft tokens default to SGLang's:
    steps + 1 for a chain, steps x topk for a tree)."""
    draft_tokens = draft_tokens or (steps + 1 if topk == 1 else steps * topk)
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        drafter_path,
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
    ]


def record_target_config(target_dir: Path, drafter_dir: Path) -> None:
    shutil.copyfile(target_dir / "config.json", drafter_dir / TARGET_CONFIG_NAME)


def target_config_for(drafter_dir: Path, target_config: str | Path | None) -> Path:
    """The target config to check a drafter against: the one given (a model directory or its config.json),
    else the one recorded at export."""
    if target_config is not None:
        return given_target_config(target_config)
    recorded = drafter_dir / TARGET_CONFIG_NAME
    if not recorded.is_file():
        raise NoTargetConfig(
            f"drafter directory {drafter_dir} records no {TARGET_CONFIG_NAME} (exported before drafters "
            "recorded their target), so whether SGLang would serve it is unknown; give the target's config "
            "(--target-config DIR_OR_CONFIG_JSON)"
        )
    return _a_target_config(recorded)


def given_target_config(target_config: str | Path) -> Path:
    """The config.json of a target config given (`--target-config`: a model directory or its config.json);
    NoTargetConfig naming it when there is none, or it is not a model's config.json."""
    path = Path(target_config)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise NoTargetConfig(
            f"target config {target_config} is neither a config.json nor a directory with one"
        )
    return _a_target_config(config)


# the sizes the checks read from a target's config.json (from its text_config in a multimodal one)
TARGET_SIZES = ("num_hidden_layers", "hidden_size", "vocab_size")


def _a_target_config(config: Path) -> Path:
    """`config`, or NoTargetConfig naming it when it is not a model's config.json (JSON text, an object with
    the sizes the checks read): a file given by mistake would otherwise fail deep inside the checks."""
    try:
        top = UserFile(config, "target config").read_json()
    except ValueError as err:  # unreadable, too large, not UTF-8 text, not JSON, nested too deep
        raise NoTargetConfig(
            f"{err}; not a readable JSON config.json: give the target's config.json (or its model directory)"
        ) from err
    text = top.get("text_config", top) if isinstance(top, dict) else None
    if not isinstance(text, dict):
        raise NoTargetConfig(f"target config {config} holds no JSON object, as a model's config.json does")
    missing = [key for key in TARGET_SIZES if not isinstance(text.get(key), int)]
    if missing:
        raise NoTargetConfig(
            f"target config {config} is not a model's config.json: it has no integer {', '.join(missing)}"
        )
    return config


@contextmanager
def _as_model_dir(config_file: Path) -> Iterator[Path]:
    """A directory whose config.json is config_file (the checks read a target the way SGLang does: a
    model directory)."""
    if config_file.name == "config.json":
        yield config_file.parent
        return
    with tempfile.TemporaryDirectory(prefix="target-config-") as scratch:
        shutil.copyfile(config_file, Path(scratch) / "config.json")
        yield Path(scratch)


def require_servable(
    drafter_dir: Path, target_config: str | Path | None = None, serving: dict[str, Any] | None = None
) -> Path:
    """Raise DraftModelRefused (a ValueError naming every reason and where SGLang 0.5.23 does it) when the
    target's server would refuse, or serve broken, this drafter with these flags; returns the target config
    file it was checked against."""
    config_file = target_config_for(drafter_dir, target_config)
    with _as_model_dir(config_file) as model_dir:
        problems = draft_model_problems(model_dir, drafter_dir, speculative_args(serving))
    if problems:
        raise DraftModelRefused(
            f"SGLang {SGLANG_VERSION} would not serve drafter {drafter_dir} for the target of {config_file}:"
            "\n  - " + "\n  - ".join(problems)
        )
    return config_file
