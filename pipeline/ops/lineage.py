"""Lineage of a run's artifacts: which object-store URIs a stage task read and which it published, named
as OpenLineage datasets. The DAGs hand these to Airflow's OpenLineage provider (dags/drafter_support.py),
so a lineage backend shows prompts -> responses -> captures -> dataset -> training -> drafter version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# the stage tasks that carry an artifact from the prompts to the drafter version, in order (dag.task)
LINEAGE_CHAIN = (
    "drafter_data.prompts",
    "drafter_data.responses",
    "drafter_data.captures",
    "drafter_data.publish_dataset",
    "drafter_train.train",
    "drafter_train.promote",
)


def stage_lineage(result: Any) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a stage task from what it returned (a StageOutput as a dict): what it read,
    and what it published; a promotion also publishes the drafter version. Anything else: none."""
    if not isinstance(result, dict) or not isinstance(result.get("uri"), str):
        return [], []
    outputs = [result["uri"]]
    if result.get("registry_uri"):
        outputs.append(result["registry_uri"])
    return list(result.get("read") or []), outputs


def dataset_name(uri: str) -> tuple[str, str]:
    """(namespace, name) of an object-store URI by OpenLineage's naming: `s3://bucket` and the key for
    S3; `file` and the absolute path for a local store."""
    parts = urlsplit(uri)
    if parts.scheme == "s3" and parts.netloc:
        return f"s3://{parts.netloc}", parts.path.lstrip("/")
    if parts.scheme == "file":
        return "file", parts.path
    raise ValueError(f"not an object-store URI (s3:// or file://): {uri!r}")


def completed_datasets(events_file: Path) -> dict[str, dict[str, set[tuple[str, str]]]]:
    """What OpenLineage's file transport recorded (one event a line): for each job (`dag.task`), the
    (namespace, name) of the datasets its completed runs read ("inputs") and published ("outputs")."""
    jobs: dict[str, dict[str, set[tuple[str, str]]]] = {}
    for line in events_file.read_text().splitlines():
        event = json.loads(line)
        if event.get("eventType") != "COMPLETE" or "job" not in event:
            continue
        sides = jobs.setdefault(event["job"]["name"], {"inputs": set(), "outputs": set()})
        for side in sides:
            sides[side] |= {(d["namespace"], d["name"]) for d in event.get(side) or []}
    return jobs
