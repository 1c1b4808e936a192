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

import json
import re
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import requests
from pydantic import Field, HttpUrl, field_validator, model_validator

from pipeline.config_base import Strict
from pipeline.credentials import refuse_credentials
from pipeline.layout import WatchName, watch_state_key

if TYPE_CHECKING:
    from pipeline.storage import S3Credentials

GENERATED = "sglang:generation_tokens_total"
VERIFY_CALLS = "sglang:spec_verify_calls_total"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# the triggerer scrapes servers without credentials: they would reach the deployment config and its logs
_METRICS_CREDENTIALS = "the serving fleet's /metrics and /server_info are read without credentials"


class WatchError(RuntimeError):
    """A watched server could not be read; the trigger logs it and polls again."""


class ServedAcceptanceWatch(Strict):
    """Retrain when the fleet's acceptance length stays under `floor` for a whole window. Each replica is
    read apart (its counters are its own): by a headless Service's name that lists every replica
    (`replicas_url`), or by a list of each replica's address (`metrics_urls`); never a load balancer, whose
    answers would come from a different replica each time."""

    metrics_urls: list[HttpUrl] = Field(default_factory=list, description="each serving replica's /metrics")
    replicas_url: HttpUrl | None = Field(
        None,
        description="/metrics under a headless Service's name: every address the name resolves to is a "
        "replica, scraped apart, at each poll",
    )
    floor: float = Field(gt=1.0, description="acceptance length (tokens per verify pass) to stay above")
    window_s: float = Field(3600.0, gt=0, description="the acceptance is averaged over this long")
    min_verify_calls: int = Field(
        1000, ge=1, description="a window with fewer verify passes says nothing (an idle fleet)"
    )
    poll_s: float = Field(60.0, gt=0, description="how often the servers are scraped")
    cooldown_s: float = Field(
        86400.0, ge=0, description="after a trigger, none again for this long (the retraining runs)"
    )

    @field_validator("metrics_urls", "replicas_url")
    @classmethod
    def _urls_without_credentials(cls, urls: Any) -> Any:
        for url in urls if isinstance(urls, list) else [urls]:
            if url is not None:
                refuse_credentials(str(url), "a watched replica's URL", _METRICS_CREDENTIALS)
        return urls

    @model_validator(mode="after")
    def _replicas_one_way(self) -> ServedAcceptanceWatch:
        if bool(self.metrics_urls) == (self.replicas_url is not None):
            raise ValueError(
                "name the replicas one way: replicas_url (a headless Service's /metrics) or metrics_urls "
                "(each replica's)"
            )
        return self


class TargetRevisionWatch(Strict):
    """Retrain when the fleet serves another revision of the target than the production drafter's."""

    server_info_url: HttpUrl = Field(
        description="a serving replica's /server_info (SGLang 0.5.23; /get_server_info is deprecated there "
        "and logs a warning at each call)"
    )
    poll_s: float = Field(300.0, gt=0)

    @field_validator("server_info_url")
    @classmethod
    def _url_without_credentials(cls, url: HttpUrl) -> HttpUrl:
        refuse_credentials(str(url), "watch.target_revision.server_info_url", _METRICS_CREDENTIALS)
        return url


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


def replica_urls(watch: ServedAcceptanceWatch, resolve=socket.getaddrinfo) -> list[str]:
    """Each replica's /metrics: metrics_urls as listed, or replicas_url once per address its host resolves
    to now (a headless Service's name: its ready pods)."""
    if watch.replicas_url is None:
        return [str(url) for url in watch.metrics_urls]
    url = urlsplit(str(watch.replicas_url))
    try:
        found = resolve(url.hostname, url.port or 80, proto=socket.IPPROTO_TCP)
    except socket.gaierror as err:
        raise WatchError(f"cannot resolve {url.hostname}: {err}") from err
    addresses = sorted({info[4][0] for info in found})
    return [
        urlunsplit(
            (url.scheme, f"[{ip}]:{url.port}" if ":" in ip else f"{ip}:{url.port}", url.path, url.query, "")
        )
        for ip in addresses
    ]


