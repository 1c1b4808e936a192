"""The retraining watches' arithmetic: /metrics counters summed, acceptance averaged over a window against
a floor, restarts, and what each run says started it. Over real HTTP: tests/integration/test_watch.py."""

from __future__ import annotations

import pytest

from pipeline.ops.watch import (
    GENERATED,
    VERIFY_CALLS,
    AcceptanceWindow,
    FleetSample,
    FleetWindow,
    acceptance_drift,
    metric_totals,
    replica_urls,
)
from tests.builders import acceptance_watch, production_drafter

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


def test_a_whole_window_under_the_floor_triggers_and_a_partial_or_idle_one_does_not():
    watch, window = acceptance_watch(), AcceptanceWindow(100)
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


def test_the_reason_states_the_length_the_payload_carries():
    # 475 tokens over 440 passes is 1.07954...: rounded once, the reason and the payload agree
    window = AcceptanceWindow(100)
    window.add(FleetSample(0.0, 0.0, 0.0))
    window.add(FleetSample(120.0, 475.0, 440.0))
    payload = acceptance_drift(window, acceptance_watch())
    assert payload is not None and payload["accept_length"] == 1.0795
    assert payload["reason"].startswith(f"served acceptance length {payload['accept_length']:.3f} under")


def test_a_server_restart_starts_the_window_again():
    window = AcceptanceWindow(100)
    window.add(FleetSample(0.0, 1000.0, 200.0))
    window.add(FleetSample(60.0, 1100.0, 250.0))
    window.add(FleetSample(70.0, 1200.0, 10.0))  # its verify counter began again
    assert [s.at for s in window.samples] == [70.0] and window.span() == (0.0, 0.0, 0.0)


def test_a_floor_at_or_under_one_token_per_pass_is_refused():
    with pytest.raises(ValueError, match="floor"):
        acceptance_watch(floor=1.0)


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
    production_drafter(store, config.target.name, "r1", config.registry.alias)
    assert nothing_new(config, store, "s3://b/datasets/d2") is None


def test_each_replica_is_windowed_apart_so_alternating_counters_build_a_whole_window():
    """Behind a load balancer the counters of two replicas alternate, and every apparent decrease would
    start the window again; read apart, each replica's counters only grow and the fleet's window is
    whole once each replica's is."""
    watch = acceptance_watch()
    single, fleet = AcceptanceWindow(100), FleetWindow(100)
    for at in range(0, 130, 10):  # replica a: 1.5 tokens per pass; b: 1.25; a load balancer alternates them
        a = FleetSample(float(at), 3000.0 + 15 * at, 2000.0 + 10 * at)
        b = FleetSample(float(at), 500.0 + 5 * at, 400.0 + 4 * at)
        single.add(a if at % 20 == 0 else b)
        fleet.add({"http://10.0.0.1:30000/metrics": a, "http://10.0.0.2:30000/metrics": b})
    assert acceptance_drift(single, watch) is None  # never a whole window: it kept starting again
    payload = acceptance_drift(fleet, watch)
    assert payload is not None and payload["accept_length"] == round((15 + 5) / (10 + 4), 4)
    assert "2 server(s)" in payload["reason"]
    # a replica that restarts starts only its own window; one that leaves leaves the fleet
    fleet.add({"http://10.0.0.1:30000/metrics": FleetSample(130.0, 10.0, 5.0)})
    assert list(fleet.replicas_seen) == ["http://10.0.0.1:30000/metrics"] and fleet.span() == (0.0, 0.0, 0.0)


def test_a_headless_service_name_is_scraped_once_per_replica_it_lists():
    def resolve(host, port, proto):
        assert (host, port) == ("kimi-k2-5-replicas.sglang.svc.cluster.local", 30000)
        return [(2, 1, 6, "", ("10.0.0.2", port)), (2, 1, 6, "", ("10.0.0.1", port))] * 2

    watch = acceptance_watch(
        metrics_urls=[], replicas_url="http://kimi-k2-5-replicas.sglang.svc.cluster.local:30000/metrics"
    )
    assert replica_urls(watch, resolve) == ["http://10.0.0.1:30000/metrics", "http://10.0.0.2:30000/metrics"]
    assert replica_urls(acceptance_watch(), resolve) == ["http://127.0.0.1:1/metrics"]
    with pytest.raises(ValueError, match="name the replicas one way"):
        acceptance_watch(replicas_url="http://kimi-k2-5-replicas.sglang.svc.cluster.local:30000/metrics")
