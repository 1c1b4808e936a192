"""A real running Airflow (api-server, scheduler, dag-processor, triggerer on 127.0.0.1, started the
way users start it) with the drafter DAGs, S3 on moto's server and credentials only in the
`aws_default` connection:

- drafter_data triggered through the REST API succeeds, publishes the dataset Asset, and the
  Asset-scheduled drafter_train runs and promotes; the registry shows the version.
- In Debian's chromium driven by playwright: log in, open drafter_train's trigger form, fill params,
  trigger; the run succeeds. The screenshots are kept in test-artifacts/.
- Alerts through Airflow's notifiers, their secrets only in connections made through the REST API: the
  promotion (the promote task's callback), the data run past its deadline (the scheduler and the
  triggerer), a gate rejection and a failed task reach a Slack webhook, a webhook and an SMTP server on
  127.0.0.1 (tests/conftest.py's sinks); no secret reaches a log.
- The deployment's served-acceptance watch: the triggerer polls a serving stand-in's /metrics all along
  (idle, it says nothing); once the fleet serves under the floor it starts a drafter_train run, which
  records that trigger.
- The deployment's target-revision watch: the triggerer polls another replica's /server_info and the
  S3 registry (with the aws_default connection's keys: its environment has none) all along; the
  production drafters promoted meanwhile match the served revision. Once that replica is restarted at
  another revision, it starts a drafter_data run that captures the served revision; a restarted
  triggerer, the revision still served, starts no second one (what it fired on is in S3).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests
import yaml

from harness import airflow_local
from tests.conftest import (
    CHROMIUM_ARGS,
    REPO,
    AlertSinks,
    free_port,
    metered_ngram_standin,
    storage_config,
    tiny_config_dict,
)

ARTIFACTS = REPO / "test-artifacts"
# distinctive so the log scan below cannot miss it; moto accepts any credentials
ACCESS_KEY, SECRET_KEY = "AKIADRAFTERLIVETEST", "drafter-live-secret-7f3a9c"
SLACK_TOKEN, WEBHOOK_TOKEN = "T0LIVE/B0LIVE/live-slack-token-2b7e", "live-webhook-token-e41c"
DEPLOYMENT = {
    "executor": "local",
    "aws_conn_id": "aws_default",
    "retry_delay_seconds": 5,
    "retrain_cron": None,  # only the Asset schedules drafter_train here
    "stages": {
        stage: {"use_pool": True, "retries": 0, "timeout_minutes": 20}
        for stage in ("generate", "parity", "capture", "train", "evaluate", "benchmark")
    },
    "notifiers": AlertSinks.NOTIFIERS,
    "deadline_minutes": {"drafter_data": 0.1},  # every data run here overruns 6 s: its deadline alert fires
}


def _alert_connections(sinks: AlertSinks) -> list[dict]:
    """The notifiers' connections as the REST API takes them (extra as a JSON string)."""
    return [
        {
            "connection_id": conn_id,
            **conn,
            **({"extra": json.dumps(conn["extra"])} if "extra" in conn else {}),
        }
        for conn_id, conn in sinks.connections(SLACK_TOKEN, WEBHOOK_TOKEN).items()
    ]


def _alerts(sinks: AlertSinks, event: str, marker: str, timeout_s: float = 120) -> dict:
    """The alert of this kind naming `marker`, as each notifier delivered it (waits for all three)."""
    deadline = time.monotonic() + timeout_s
    while True:
        slack = [
            json.loads(r["body"])["text"]
            for r in sinks.requests("/slack/")
            if marker in r["body"] and r["path"] == f"/slack/{SLACK_TOKEN}"
        ]
        webhook = [
            json.loads(r["body"])
            for r in sinks.requests("/hooks/drafter")
            if r["headers"].get("Authorization") == f"Bearer {WEBHOOK_TOKEN}"
        ]
        webhook = [hook for hook in webhook if hook["event"] == event and marker in json.dumps(hook)]
        mail = [m for m in sinks.emails() if marker in m["subject"] + m["body"]]
        slack = [text for text in slack if text.startswith(f"*{webhook[0]['subject']}*")] if webhook else []
        if slack and webhook and mail:
            return {"slack": slack[-1], "webhook": webhook[-1], "email": mail[-1]}
        assert time.monotonic() < deadline, f"no {event} alert naming {marker} reached every sink"
        time.sleep(2)


