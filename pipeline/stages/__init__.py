"""Pipeline stages: each is `run(config, ...) -> StageResult`, passing object-store URIs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageResult:
    uri: str
    manifest: dict[str, Any] = field(default_factory=dict)
