"""The retraining watches, without Airflow: served acceptance read from SGLang's /metrics (the stand-in's
counters, over real HTTP) averaged over a window against a floor, and the served target revision against
the production drafter's."""

from __future__ import annotations

import pytest
import requests

from pipeline.ops.watch import (
    AcceptanceWindow,
    TargetRevisionWatch,
    WatchError,
    acceptance_drift,
    check_revision,
    production_target,
    revision_change,
    scrape,
    served_revision,
)
from tests.builders import acceptance_watch, production_drafter
from tests.conftest import metered_ngram_standin


@pytest.fixture(scope="module")
def ngram_server(tiny_target_dir):
    """A serving replica of revision r2 (tests.conftest.metered_ngram_standin)."""
    with metered_ngram_standin(tiny_target_dir, "r2") as url:
        yield url


def test_the_served_acceptance_is_what_the_requests_meta_info_reports(ngram_server):
    before = scrape(f"{ngram_server}/metrics")
    tokens = verify_passes = 0
    for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [3, 4, 3, 4, 3, 4]):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
        meta = requests.post(f"{ngram_server}/generate", json=body, timeout=120).json()["meta_info"]
        tokens, verify_passes = tokens + meta["completion_tokens"], verify_passes + meta["spec_verify_ct"]
    after = scrape(f"{ngram_server}/metrics")
    window = AcceptanceWindow(window_s=3600.0)
    window.add(before)
    window.add(after)
    _, generated, verify_calls = window.span()
    assert (generated, verify_calls) == (tokens, verify_passes) and verify_passes > 0
    served = generated / verify_calls
    assert served > 1.05  # the repeated prompts give n-gram drafts that the target accepts
    above = acceptance_drift(window, acceptance_watch(window_s=1e-3, min_verify_calls=1, floor=served + 0.01))
    assert above is not None and above["accept_length"] == round(tokens / verify_passes, 4)
    assert (
        acceptance_drift(window, acceptance_watch(window_s=1e-3, min_verify_calls=1, floor=served - 0.05))
        is None
    )


def test_a_server_without_metrics_is_a_clear_error(tiny_target_dir):
    from harness.sglang_standin import StandinBackend, serve

    server = serve(StandinBackend(tiny_target_dir, None))
    try:
        with pytest.raises(WatchError, match="cannot read"):
            scrape(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()


def test_the_served_revision_against_the_production_drafters(ngram_server, tiny_target_dir, tmp_path):
    from pipeline.storage import StorageConfig, open_store

    served = served_revision(f"{ngram_server}/server_info")
    assert served["revision"] == "r2" and served["model_path"] == str(tiny_target_dir)
    store = open_store(StorageConfig(root=str(tmp_path / "store")))
    assert revision_change(served, production_target(store, "tiny", "production")) is None  # none yet
    production_drafter(store, "tiny", "r1")
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
    with pytest.raises(WatchError, match="not an SGLang /server_info"):
        served_revision(f"{ngram_server}/health")


def test_one_poll_of_the_revision_watch_reads_the_registry_the_run_config_names(ngram_server, tmp_path):
    import yaml

    from pipeline.config import load_config
    from pipeline.storage import open_store
    from tests.conftest import storage_config, tiny_config_dict

    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config_dict(storage_config("file", tmp_path, None))))
    config = load_config(config_path)
    watch = TargetRevisionWatch(server_info_url=f"{ngram_server}/server_info")
    assert check_revision(watch, str(config_path)) is None  # nothing in production
    production_drafter(open_store(config.storage), config.target.name, "r1", config.registry.alias)
    change = check_revision(watch, str(config_path))
    assert change is not None and change["served_revision"] == "r2"


def test_the_revision_poll_reads_an_s3_registry_with_the_keys_it_is_handed(
    ngram_server, tmp_path, s3_endpoint, monkeypatch
):
    """The triggerer's environment has no keys (the deployment's connection holds them): the poll's client
    takes the connection's, and they never show in a repr."""
    import boto3
    import yaml

    from pipeline.config import load_config
    from pipeline.storage import NoS3Credentials, S3Credentials, open_store
    from tests.conftest import storage_config, tiny_config_dict

    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config_dict(storage_config("s3", tmp_path, s3_endpoint))))
    config = load_config(config_path)
    production_drafter(open_store(config.storage), config.target.name, "r1", config.registry.alias)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials-file"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config-file"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # it would keep the keys it found before
    watch = TargetRevisionWatch(server_info_url=f"{ngram_server}/server_info")
    with pytest.raises(NoS3Credentials):
        check_revision(watch, str(config_path))
    keys = S3Credentials("AKIACONNECTION", "connection-secret-9d2e", "us-east-1")
    change = check_revision(watch, str(config_path), keys)
    assert change is not None and change["served_revision"] == "r2"
    assert "connection-secret-9d2e" not in repr(keys) and "AKIACONNECTION" in repr(keys)