def _scan_for_secrets(home: Path) -> None:
    logs = "\n".join(p.read_text(errors="replace") for p in (home / "logs").rglob("*.log"))
    for secret in (SECRET_KEY, SLACK_TOKEN, WEBHOOK_TOKEN, AlertSinks.SMTP_PASSWORD):
        assert secret not in logs  # a connection's secret never reaches a log


class AirflowClient:
    """The REST API v2 with a bearer token from the simple auth manager's login."""

    def __init__(self, base: str, password: str):
        self.base = base
        token = requests.post(
            f"{base}/auth/token", json={"username": "admin", "password": password}, timeout=60
        )
        token.raise_for_status()
        self.headers = {"Authorization": f"Bearer {token.json()['access_token']}"}

    def call(self, method: str, path: str, **kwargs) -> requests.Response:
        return requests.request(
            method, f"{self.base}/api/v2{path}", headers=self.headers, timeout=60, **kwargs
        )

    def trigger(self, dag_id: str, conf: dict) -> str:
        """Start a run of `dag_id` with this trigger form; its run id."""
        response = self.call("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})
        assert response.status_code in (200, 201), response.text
        return response.json()["dag_run_id"]

    def get(self, path: str, **kwargs) -> dict:
        response = self.call("GET", path, **kwargs)
        response.raise_for_status()
        return response.json()

    def runs(self, dag_id: str) -> list[dict]:
        return self.get(f"/dags/{dag_id}/dagRuns", params={"limit": 100})["dag_runs"]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        instances = self.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        return {
            f"{ti['task_id']}[{ti['map_index']}]" if ti["map_index"] >= 0 else ti["task_id"]: ti["state"]
            for ti in instances["task_instances"]
        }

    def wait_for_run(self, dag_id: str, run_id: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.get(f"/dags/{dag_id}/dagRuns/{run_id}")
            if run["state"] in ("success", "failed"):
                return run
            time.sleep(3)
        raise AssertionError(
            f"{dag_id} run {run_id} did not finish in {timeout_s:.0f}s: {self.task_states(dag_id, run_id)}"
        )


def _wait_for_dags(client: AirflowClient, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        errors = client.get("/importErrors")
        assert errors["total_entries"] == 0, errors
        ids = {dag["dag_id"] for dag in client.get("/dags")["dags"]}
        if {"drafter_data", "drafter_train"} <= ids:
            return
        time.sleep(2)
    raise AssertionError("the dag-processor did not register drafter_data and drafter_train")


def _failure_detail(home: Path, client: AirflowClient, dag_id: str, run_id: str) -> str:
    lines = [f"{dag_id} {run_id}: {client.task_states(dag_id, run_id)}"]
    for log in sorted((home / "logs").rglob("*.log"))[-6:]:
        lines.append(f"--- {log.relative_to(home)}\n{log.read_text(errors='replace')[-3000:]}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def served_fleet(tiny_target_dir):
    """A serving replica (tests.conftest.metered_ngram_standin)."""
    with metered_ngram_standin(tiny_target_dir) as url:
        yield url


class RollingReplica:
    """A serving replica (the stand-in) on a port of its own, restarted at another --revision as a rolling
    update of the fleet would."""

    def __init__(self, target_dir: Path):
        self.target_dir, self.port = target_dir, free_port()
        self.server = None
        self.start(None)  # the tiny target's own revision (target.revision unset)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, revision: str | None) -> None:
        from harness.sglang_standin import StandinBackend, serve

        backend = StandinBackend(
            self.target_dir, None, "NGRAM", num_steps=3, draft_tokens=4, revision=revision
        )
        self.server = serve(backend, self.port)

    def roll(self, revision: str) -> None:
        self.stop()
        self.start(revision)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@pytest.fixture(scope="module")
def revision_replica(tiny_target_dir):
    replica = RollingReplica(tiny_target_dir)
    try:
        yield replica
    finally:
        replica.stop()


def _watching(fleet: str, replica: str) -> dict:
    """A served-acceptance watch no n-gram fleet can satisfy, that an idle fleet never trips, and a
    target-revision watch of another replica."""
    return {
        "served_acceptance": {
            "metrics_urls": [f"{fleet}/metrics"],
            "floor": 50.0,
            "window_s": 2.0,
            "min_verify_calls": 20,
            "poll_s": 1.0,
            "cooldown_s": 3600.0,
        },
        "target_revision": {"server_info_url": f"{replica}/server_info", "poll_s": 1.0},
    }


@pytest.fixture(scope="module")
def live_airflow(
    tmp_path_factory, s3_endpoint, tiny_target_dir, alert_sinks, live_config, served_fleet, revision_replica
):
    home = tmp_path_factory.mktemp("airflow-live")
    deployment = home / "deployment.yaml"
    # scheduled and watch-started runs take the run config
    watching = _watching(served_fleet, revision_replica.url)
    watched = {**DEPLOYMENT, "run_config": str(live_config["path"]), "watch": watching}
    deployment.write_text(yaml.safe_dump(watched))
    port = free_port()
    # the components get no AWS credentials: the tasks must take them from the aws_default connection
    env = {
        "DRAFTER_DEPLOYMENT": str(deployment),
        "AWS_ACCESS_KEY_ID": None,
        "AWS_SECRET_ACCESS_KEY": None,
        "AWS_DEFAULT_REGION": None,
        "AWS_PROFILE": None,
    }
    try:
        # two GPU-bound tasks at once, as the runbook's pool (docs/RUNBOOK.md): a data run's shards in pairs
        airflow_local.up(home, port, env=env, gpu_pool_slots=2)
        password = json.loads(airflow_local.login_file(home).read_text())["admin"]
        base = f"http://127.0.0.1:{port}"
        client = AirflowClient(base, password)
        response = client.call(
            "POST",
            "/connections",
            json={
                "connection_id": "aws_default",
                "conn_type": "aws",
                "login": ACCESS_KEY,
                "password": SECRET_KEY,
                "extra": json.dumps({"region_name": "us-east-1"}),
            },
        )
        assert response.status_code in (200, 201), response.text
        for connection in _alert_connections(alert_sinks):
            response = client.call("POST", "/connections", json=connection)
            assert response.status_code in (200, 201), response.text
        _wait_for_dags(client)
        yield {
            "home": home,
            "base": base,
            "client": client,
            "password": password,
            "sinks": alert_sinks,
            "env": env,
        }
    finally:
        airflow_local.down(home, grace_s=5)  # what a test leaves running is killed, not waited for


@pytest.fixture(scope="module")
def live_config(tmp_path_factory, s3_endpoint):
    tmp = tmp_path_factory.mktemp("airflow-live-config")
    data = tiny_config_dict(storage_config("s3", tmp, s3_endpoint))
    data["benchmark"].update(num_prompts=2, min_speedup_vs_incumbent=0.0)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return {"path": path, "data": data}


def _store(config_data: dict):
    from pipeline.storage import StorageConfig, open_store

    return open_store(StorageConfig(**config_data["storage"]))


@pytest.fixture(scope="module")
def first_promotion(live_airflow, live_config) -> dict:
    """drafter_data triggered through the REST API, and the drafter_train run its published dataset
    scheduled, both finished (the tests that need a production drafter, whatever ran before them)."""
    client, home = live_airflow["client"], live_airflow["home"]
    data_run = client.trigger(
        "drafter_data", {"config": str(live_config["path"]), "num_samples": 48, "shard_size": 16}
    )
    run = client.wait_for_run("drafter_data", data_run, timeout_s=900)
    assert run["state"] == "success", _failure_detail(home, client, "drafter_data", data_run)
    deadline = time.monotonic() + 120
    while not (train_run := _asset_scheduled_training(client, data_run)):
        assert time.monotonic() < deadline, "drafter_train was not scheduled by the published dataset"
        time.sleep(2)
    run = client.wait_for_run("drafter_train", train_run, timeout_s=900)
    assert run["state"] == "success", _failure_detail(home, client, "drafter_train", train_run)
    return {"data_run": data_run, "train_run": train_run}


def _asset_scheduled_training(client: AirflowClient, data_run: str) -> str | None:
    """The drafter_train run that the dataset `data_run` published scheduled, once there is one."""
    for run in client.runs("drafter_train"):
        # a run the scheduler has created but not started has no start_date, and Airflow's
        # upstreamAssetEvents then answers 500 (AssetEventResponse requires created_dagruns[].start_date,
        # api_fastapi/core_api/services/public/assets.py:44): ask again once it has started
        if run["run_type"] == "asset_triggered" and run["start_date"] is not None:
            events = client.get(f"/dags/drafter_train/dagRuns/{run['dag_run_id']}/upstreamAssetEvents")
            if any(event["source_run_id"] == data_run for event in events["asset_events"]):
                return run["dag_run_id"]
    return None


def test_rest_trigger_then_asset_scheduled_training_promotes(live_airflow, live_config, first_promotion):
    from pipeline.ops import registry

    client = live_airflow["client"]
    data_run, train_run = first_promotion["data_run"], first_promotion["train_run"]
    states = client.task_states("drafter_data", data_run)
    # one generate task per prompt shard: 48 conversations in shards of 16 per split and domain (the demo
    # corpus has two domains, each with a held-out set)
    from pipeline.ids import safe_id
    from pipeline.manifest import read_manifest

    prompt_shards = read_manifest(_store(live_config["data"]), f"prompts/{safe_id(data_run)}")["shards"]
    assert {(shard["split"], shard["domain"]) for shard in prompt_shards} == {
        (split, domain) for split in ("train", "eval") for domain in ("data-formats", "runtime")
    }
    assert sum(1 for name in states if name.startswith("generate_shard[")) == len(prompt_shards)
    assert set(states.values()) == {"success"}
    assert client.task_states("drafter_train", train_run)["promote"] == "success"
    # the report task says where the run report is: its extra link is the object's URL on the S3 endpoint
    links = client.get(f"/dags/drafter_train/dagRuns/{train_run}/taskInstances/report/links")["extra_links"]
    root = live_config["data"]["storage"]["root"][len("s3://") :]
    key = f"runs/{safe_id(train_run)}/report/report.html"
    assert links == {"Run report": f"{live_config['data']['storage']['endpoint_url']}/{root}/{key}"}
    page = _store(live_config["data"]).get_bytes(key).decode()
    assert f"Run {safe_id(train_run)}" in page and "promoted " in page

    store = _store(live_config["data"])
    versions = [v["version"] for v in registry.list_versions(store, "tiny-test")]
    promote = client.get(
        f"/dags/drafter_train/dagRuns/{train_run}/taskInstances/promote/xcomEntries/return_value",
        params={"deserialize": True},
    )
    assert promote.get("value") is not None, promote
    promoted_version = _xcom_value(promote)["version"]
    assert promoted_version in versions
    events = client.get("/assets/events", params={"limit": 10})["asset_events"]
    assert any(
        e["extra"].get("dataset_uri", "").startswith(live_config["data"]["storage"]["root"]) for e in events
    )

    # alerts: the promotion, from the promote task's callback, and the data run past its deadline
    sinks = live_airflow["sinks"]
    promoted = _alerts(sinks, "promotion", safe_id(train_run))
    assert promoted["webhook"]["version"] == promoted_version and promoted["webhook"]["alias"] == "production"
    assert set(promoted["webhook"]["speedups"]) >= {"baseline", "ngram"}
    assert promoted["webhook"]["report"] == links["Run report"]
    pull = f"--target tiny-test --alias {promoted_version} --dest ./drafters/tiny-test/{promoted_version}"
    assert (
        pull in promoted["webhook"]["pull_command"]
        and f"pull: {promoted['webhook']['pull_command']}" in promoted["slack"]
    )
    assert promoted["email"]["subject"] == f"drafter: tiny-test version {promoted_version} promoted"
    late = _alerts(sinks, "deadline", data_run)
    assert late["slack"].startswith(f"*drafter: drafter_data run {data_run} is past its deadline*")
    assert "deadline: 0.1 minutes after it was queued" in late["slack"] and "queued at 20" in late["slack"]
    assert late["webhook"]["dag_id"] == "drafter_data" and late["webhook"]["run_id"] == data_run
    _scan_for_secrets(live_airflow["home"])


def _xcom_value(response: dict):
    value = response["value"]
    return json.loads(value) if isinstance(value, str) else value


def _param_field(page, title: str):
    """The trigger form's input for the Param with this title (the field group its label names)."""
    label = page.locator("label", has_text=title)
    return page.get_by_role("group").filter(has=label).locator("input, textarea").first


def test_browser_login_trigger_form_and_successful_run(
    live_airflow, live_config, first_promotion, chromium, tmp_path
):
    """The form's run trains on the newest dataset of the target, warm from the production drafter."""
    from playwright.sync_api import sync_playwright

    from pipeline.ops import registry

    client, home = live_airflow["client"], live_airflow["home"]
    before = {r["dag_run_id"] for r in client.runs("drafter_train")}
    incumbent = registry.read_alias(_store(live_config["data"]), "tiny-test", "production")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{live_airflow['base']}/dags/drafter_train")
            page.get_by_label("Username").fill("admin")
            page.get_by_label("Password").fill(live_airflow["password"])
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url("**/dags/drafter_train", timeout=60_000)
            page.get_by_test_id("trigger-dag-button").click()
            _param_field(page, "Run config").fill(str(live_config["path"]))
            # a warm start from the first run's drafter (init auto), trained on: it must not trail it
            # more epochs than the incumbent's 3 on the same data: a drafter as good as the incumbent can be
            # timed "measurably slower" while the rehearsal loads the machine (CI, 2026-12-05: 0.703
            # [0.615, 0.804]), and a slower one is never promoted
            _param_field(page, "Epochs").fill("8")
            page.screenshot(path=str(ARTIFACTS / "airflow-trigger-form.png"))
            page.get_by_role("button", name="Trigger").last.click()

            deadline = time.monotonic() + 60
            while not (
                new := [
                    r
                    for r in client.runs("drafter_train")
                    if r["dag_run_id"] not in before and r["run_type"] == "manual"
                ]
            ):
                assert time.monotonic() < deadline, "the trigger form started no run"
                time.sleep(1)
            run_id = new[0]["dag_run_id"]
            assert new[0]["run_type"] == "manual"
            assert new[0]["conf"]["config"] == str(live_config["path"]) and new[0]["conf"]["epochs"] == 8
            run = client.wait_for_run("drafter_train", run_id, timeout_s=900)
            assert run["state"] == "success", _failure_detail(home, client, "drafter_train", run_id)
            page.goto(f"{live_airflow['base']}/dags/drafter_train/runs/{run_id}")
            page.get_by_text("success").first.wait_for(timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "airflow-run-success.png"))
            _the_run_report_renders(browser, live_config, run_id, tmp_path)
        finally:
            browser.close()
    assert (ARTIFACTS / "airflow-run-success.png").stat().st_size > 10_000
    assert (ARTIFACTS / "run-report.png").stat().st_size > 50_000
    states = client.task_states("drafter_train", run_id)
    assert states["gate"] == "success" and states["promote"] == "success", states
    store = _store(live_config["data"])
    promoted = registry.read_alias(store, "tiny-test", "production")
    assert promoted["version"] != (incumbent or {}).get(
        "version"
    )  # the UI-triggered run's drafter serves now
    assert promoted["version"] in [v["version"] for v in registry.list_versions(store, "tiny-test")]


def _the_run_report_renders(browser, live_config: dict, run_id: str, tmp_path: Path) -> None:
    """The run's report.html, opened from a file as a user opens it after `aws s3 cp`: self-contained, its
    outcome shown and every plot decoded."""
    from pipeline.ids import safe_id

    page_path = tmp_path / "report.html"
    page_path.write_bytes(_store(live_config["data"]).get_bytes(f"runs/{safe_id(run_id)}/report/report.html"))
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(page_path.as_uri())
    assert page.locator("#outcome").inner_text().startswith("promoted ")
    widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
    assert len(widths) == 4 and all(width > 300 for width in widths)  # every plot decoded
    page.screenshot(path=str(ARTIFACTS / "run-report.png"), full_page=True)


def test_a_rejected_candidate_and_a_failed_task_are_alerted(live_airflow, live_config, first_promotion):
    client, home, sinks = live_airflow["client"], live_airflow["home"], live_airflow["sinks"]
    # a candidate the gate rejects
    rejected_run = client.trigger(
        "drafter_train", {"config": str(live_config["path"]), "epochs": 1, "min_tau_simulated": 50}
    )
    run = client.wait_for_run("drafter_train", rejected_run, timeout_s=900)
    assert run["state"] == "success", _failure_detail(home, client, "drafter_train", rejected_run)
    assert client.task_states("drafter_train", rejected_run)["promote"] == "skipped"
    from pipeline.ids import safe_id

    rejected = _alerts(sinks, "rejection", safe_id(rejected_run))
    reasons = rejected["webhook"]["reasons"]
    assert any(reason.startswith("tau_simulated") and "< 50" in reason for reason in reasons), reasons
    assert f"reason: {reasons[0]}" in rejected["slack"] and "production is unchanged" in rejected["slack"]
    assert "&lt; 50" in rejected["email"]["body"]

    # a run whose config does not exist: configure fails for good, and says so
    missing = live_config["path"].with_name("missing.yaml")  # where run configs may be, but none is
    failed_run = client.trigger("drafter_train", {"config": str(missing)})
    run = client.wait_for_run("drafter_train", failed_run, timeout_s=300)
    assert run["state"] == "failed"
    failed = _alerts(sinks, "failure", failed_run)
    assert failed["webhook"]["task_id"] == "configure" and failed["webhook"]["dag_id"] == "drafter_train"
    assert "ConfigError" in failed["webhook"]["error"] and "missing.yaml" in failed["webhook"]["error"]
    assert failed["webhook"]["log_url"].endswith("/tasks/configure?try_number=1")
    assert failed["email"]["subject"] == "drafter: drafter_train task configure failed"
    _scan_for_secrets(home)


def test_served_acceptance_under_its_floor_starts_training_through_the_triggerer(
    live_airflow, live_config, served_fleet, first_promotion
):
    from pipeline import layout
    from pipeline.ids import safe_id

    client = live_airflow["client"]
    known = {run["dag_run_id"] for run in client.runs("drafter_train")}
    deadline, started = time.monotonic() + 240, []
    while not started:  # the fleet serves; its acceptance over the watch's window is under the floor
        assert time.monotonic() < deadline, "the served-acceptance watch started no drafter_train run"
        body = {"input_ids": [5, 6, 7, 5, 6, 7, 5, 6], "sampling_params": {"max_new_tokens": 16}}
        requests.post(f"{served_fleet}/generate", json=body, timeout=60).raise_for_status()
        started = [run for run in client.runs("drafter_train") if run["dag_run_id"] not in known]
    (run,) = started
    assert run["run_type"] == "asset_triggered"
    while (state := client.task_states("drafter_train", run["dag_run_id"]).get("triggered")) != "success":
        assert state not in ("failed", "upstream_failed", "skipped"), _failure_detail(
            live_airflow["home"], client, "drafter_train", run["dag_run_id"]
        )
        assert time.monotonic() < deadline, f"drafter_train {run['dag_run_id']}: triggered is {state}"
        time.sleep(2)
    key = layout.run_file_key(safe_id(run["dag_run_id"]), "trigger.json")
    record = json.loads(_store(live_config["data"]).get_bytes(key))
    assert record["trigger"]["kind"] == "served_acceptance" and record["skipped"] is None
    assert record["trigger"]["reason"].startswith("served acceptance length ")
    assert "under the floor 50.0" in record["trigger"]["reason"]


def test_another_target_revision_served_starts_a_data_run_through_the_triggerer(
    live_airflow, live_config, revision_replica, first_promotion
):
    """The production drafter was promoted for the revision the replica serves, so the watch stayed quiet;
    the replica restarted at another revision makes it start drafter_data, whose plan captures that
    revision. Reading the production drafter's lineage took the connection's S3 keys."""
    from pipeline.ops import registry

    client = live_airflow["client"]
    assert registry.read_alias(_store(live_config["data"]), "tiny-test", "production") is not None
    time.sleep(3)  # a few polls of the watch with production in place and the same revision served
    quiet = [run for run in client.runs("drafter_data") if run["run_type"] == "asset_triggered"]
    assert quiet == [], "the revision watch fired while the served revision was the production drafter's"
    revision_replica.roll("r-next")
    deadline, started = time.monotonic() + 180, []
    while not started:
        assert time.monotonic() < deadline, "the target-revision watch started no drafter_data run"
        time.sleep(2)
        started = [run for run in client.runs("drafter_data") if run["run_type"] == "asset_triggered"]
    (run,) = started
    while (state := client.task_states("drafter_data", run["dag_run_id"]).get("plan")) != "success":
        assert state not in ("failed", "upstream_failed", "skipped"), _failure_detail(
            live_airflow["home"], client, "drafter_data", run["dag_run_id"]
        )
        assert time.monotonic() < deadline, f"drafter_data {run['dag_run_id']}: plan is {state}"
        time.sleep(2)
    response = client.call(
        "GET",
        f"/dags/drafter_data/dagRuns/{run['dag_run_id']}/taskInstances/plan/xcomEntries/return_value",
        params={"deserialize": True},
    )
    assert response.status_code == 200, response.text
    plan = response.json()["value"]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    assert 'target.revision="r-next"' in plan["overrides"]
    assert plan["trigger"]["kind"] == "target_revision"
    assert (
        "at revision 'r-next'" in plan["trigger"]["reason"]
        and "for revision None" in plan["trigger"]["reason"]
    )
    # the triggerer restarts (a deploy, an evicted pod): what the watch fired on is in the store, so the
    # revision still served starts no second run
    log = live_airflow["home"] / "logs" / "triggerer.log"
    offset = log.stat().st_size
    airflow_local.restart(live_airflow["home"], "triggerer", env=live_airflow["env"], grace_s=5)
    deadline = time.monotonic() + 120
    # the triggerer names a trigger by its id only: the two asset watchers start first
    while log.read_text(errors="replace")[offset:].count(" starting ") < 2:
        assert time.monotonic() < deadline, "the restarted triggerer did not start the watches again"
        time.sleep(1)
    time.sleep(10)  # ten polls of the watch, the fleet still serving r-next
    again = [r for r in client.runs("drafter_data") if r["run_type"] == "asset_triggered"]
    assert [r["dag_run_id"] for r in again] == [run["dag_run_id"]], "the restarted watch fired again"
    _scan_for_secrets(live_airflow["home"])
