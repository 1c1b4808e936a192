"""SGLang faults through the stand-in server (the tiny target behind SGLang's HTTP format), injected by
the fault proxy in front of it: timeouts, HTTP 500s, truncated JSON, a server that disappears mid-run,
wrong hidden-state shapes and NaN rows."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from harness.sglang_standin import StandinBackend, serve
from pipeline.config import load_config
from pipeline.data.jsonl import decode_jsonl
from pipeline.engines import EngineUnavailable
from pipeline.manifest import read_listed, read_manifest
from pipeline.stages import run_stage
from tests.conftest import published, storage_config, tiny_config_dict
from tests.faults.proxy import FaultProxy, Rule

pytestmark = pytest.mark.fault

AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def standin(tiny_target_dir):
    server = serve(StandinBackend(tiny_target_dir, AUX))
    yield server
    server.shutdown()


@pytest.fixture
def proxy(standin):
    proxy = FaultProxy("127.0.0.1", standin.server_port).start()
    yield proxy
    proxy.stop()


def _config(tmp_path, url: str, **client):
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["prompts"].update(num_samples=24, eval_fraction=0.0, shard_size=12)
    settings = {"urls": [url], "retries": 4, "timeout_s": 3, "concurrency": 2, **client}
    data["generate"] = {
        "engine": "sglang",
        "max_new_tokens": 12,
        "batch_size": 4,
        "checkpoint_every": 4,
        "sglang": settings,
    }
    data["capture"] = {
        "engine": "sglang",
        "aux_layer_ids": AUX,
        "max_length": 192,
        "batch_size": 4,
        "parity": {"samples": 0},
        "sglang": settings,
    }
    return load_config(data=data)


def _responses(store, uri) -> dict[str, str]:
    prefix = store.key_for(uri)
    manifest = read_manifest(store, prefix, kind="responses")
    return {
        r["id"]: r["messages"][-1]["content"]
        for s in manifest["shards"]
        for r in decode_jsonl(read_listed(store, prefix, manifest, s["name"]))
    }


def _generate(config, snapshot="faults"):
    from pipeline.storage import open_store

    store = open_store(config.storage)
    return store, run_stage(
        "generate", config, snapshot, store, prompts_uri=run_stage("prompts", config, snapshot, store).uri
    )


@pytest.fixture(scope="module")
def clean(tmp_path_factory, standin):
    config = _config(tmp_path_factory.mktemp("clean"), f"http://127.0.0.1:{standin.server_port}")
    store, result = _generate(config)
    return _responses(store, result.uri)


def test_500s_truncated_json_and_timeouts_are_retried(proxy, tmp_path, clean, record):
    rules = [
        proxy.add(
            Rule("status", method="POST", path="/generate", code=500, body=b'{"error": "boom"}', times=3)
        ),
        proxy.add(Rule("truncate", method="POST", path="/generate", times=2)),
        proxy.add(Rule("delay", method="POST", path="/generate", seconds=4.0, times=1)),
    ]
    store, result = _generate(_config(tmp_path, proxy.url))
    assert [r.fired for r in rules] == [3, 2, 1]
    got = _responses(store, result.uri)
    assert published(store, result)["counts"]["failed"] == 0
    assert got == clean  # same conversations, same greedy answers
    record(
        "SGLang",
        "HTTP 500 x3, truncated JSON x2 and a response slower than the 3 s timeout x1 during generation",
        f"each request retried with backoff; all {len(got)} conversations equal a clean run's",
        tried=6,
        lost=len(set(clean) - set(got)),
    )


def test_a_server_that_disappears_mid_run_stops_the_stage_and_a_rerun_loses_nothing(
    proxy, tmp_path, clean, record
):
    config = _config(tmp_path, proxy.url, retries=2, timeout_s=2)
    # the server answers 5 requests, then every connection is dropped
    gone = proxy.add(Rule("reset_request", method="POST", path="/generate", times=10_000))
    gone.fired = -5
    with pytest.raises(EngineUnavailable, match="failed after 3 attempts"):
        _generate(config)
    proxy.clear()  # the server is back
    store, result = _generate(config)
    got = _responses(store, result.uri)
    assert published(store, result)["counts"]["failed"] == 0 and got == clean
    ids = [
        r["id"]
        for s in published(store, result)["shards"]
        for r in decode_jsonl(
            read_listed(store, store.key_for(result.uri), published(store, result), s["name"])
        )
    ]
    duplicated = sum(n - 1 for n in Counter(ids).values())
    assert duplicated == 0
    record(
        "SGLang",
        "the server disappears mid-generation (every connection dropped after 5 requests)",
        "the stage stops with 'SGLang request failed after 3 attempts' keeping finished parts; the rerun "
        "resumes and matches a clean run",
        lost=len(set(clean) - set(got)),
        duplicated=duplicated,
    )


def _capture(config, snapshot="faults"):

    store, responses = _generate(config, snapshot)
    return store, run_stage("capture", config, snapshot, store, responses_uri=responses.uri)


def _null_first_row(body: bytes) -> bytes:
    """A NaN row as SGLang's JSON carries it (orjson writes NaN as null)."""
    start = body.index(b'"hidden_states":[[[') + len(b'"hidden_states":[[[')
    end = body.index(b"]", start)
    count = body[start:end].count(b",") + 1
    return body[:start] + b",".join([b"null"] * count) + body[end:]


def _drop_first_row(body: bytes) -> bytes:
    start = body.index(b'"hidden_states":[[') + len(b'"hidden_states":[[')
    end = body.index(b"],", start) + 2
    return body[:start] + body[end:]


def test_nan_rows_are_quarantined_not_let_through(proxy, tmp_path, record):
    config = _config(tmp_path, proxy.url)
    _generate(config)  # responses first, without faults
    rule = proxy.add(Rule("transform", method="POST", path="/generate", transform=_null_first_row, times=2))
    store, result = _capture(config)
    assert rule.fired == 2
    counts = published(store, result)["counts"]
    quarantined = {k: v for k, v in counts.items() if k.startswith("quarantined.")}
    assert quarantined == {"quarantined.non_finite_aux": 2}, counts
    kept = counts["captured"]
    assert kept + 2 == 24  # every sample is either captured or quarantined with its reason
    record(
        "SGLang",
        "NaN rows in the hidden states of 2 capture responses",
        f"both samples quarantined with reason {sorted(quarantined)}; the other {kept} captured",
        tried=2,
    )


def test_wrong_hidden_state_shapes_are_a_clear_error(proxy, tmp_path, record):
    config = _config(tmp_path, proxy.url)
    _generate(config)
    rule = proxy.add(Rule("transform", method="POST", path="/generate", transform=_drop_first_row, times=1))
    with pytest.raises(Exception, match=re.escape("hidden state block has")) as failure:
        _capture(config)
    assert rule.fired == 1 and "expected" in str(failure.value)
    proxy.clear()
    store, result = _capture(config)  # a rerun against a healthy server completes
    assert published(store, result)["counts"]["captured"] == 24
    record(
        "SGLang",
        "a capture response whose hidden-state block misses a row (wrong shape)",
        "capture stops: 'hidden state block has N numbers, expected L x 3H'; nothing written for the shard; "
        "the rerun captures all 24",
        tried=1,
    )
