"""What a task's pod knows of itself, from the environment its deployment gives it (pipeline.ops.deployment):
its name and uid (the downward API), so what it starts in the cluster can be owned by it, and its task's
timeout, so nothing it starts outlives the task."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TASK_POD_NAME_ENV = "DRAFTER_TASK_POD_NAME"  # fieldRef metadata.name
TASK_POD_UID_ENV = "DRAFTER_TASK_POD_UID"  # fieldRef metadata.uid
TASK_TIMEOUT_ENV = "DRAFTER_TASK_TIMEOUT_S"  # the task's execution_timeout, in seconds


def task_pod_owner(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """An ownerReference to this task's pod (None outside a task pod): the garbage collector deletes what it
    owns once the pod is gone (the task killed, its pod deleted). No blockOwnerDeletion, which would need
    the right to update the pod's finalizers."""
    name, uid = environ.get(TASK_POD_NAME_ENV), environ.get(TASK_POD_UID_ENV)
    if not name or not uid:
        return None
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}


def task_timeout_s(environ: Mapping[str, str]) -> int | None:
    """The task's timeout in whole seconds (None when not given); ValueError for one that is not."""
    value = environ.get(TASK_TIMEOUT_ENV)
    if value is None or value == "":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{TASK_TIMEOUT_ENV}={value!r} is not a whole number of seconds > 0")
    return int(value)
