"""What retrains a drafter besides a published dataset and the cron, read without Airflow: the serving
fleet's acceptance falling under a floor over a window, and the target revision the fleet serves moving
away from the one the production drafter was trained for. The Airflow triggers that poll these
(drafter_triggers, in the triggerer) only call what is here.

Served acceptance comes from SGLang's Prometheus endpoint (`/metrics`, servers started with
--enable-metrics). SGLang 0.5.23's TokenizerMetricsCollector.observe_one_finished_request
(python/sglang/srt/observability/metrics_collector.py) adds each finished request's completion tokens to
the counter `sglang:generation_tokens_total` and its verify passes (meta_info `spec_verify_ct`) to
`sglang:spec_verify_calls_total`. Their increase over a window, divided, is the window's acceptance
length: tokens per verify pass, what each request's meta_info `spec_accept_length` is for that request.
The gauges `sglang:spec_accept_length` and `sglang:spec_accept_rate` hold only the latest logging
interval's mean (multiprocess_mode "mostrecent"), so no window can be averaged from them.
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import requests
from pydantic import Field, HttpUrl

from pipeline.config import Strict

if TYPE_CHECKING:
    from pipeline.storage import S3Credentials

GENERATED = "sglang:generation_tokens_total"
VERIFY_CALLS = "sglang:spec_verify_calls_total"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class WatchError(RuntimeError):
    """A watched server could not be read; the trigger logs it and polls again."""


class ServedAcceptanceWatch(Strict):
    """Retrain when the fleet's acceptance length stays under `floor` for a whole window."""

    metrics_urls: list[HttpUrl] = Field(min_length=1, description="each serving replica's /metrics")
    floor: float = Field(gt=1.0, description="acceptance length (tokens per verify pass) to stay above")
    window_s: float = Field(3600.0, gt=0, description="the acceptance is averaged over this long")
    min_verify_calls: int = Field(
        1000, ge=1, description="a window with fewer verify passes says nothing (an idle fleet)"
    )
    poll_s: float = Field(60.0, gt=0, description="how often the servers are scraped")
    cooldown_s: float = Field(
        86400.0, ge=0, description="after a trigger, none again for this long (the retraining runs)"
    )


class TargetRevisionWatch(Strict):
    """Retrain when the fleet serves another revision of the target than the production drafter's."""

    server_info_url: HttpUrl = Field(description="a serving replica's /get_server_info (SGLang)")
    poll_s: float = Field(300.0, gt=0)


class RetrainWatch(Strict):
    """The deployment's retraining triggers besides the cron and a published dataset."""

    served_acceptance: ServedAcceptanceWatch | None = None
    target_revision: TargetRevisionWatch | None = None


