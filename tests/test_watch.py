"""The retraining watches, without Airflow: served acceptance read from SGLang's /metrics (the stand-in's
counters, over real HTTP) averaged over a window against a floor, and the served target revision against
the production drafter's."""

from __future__ import annotations

import pytest
import requests

from pipeline.ops.watch import (
    GENERATED,
    VERIFY_CALLS,
    AcceptanceWindow,
    FleetSample,
    ServedAcceptanceWatch,
    TargetRevisionWatch,
    WatchError,
    acceptance_drift,
    check_revision,
    metric_totals,
    production_target,
    revision_change,
    scrape,
    served_revision,
)
from tests.conftest import metered_ngram_standin

EXPOSITION = """# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="a {odd} name",is_streaming="false"} 300.0
sglang:generation_tokens_total{model_name="a {odd} name",is_streaming="true"} 100.0
sglang:spec_verify_calls_total{model_name="m"} 160.0 1733212345000
sglang:spec_verify_calls_total_other 5
sglang:num_requests_total{model_name="m",is_streaming="false"} 9.0
"""


def test_counters_are_summed_over_their_label_sets():
    totals = metric_totals(EXPOSITION, (GENERATED, VERIFY_CALLS))
    assert totals == {GENERATED: 400.0, VERIFY_CALLS: 160.0}
    assert metric_totals("", (GENERATED,)) == {GENERATED: 0.0}  # nothing counted yet


def _watch(**settings) -> ServedAcceptanceWatch:
    return ServedAcceptanceWatch.model_validate(
        {"metrics_urls": ["http://127.0.0.1:1/metrics"], "floor": 2.0, "window_s": 100, **settings}
        | {"min_verify_calls": settings.get("min_verify_calls", 10)}
    )


def test_a_whole_window_under_the_floor_triggers_and_a_partial_or_idle_one_does_not():
    watch, window = _watch(), AcceptanceWindow(100)
    window.add(FleetSample(0.0, 1000.0, 200.0))
    window.add(FleetSample(60.0, 1150.0, 300.0))  # 1.5 tokens per verify pass, but only 60 s of the window
    assert acceptance_drift(window, watch) is None
    window.add(FleetSample(120.0, 1300.0, 400.0))
    payload = acceptance_drift(window, watch)
    assert payload is not None and payload["trigger"] == "served_acceptance"
    assert payload["accept_length"] == 1.5 and payload["verify_calls"] == 200 and payload["window_s"] == 120
    assert payload["reason"].startswith(
        "served acceptance length 1.500 under the floor 2.0 over the last 120 s"
    )
    # samples older than the window are dropped, but the one just before it is kept to cover it
    window.add(FleetSample(250.0, 1900.0, 500.0))
    assert [s.at for s in window.samples] == [120.0, 250.0] and window.span() == (130.0, 600.0, 100.0)
    assert acceptance_drift(window, watch) is None  # 6 tokens per pass: above the floor
    idle = AcceptanceWindow(100)
    for at in (0.0, 50.0, 110.0):
        idle.add(FleetSample(at, 1000.0 + at / 10, 200.0 + at / 100))  # about 1 verify pass in the window
    assert acceptance_drift(idle, watch) is None


def test_a_server_restart_starts_the_window_again():
    window = AcceptanceWindow(100)
    window.add(FleetSample(0.0, 1000.0, 200.0))
    window.add(FleetSample(60.0, 1100.0, 250.0))
    window.add(FleetSample(70.0, 1200.0, 10.0))  # its verify counter began again
    assert [s.at for s in window.samples] == [70.0] and window.span() == (0.0, 0.0, 0.0)


def test_a_floor_at_or_under_one_token_per_pass_is_refused():
    with pytest.raises(ValueError, match="floor"):
        _watch(floor=1.0)


@pytest.fixture(scope="module")
def ngram_server(tiny_target_dir):
    """A serving replica of revision r2 (tests.conftest.metered_ngram_standin)."""
    with metered_ngram_standin(tiny_target_dir, "r2") as url:
        yield url


