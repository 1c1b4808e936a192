"""What every config section is built on: strict models that reject unknown keys, the error a config that
cannot be used raises, URL checks, and where relative paths in a config are read from."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.credentials import refuse_credentials


class ConfigError(ValueError):
    """A config file or override that cannot be used."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


SERVER_CREDENTIALS = (
    "a server's credentials belong in connections and the environment, never in a URL of the run config"
)


def http_url(url: str, field: str, instead: str) -> str:
    """`url`, or ValueError naming `field` when it holds credentials or does not start with http:// or
    https://: clients given one without a scheme (botocore, requests) echo it whole in their errors."""
    refuse_credentials(url, field, instead)
    if not url.lower().startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"{field} must start with http:// or https:// and name a host")
    return url


def _project_root() -> Path:
    """Where the project's own files are (configs/, infra/k8s/): $DRAFTER_HOME, which every image sets to its
    WORKDIR (docker/*.Dockerfile), else the source tree this package is in (a checkout or an editable
    install). An image installs the package into site-packages, which holds none of those files."""
    home = os.environ.get("DRAFTER_HOME")
    return Path(home).resolve() if home else Path(__file__).resolve().parents[1]


PROJECT_ROOT = _project_root()


def resolve_project_path(path: str) -> Path:
    """A path from a config: absolute, relative to the working directory, or else to the project root."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate.resolve()
    return PROJECT_ROOT / candidate


def refuse_replaced_keys(data: Any, keys: set[str], where: str, replacement: str) -> Any:
    """A `mode="before"` check: keys a config section no longer takes are refused with what replaced them."""
    removed = sorted(keys & set(data)) if isinstance(data, dict) else []
    if removed:
        raise ValueError(f"{where}.{removed[0]} was replaced by {replacement}")
    return data


def refuse_unknown(given: Iterable[str], known: Sequence[str], what: str) -> None:
    """ValueError naming the names of `given` that `known` lacks ("<what> [...]; known: ...")."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"{what} {unknown}; known: {', '.join(known)}")


def unique_labels(settings: list[Any], where: str) -> None:
    labels = [setting.label for setting in settings]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"{where} lists the same setting twice: {repeated}")