def scrape(url: str, timeout_s: float = 10.0) -> FleetSample:
    """One sample of one server's counters."""
    try:
        response = requests.get(url, timeout=timeout_s)
        response.raise_for_status()
    except requests.RequestException as err:
        raise WatchError(f"cannot read {url}: {err}") from err
    if "sglang:" not in response.text:
        raise WatchError(f"{url} exports no sglang: metrics; is the server started with --enable-metrics?")
    totals = metric_totals(response.text, (GENERATED, VERIFY_CALLS))
    return FleetSample(time.time(), totals[GENERATED], totals[VERIFY_CALLS])


def scrape_fleet(watch: ServedAcceptanceWatch) -> dict[str, FleetSample]:
    """One sample of each replica's counters, by its URL; a replica that cannot be read fails the poll."""
    return {url: scrape(url) for url in replica_urls(watch)}


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

    replicas = 1

    def span(self) -> tuple[float, float, float]:
        """Seconds covered, tokens generated and verify passes made between the oldest and newest sample."""
        if len(self.samples) < 2:
            return 0.0, 0.0, 0.0
        first, last = self.samples[0], self.samples[-1]
        return last.at - first.at, last.generated - first.generated, last.verify_calls - first.verify_calls


@dataclass
class FleetWindow:
    """Each replica's window apart (a replica's counters are its own; a restart starts only its window
    again). The fleet's span is over the replicas whose windows are whole: the shortest of their spans,
    and their tokens and verify passes summed. A replica no longer listed leaves the fleet."""

    window_s: float
    replicas_seen: dict[str, AcceptanceWindow] = field(default_factory=dict)

    def add(self, samples: dict[str, FleetSample]) -> None:
        for gone in set(self.replicas_seen) - set(samples):
            del self.replicas_seen[gone]
        for replica, sample in samples.items():
            self.replicas_seen.setdefault(replica, AcceptanceWindow(self.window_s)).add(sample)

    def _whole(self) -> list[tuple[float, float, float]]:
        spans = [window.span() for window in self.replicas_seen.values()]
        return [span for span in spans if span[0] >= self.window_s]

    @property
    def replicas(self) -> int:
        return len(self._whole())

    def span(self) -> tuple[float, float, float]:
        whole = self._whole()
        if not whole:
            return 0.0, 0.0, 0.0
        return min(s[0] for s in whole), sum(s[1] for s in whole), sum(s[2] for s in whole)


def acceptance_drift(
    window: AcceptanceWindow | FleetWindow, watch: ServedAcceptanceWatch
) -> dict[str, Any] | None:
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
        f"{seconds:.0f} s ({int(verify_calls)} verify passes, {window.replicas} server(s))",
    }