def test_the_served_acceptance_is_what_the_requests_meta_info_reports(ngram_server):
    before = scrape([f"{ngram_server}/metrics"])
    tokens = verify_passes = 0
    for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [3, 4, 3, 4, 3, 4]):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
        meta = requests.post(f"{ngram_server}/generate", json=body, timeout=120).json()["meta_info"]
        tokens, verify_passes = tokens + meta["completion_tokens"], verify_passes + meta["spec_verify_ct"]
    after = scrape([f"{ngram_server}/metrics"])
    window = AcceptanceWindow(window_s=3600.0)
    window.add(before)
    window.add(after)
    _, generated, verify_calls = window.span()
    assert (generated, verify_calls) == (tokens, verify_passes) and verify_passes > 0
    served = generated / verify_calls
    assert served > 1.05  # the repeated prompts give n-gram drafts that the target accepts
    above = acceptance_drift(window, _watch(window_s=1e-3, min_verify_calls=1, floor=served + 0.01))
    assert above is not None and above["accept_length"] == round(tokens / verify_passes, 4)
    assert acceptance_drift(window, _watch(window_s=1e-3, min_verify_calls=1, floor=served - 0.05)) is None


def test_a_server_without_metrics_is_a_clear_error(tiny_target_dir):
    from pipeline.dev.sglang_standin import StandinBackend, serve

    server = serve(StandinBackend(tiny_target_dir, None))
    try:
        with pytest.raises(WatchError, match="cannot read"):
            scrape([f"http://127.0.0.1:{server.server_port}/metrics"])
    finally:
        server.shutdown()


def _production(
    store, target: str, revision: str | None, alias: str = "production", version: str = "v1"
) -> None:
    """A production drafter `version` trained for `revision` (its registry manifest's lineage)."""
    from pipeline import layout
    from pipeline.manifest import publish
    from pipeline.ops import registry

    lineage = {
        "dataset": "s3://b/datasets/d1",
        "contract": {"target": {"model_path": "m", "revision": revision}},
    }
    publish(store, layout.drafter_version_prefix(target, version), "drafter", [], {"lineage": lineage})
    registry.move_alias(store, target, alias, version, "test")


def test_the_served_revision_against_the_production_drafters(ngram_server, tiny_target_dir, tmp_path):
    from pipeline.config import StorageConfig
    from pipeline.storage import open_store

    served = served_revision(f"{ngram_server}/get_server_info")
    assert served["revision"] == "r2" and served["model_path"] == str(tiny_target_dir)
    store = open_store(StorageConfig(root=str(tmp_path / "store")))
    assert revision_change(served, production_target(store, "tiny", "production")) is None  # none yet
    _production(store, "tiny", "r1")
    production = production_target(store, "tiny", "production")
    assert production == {
        "version": "v1",
        "dataset": "s3://b/datasets/d1",
        "target": {"model_path": "m", "revision": "r1"},
    }
    change = revision_change(served, production)
    assert change is not None and (change["served_revision"], change["drafter_revision"]) == ("r2", "r1")
    assert "at revision 'r2'; production drafter v1 was trained for revision 'r1'" in change["reason"]
    assert revision_change({**served, "revision": "r1"}, production) is None
    with pytest.raises(WatchError, match="not an SGLang /get_server_info"):
        served_revision(f"{ngram_server}/health")


def test_one_poll_of_the_revision_watch_reads_the_registry_the_run_config_names(ngram_server, tmp_path):
    import yaml

    from pipeline.config import load_config
    from pipeline.storage import open_store
    from tests.conftest import storage_config, tiny_config_dict

    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config_dict(storage_config("file", tmp_path, None))))
    config = load_config(config_path)
    watch = TargetRevisionWatch(server_info_url=f"{ngram_server}/get_server_info")
    assert check_revision(watch, str(config_path)) is None  # nothing in production
    _production(open_store(config.storage), config.target.name, "r1", config.registry.alias)
    change = check_revision(watch, str(config_path))
    assert change is not None and change["served_revision"] == "r2"