def metric_totals(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each named metric summed over its label sets, from Prometheus' text exposition format."""
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _NAME.match(line)
        if match is None or match.group(0) not in totals:
            continue
        rest = line[match.end() :]
        if rest.startswith("{"):
            rest = rest[rest.rindex("}") + 1 :]
        totals[match.group(0)] += float(rest.split()[0])
    return totals


@dataclass(frozen=True)
class FleetSample:
    """The fleet's counters at one moment, summed over its servers."""

    at: float
    generated: float
    verify_calls: float


def scrape(urls: list[str], timeout_s: float = 10.0) -> FleetSample:
    """One sample of every server's counters; a server that cannot be read fails the whole sample."""
    generated = verify_calls = 0.0
    for url in urls:
        try:
            response = requests.get(url, timeout=timeout_s)
            response.raise_for_status()
        except requests.RequestException as err:
            raise WatchError(f"cannot read {url}: {err}") from err
        if "sglang:" not in response.text:
            raise WatchError(
                f"{url} exports no sglang: metrics; is the server started with --enable-metrics?"
            )
        totals = metric_totals(response.text, (GENERATED, VERIFY_CALLS))
        generated += totals[GENERATED]
        verify_calls += totals[VERIFY_CALLS]
    return FleetSample(time.time(), generated, verify_calls)


@dataclass
class AcceptanceWindow:
    """The fleet's samples over the last `window_s` seconds (and the one just before, so that the span
    covers the whole window). A counter that went down means a server restarted: the window starts again."""

    window_s: float
    samples: deque[FleetSample] = field(default_factory=deque)

    def add(self, sample: FleetSample) -> None:
        last = self.samples[-1] if self.samples else None
        if last is not None and (
            sample.generated < last.generated or sample.verify_calls < last.verify_calls
        ):
            self.samples.clear()
        self.samples.append(sample)
        while len(self.samples) > 1 and self.samples[1].at <= sample.at - self.window_s:
            self.samples.popleft()

    def span(self) -> tuple[float, float, float]:
        """Seconds covered, tokens generated and verify passes made between the oldest and newest sample."""
        if len(self.samples) < 2:
            return 0.0, 0.0, 0.0
        first, last = self.samples[0], self.samples[-1]
        return last.at - first.at, last.generated - first.generated, last.verify_calls - first.verify_calls


def acceptance_drift(window: AcceptanceWindow, watch: ServedAcceptanceWatch) -> dict[str, Any] | None:
    """The trigger's payload when a whole window with enough verify passes averaged under the floor."""
    seconds, generated, verify_calls = window.span()
    if seconds < watch.window_s or verify_calls < watch.min_verify_calls:
        return None
    length = generated / verify_calls
    if length >= watch.floor:
        return None
    length = round(length, 4)  # the reason states the figure the payload carries, rounded once
    return {
        "trigger": "served_acceptance",
        "accept_length": length,
        "floor": watch.floor,
        "window_s": round(seconds, 1),
        "verify_calls": int(verify_calls),
        "reason": f"served acceptance length {length:.3f} under the floor {watch.floor} over the last "
        f"{seconds:.0f} s ({int(verify_calls)} verify passes, {len(watch.metrics_urls)} server(s))",
    }


def served_revision(server_info_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The model and revision a serving replica runs: SGLang's /get_server_info holds its server args
    (`model_path`, `revision`; None: the repository's default branch)."""
    try:
        response = requests.get(server_info_url, timeout=timeout_s)
        response.raise_for_status()
        info = response.json()
    except (requests.RequestException, ValueError) as err:
        raise WatchError(f"cannot read {server_info_url}: {err}") from err
    if "model_path" not in info:
        raise WatchError(f"{server_info_url} is not an SGLang /get_server_info (no model_path)")
    return {"model_path": info["model_path"], "revision": info.get("revision")}


def production_target(store, target: str, alias: str) -> dict[str, Any] | None:
    """The version behind `alias` and the target identity it was trained for (its lineage's capture
    contract), or None without one."""
    from pipeline import layout
    from pipeline.manifest import read_manifest
    from pipeline.ops import registry

    record = registry.read_alias(store, target, alias)
    if record is None:
        return None
    manifest = read_manifest(store, layout.drafter_version_prefix(target, record["version"]), kind="drafter")
    lineage = manifest["lineage"]
    return {
        "version": record["version"],
        "dataset": lineage["dataset"],
        "target": lineage["contract"]["target"],
    }


def revision_change(served: dict[str, Any], production: dict[str, Any] | None) -> dict[str, Any] | None:
    """The trigger's payload when the fleet serves another revision than the production drafter's."""
    if production is None:
        return None
    trained = production["target"].get("revision")
    if served["revision"] == trained:
        return None
    return {
        "trigger": "target_revision",
        "served_revision": served["revision"],
        "drafter_revision": trained,
        "drafter_version": production["version"],
        "reason": f"the fleet serves {served['model_path']} at revision {served['revision']!r}; production "
        f"drafter {production['version']} was trained for revision {trained!r}",
    }


def check_revision(
    watch: TargetRevisionWatch, run_config: str, credentials: S3Credentials | None = None
) -> dict[str, Any] | None:
    """One poll of the revision watch: the fleet's revision against the production drafter's, whose
    registry the run config names (read with `credentials` when given: the deployment's connection)."""
    from pipeline.config import load_config
    from pipeline.storage import open_store

    config = load_config(run_config)
    store = open_store(config.storage, credentials)
    production = production_target(store, config.target.name, config.registry.alias)
    return revision_change(served_revision(str(watch.server_info_url)), production)
