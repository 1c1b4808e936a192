"""Airflow triggers that watch the serving fleet: the AssetWatchers of drafter_data's and drafter_train's
watched Assets (dags/drafter_support.py), run by Airflow's triggerer.

They live in an installed package, not in dags/, because the triggerer imports a trigger by its
classpath and does not put the DAGs folder on sys.path. What they read and decide is in
pipeline.ops.watch; this module only polls it and turns a verdict into a TriggerEvent, whose payload
becomes the Asset event's extra (`{"from_trigger": true, "payload": ...}`) that the scheduled run reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from pipeline.ops.watch import (
    FleetWindow,
    ServedAcceptanceWatch,
    TargetRevisionWatch,
    acceptance_drift,
    check_revision,
    scrape_fleet,
    watch_state,
)
from pipeline.storage import S3Credentials

log = logging.getLogger(__name__)


class WatchTrigger(BaseEventTrigger):
    """A retraining watch the triggerer polls: its settings (a watch of the deployment config, as plain
    data), the run config whose store keeps what it fired on, and the S3 connection to reach that store."""

    def __init__(self, watch: dict[str, Any], run_config: str, aws_conn_id: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.watch, self.run_config, self.aws_conn_id = watch, run_config, aws_conn_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.{type(self).__name__}", {
            "watch": self.watch,
            "run_config": self.run_config,
            "aws_conn_id": self.aws_conn_id,
        }


class ServedAcceptanceTrigger(WatchTrigger):
    """Fires when the fleet's acceptance length averaged over a whole window (with enough verify passes)
    is under the floor; then not again for the cooldown, and only after a fresh window. The cooldown is
    kept in the run config's store (pipeline.ops.watch.WatchState), so a restarted triggerer keeps it."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        settings = ServedAcceptanceWatch.model_validate(self.watch)
        window = FleetWindow(settings.window_s)
        while True:
            try:
                window.add(await asyncio.to_thread(scrape_fleet, settings))
                payload = acceptance_drift(window, settings)
                if payload is not None:
                    credentials = await connection_credentials(self.aws_conn_id)
                    state = await asyncio.to_thread(watch_state, self.run_config, credentials)
                    if time.time() >= await asyncio.to_thread(state.quiet_until):
                        until = time.time() + settings.cooldown_s
                        await asyncio.to_thread(state.record_acceptance_fired, until)
                        log.warning("served acceptance: %s: retraining", payload["reason"])
                        yield TriggerEvent(payload)
                        window = FleetWindow(settings.window_s)
            except Exception as err:  # a watcher keeps polling: a server restarting is not the end
                log.warning("served acceptance: %s; polling again in %.0f s", err, settings.poll_s)
            await asyncio.sleep(settings.poll_s)


class TargetRevisionTrigger(WatchTrigger):
    """Fires once for each revision the fleet serves that differs from the production drafter's; the
    revisions it fired on are kept in the registry's store (pipeline.ops.watch.WatchState), so a restarted
    triggerer does not fire again. It reads the registry with the deployment's S3 connection (aws_conn_id)
    where it has one, as the tasks do."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        settings = TargetRevisionWatch.model_validate(self.watch)
        while True:
            try:
                credentials = await connection_credentials(self.aws_conn_id)
                payload = await asyncio.to_thread(check_revision, settings, self.run_config, credentials)
            except Exception as err:  # the fleet or the registry unreachable: poll again
                log.warning("target revision: %s; polling again in %.0f s", err, settings.poll_s)
            else:
                if payload is not None:
                    log.warning("target revision: %s: capturing it and retraining", payload["reason"])
                    yield TriggerEvent(payload)
            await asyncio.sleep(settings.poll_s)


async def connection_credentials(conn_id: str | None) -> S3Credentials | None:
    """The S3 keys of an Airflow connection, for one client; None without a connection id, or when the
    connection does not exist or has no login (boto3's own chain then: the pod's identity). Read at each
    poll, so that a rotated key is used; the triggerer's environment is left alone (other triggers share
    it)."""
    if not conn_id:
        return None
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException, AirflowRuntimeError

    try:
        return connection_keys(await Connection.async_get(conn_id))
    except (AirflowNotFoundException, AirflowRuntimeError):
        return None


def connection_keys(connection: Any) -> S3Credentials | None:
    """An Airflow connection's S3 keys (login, password, extra region_name); None without a connection or
    a login. The tasks export them (dags/drafter_support.py); the triggers hand them to one client."""
    if connection is None or not connection.login:
        return None
    region = (connection.extra_dejson or {}).get("region_name")
    return S3Credentials(connection.login, connection.password or "", region)