def test_the_revision_poll_reads_an_s3_registry_with_the_keys_it_is_handed(
    ngram_server, tmp_path, s3_endpoint, monkeypatch
):
    """The triggerer's environment has no keys (the deployment's connection holds them): the poll's client
    takes the connection's, and they never show in a repr."""
    import boto3
    import botocore.exceptions
    import yaml

    from pipeline.config import load_config
    from pipeline.storage import S3Credentials, open_store
    from tests.conftest import storage_config, tiny_config_dict

    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config_dict(storage_config("s3", tmp_path, s3_endpoint))))
    config = load_config(config_path)
    _production(open_store(config.storage), config.target.name, "r1", config.registry.alias)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials-file"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config-file"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # it would keep the keys it found before
    watch = TargetRevisionWatch(server_info_url=f"{ngram_server}/get_server_info")
    with pytest.raises(botocore.exceptions.NoCredentialsError):
        check_revision(watch, str(config_path))
    keys = S3Credentials("AKIACONNECTION", "connection-secret-9d2e", "us-east-1")
    change = check_revision(watch, str(config_path), keys)
    assert change is not None and change["served_revision"] == "r2"
    assert "connection-secret-9d2e" not in repr(keys) and "AKIACONNECTION" in repr(keys)


def test_each_run_says_what_started_it():
    from pipeline.tasks import describe_trigger, plan_data, plan_training

    assert describe_trigger("scheduled", [], "0 4 * * 0") == {
        "kind": "cron",
        "reason": "the retraining cron (0 4 * * 0)",
    }
    assert describe_trigger("manual", [], None)["kind"] == "manual"
    assert describe_trigger("backfill", [], None) == {"kind": "backfill", "reason": "an Airflow backfill run"}
    drift = {"trigger": "served_acceptance", "reason": "served acceptance length 1.900 under the floor 2.5"}
    watched = [{"from_trigger": True, "payload": drift}]
    expected = {"kind": "served_acceptance", "reason": drift["reason"]}
    assert describe_trigger("asset_triggered", watched, None) == expected
    # an acceptance drift trains on the newest dataset: no dataset in its event
    plan = plan_training({"config": "c.yaml"}, "asset_triggered__x", watched, "c.yaml", "asset_triggered")
    assert plan["dataset_uri"] is None and plan["trigger"] == expected
    # the fleet serving another revision: the data run captures that revision, and the training run it
    # publishes a dataset for says so
    change = {"trigger": "target_revision", "served_revision": "r2", "reason": "the fleet serves m at 'r2'"}
    events = [{"from_trigger": True, "payload": change}]
    data = plan_data({"config": "c.yaml"}, "asset_triggered__y", "asset_triggered", events, "c.yaml")
    assert data["overrides"][-1] == 'target.revision="r2"' and data["trigger"]["kind"] == "target_revision"
    published = {"dataset_uri": "s3://b/d2", "config": "c.yaml", "overrides": data["overrides"]}
    plan = plan_training(
        {}, "asset_triggered__z", [published | {"trigger": data["trigger"]}], "c.yaml", "asset_triggered"
    )
    assert plan["dataset_uri"] == "s3://b/d2" and plan["overrides"] == ['target.revision="r2"']
    assert plan["trigger"] == {
        "kind": "dataset",
        "reason": "dataset s3://b/d2 published (its data run: the fleet serves m at 'r2')",
    }


def test_a_cron_run_trains_unless_the_production_drafter_has_its_dataset(tmp_path):
    """Here a newer dataset; test_dags runs the cron on the production drafter's own dataset."""
    from pipeline.config import load_config
    from pipeline.storage import open_store
    from pipeline.tasks import nothing_new
    from tests.conftest import storage_config, tiny_config_dict

    config = load_config(data=tiny_config_dict(storage_config("file", tmp_path, None)))
    store = open_store(config.storage)
    assert nothing_new(config, store, "s3://b/datasets/d1") is None  # nothing in production
    _production(store, config.target.name, "r1", config.registry.alias)
    assert nothing_new(config, store, "s3://b/datasets/d2") is None