def served_revision(server_info_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The model and revision a serving replica runs: SGLang's /server_info holds its server args
    (`model_path`, `revision`; None: the repository's default branch)."""
    try:
        response = requests.get(server_info_url, timeout=timeout_s)
        response.raise_for_status()
        info = response.json()
    except (requests.RequestException, ValueError) as err:
        raise WatchError(f"cannot read {server_info_url}: {err}") from err
    if "model_path" not in info:
        raise WatchError(f"{server_info_url} is not an SGLang /server_info (no model_path)")
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
    registry the run config names (read with `credentials` when given: the deployment's connection). A
    revision the watch fired on before (its WatchState in that store) is not fired on again; one it fires on
    now is recorded there before the payload is returned."""
    from pipeline.config import load_config
    from pipeline.storage import open_store

    config = load_config(run_config)
    store = open_store(config.storage, credentials)
    production = production_target(store, config.target.name, config.registry.alias)
    payload = revision_change(served_revision(str(watch.server_info_url)), production)
    if payload is None:
        return None
    state = WatchState(store, config.target.name)
    if payload["served_revision"] in state.fired_revisions():
        return None
    state.record_revision(payload["served_revision"])
    return payload


@dataclass
class WatchState:
    """What a watch has fired on, in the object store beside the registry it watches
    (layout.watch_state_key): the served revisions the revision watch started a data run for, and until
    when the acceptance watch stays quiet after it started a training run. A triggerer that restarts
    reads it again instead of firing again; written before the trigger's event, so an event is never sent
    twice for one revision (a crash between the two loses that event, and the run is started by hand)."""

    store: Any
    target: str

    def _read(self, watch: WatchName) -> dict[str, Any]:
        found = self.store.read_with_tag(watch_state_key(self.target, watch))
        return json.loads(found[0]) if found else {}

    def _write(self, watch: WatchName, state: dict[str, Any]) -> None:
        self.store.put_bytes(watch_state_key(self.target, watch), json.dumps(state, sort_keys=True).encode())

    def fired_revisions(self) -> list[str | None]:
        return list(self._read("target_revision").get("fired", []))

    def record_revision(self, revision: str | None) -> None:
        state = self._read("target_revision")
        fired = list(state.get("fired", []))
        if revision not in fired:
            self._write("target_revision", {**state, "fired": [*fired, revision]})

    def quiet_until(self) -> float:
        return float(self._read("served_acceptance").get("quiet_until", 0.0))

    def record_acceptance_fired(self, until: float) -> None:
        self._write("served_acceptance", {"quiet_until": until, "fired_at": time.time()})


def watch_state(run_config: str, credentials: S3Credentials | None = None) -> WatchState:
    """The watch state of the run config's target, in its store (read with `credentials` when given)."""
    from pipeline.config import load_config
    from pipeline.storage import open_store

    config = load_config(run_config)
    return WatchState(open_store(config.storage, credentials), config.target.name)


def survey(watch: RetrainWatch | None, run_config: str) -> list[str]:
    """What each retraining watch reads now, polled once as the triggerer polls it (the same code, the
    same run config), firing nothing and recording nothing: a check to run where the triggerer runs, with
    its mounts and identity. Raises what the triggerer would only log at each poll: a run config it cannot
    load, a replica it cannot resolve or read, a registry it cannot read."""
    if watch is None or (watch.served_acceptance is None and watch.target_revision is None):
        return ["no retraining watches in this deployment"]
    lines = []
    if watch.served_acceptance is not None:
        settings = watch.served_acceptance
        samples = scrape_fleet(settings)
        lines.append(
            f"served acceptance: {len(samples)} replica(s) read apart; floor {settings.floor} over "
            f"{settings.window_s:.0f} s"
        )
        for url, sample in samples.items():
            ratio = sample.generated / sample.verify_calls if sample.verify_calls else None
            shown = f"{ratio:.3f} tokens per verify pass" if ratio is not None else "no verify pass yet"
            lines.append(
                f"  {url}: {sample.generated:.0f} tokens, {sample.verify_calls:.0f} verify passes: {shown}"
            )
    if watch.target_revision is not None:
        lines.append(_revision_line(watch.target_revision, run_config))
    return lines


def _revision_line(watch: TargetRevisionWatch, run_config: str) -> str:
    from pipeline.config import load_config
    from pipeline.storage import open_store

    config = load_config(run_config)
    store = open_store(config.storage)
    served = served_revision(str(watch.server_info_url))
    production = production_target(store, config.target.name, config.registry.alias)
    seen = f"target revision: {watch.server_info_url} serves {served['model_path']} at {served['revision']!r}"
    if production is None:
        return f"{seen}; no {config.registry.alias} drafter of {config.target.name} yet: nothing to compare"
    trained = production["target"].get("revision")
    verdict = "the same" if trained == served["revision"] else "another"
    if verdict == "another":
        fired = served["revision"] in WatchState(store, config.target.name).fired_revisions()
        verdict += ": already fired on" if fired else ": the watch fires"
    drafter = f"{config.registry.alias} drafter {production['version']}"
    return f"{seen}; {drafter} was trained for {trained!r}: {verdict}"
