"""Pipeline stages: each is `run(config, ...) -> StageResult`, passing object-store URIs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STAGES = (
    "prompts",
    "generate",
    "parity",
    "capture",
    "dataset",
    "train",
    "evaluate",
    "gate",
    "benchmark",
    "promote",
    "report",
)


@dataclass
class StageResult:
    uri: str
    manifest: dict[str, Any] = field(default_factory=dict)
