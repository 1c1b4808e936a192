"""Object-store layout (DESIGN.md): every key the pipeline reads or writes is built here."""

from __future__ import annotations

from pipeline.ids import validate_id


def prompts_prefix(snapshot: str) -> str:
    return f"prompts/{validate_id(snapshot, 'snapshot')}"


def responses_prefix(target: str, snapshot: str) -> str:
    """Regenerated conversations (the target's own answers), input of capture."""
    return f"responses/{validate_id(target, 'target')}/{validate_id(snapshot, 'snapshot')}"


def captures_prefix(target: str, snapshot: str) -> str:
    return f"captures/{validate_id(target, 'target')}/{validate_id(snapshot, 'snapshot')}"


def dataset_prefix(target: str, dataset: str) -> str:
    return f"datasets/{validate_id(target, 'target')}/{validate_id(dataset, 'dataset')}"


def run_prefix(run_id: str) -> str:
    return f"runs/{validate_id(run_id, 'run id')}"


def train_prefix(run_id: str) -> str:
    """The train stage's published drafter, metrics and result."""
    return f"{run_prefix(run_id)}/train"


def train_worker_spec_key(run_id: str) -> str:
    """What every training node reads first: no filesystem is shared for it."""
    return f"{train_prefix(run_id)}/worker_spec.json"


def drafter_versions_prefix(target: str) -> str:
    return f"drafters/{validate_id(target, 'target')}/versions"


def drafter_version_prefix(target: str, version: str) -> str:
    return f"{drafter_versions_prefix(target)}/{validate_id(version, 'version')}"


def alias_key(target: str, alias: str) -> str:
    return f"drafters/{validate_id(target, 'target')}/aliases/{validate_id(alias, 'alias')}.json"


def alias_history_prefix(target: str) -> str:
    return f"drafters/{validate_id(target, 'target')}/history"
