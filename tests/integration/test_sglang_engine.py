"""The SGLang client over real HTTP against the stand-in server (SGLang itself needs CUDA)."""

import orjson
import pytest
import torch

from harness.sglang_standin import StandinBackend, serve
from pipeline.engine_settings import SGLangClientConfig
from pipeline.engines import EngineError, SamplingParams, TeacherRequest
from pipeline.engines.hf import HFEngine
from pipeline.engines.sglang import SGLangEngine, parse_generation
from pipeline.stages import run_stage
from tests.conftest import published


@pytest.fixture(scope="module")
def servers(tiny_target_dir):
    aux = serve(StandinBackend(tiny_target_dir, [1, 2, 3]))
    last = serve(StandinBackend(tiny_target_dir, None))
    yield f"http://127.0.0.1:{aux.server_port}", f"http://127.0.0.1:{last.server_port}"
    aux.shutdown()
    last.shutdown()


def test_generation_over_http_matches_the_local_engine(servers, tiny_target_dir, tiny_tokenizer):
    engine = SGLangEngine(SGLangClientConfig(urls=list(servers), concurrency=4, retries=0))
    assert engine.version == "sglang-0.5.23-standin"
    prompts = [
        tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": f"def f{i}(x):"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(5)
    ]
    remote = engine.generate(prompts, SamplingParams(max_new_tokens=20))
    local = HFEngine(tiny_target_dir).generate(prompts, SamplingParams(max_new_tokens=20))
    assert [g.output_ids for g in remote] == [g.output_ids for g in local]
    assert [g.finish_reason for g in remote] == [g.finish_reason for g in local]
    with_top = engine.generate(prompts[:2], SamplingParams(max_new_tokens=6, top_logprobs=3))
    local_top = HFEngine(tiny_target_dir).generate(
        prompts[:2], SamplingParams(max_new_tokens=6, top_logprobs=3)
    )
    for remote_gen, local_gen in zip(with_top, local_top, strict=True):
        assert (
            len(remote_gen.top_logprobs) == len(remote_gen.output_ids)
            and len(remote_gen.top_logprobs[0]) == 3
        )
        assert [[e[0] for e in step] for step in remote_gen.top_logprobs] == [
            [e[0] for e in step] for step in local_gen.top_logprobs
        ]
        assert [
            step[0][0] for step in remote_gen.top_logprobs
        ] == remote_gen.output_ids  # greedy: the top-1 is what was generated


def test_capture_over_http_matches_the_local_engine(servers, tiny_target_dir):
    aux_url, last_url = servers
    engine = SGLangEngine(
        SGLangClientConfig(urls=[aux_url], last_hidden_urls=[last_url], retries=0), hidden_size=64
    )
    sequences = [[3, 10, 11, 12, 4, 20], [3, 30, 4]]
    teacher = TeacherRequest(("last_hidden", "topk"), 6)
    remote = [c.materialized() for c in engine.capture(sequences, [1, 2, 3], teacher)]
    local = HFEngine(tiny_target_dir).capture(sequences, [1, 2, 3], teacher)
    for remote_cap, local_cap in zip(remote, local, strict=True):
        torch.testing.assert_close(remote_cap.aux, local_cap.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(remote_cap.last_hidden, local_cap.last_hidden, rtol=1e-5, atol=1e-5)
        assert torch.equal(remote_cap.topk_ids, local_cap.topk_ids)
        torch.testing.assert_close(remote_cap.topk_logprobs, local_cap.topk_logprobs, rtol=1e-5, atol=1e-5)


def test_one_aux_server_is_enough_with_a_topk_teacher(servers, tiny_target_dir):
    engine = SGLangEngine(SGLangClientConfig(urls=[servers[0]], retries=0), hidden_size=64)
    capture = engine.capture([[3, 10, 11, 4]], [1, 2, 3], TeacherRequest(("topk",), 3))[0]
    assert capture.aux.shape == (4, 192) and capture.topk_ids.shape == (4, 3) and capture.last_hidden is None
    capture.discard()
    with pytest.raises(EngineError, match="last_hidden_urls"):
        engine.capture([[3, 10]], [1, 2, 3], TeacherRequest(("last_hidden",), 3))


class Flaky:
    """A loopback HTTP server answering /generate from a script of (status, body) replies."""

    def __init__(self, replies):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.replies, self.calls = list(replies), 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.calls += 1
                status, body = outer.replies.pop(0) if outer.replies else (200, b"{}")
                if status == "sleep":
                    import time

                    time.sleep(body)
                    status, body = 200, b"{}"
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self):
        self.server.shutdown()


GOOD = orjson.dumps({"output_ids": [7, 1], "meta_info": {"finish_reason": {"type": "stop", "matched": 1}}})


def test_retries_with_backoff_on_5xx_and_truncated_json_then_succeeds():
    from pipeline.sglang_transport import SGLangClient

    server = Flaky([(503, b"busy"), (200, GOOD[:-5]), (200, GOOD)])
    try:
        client = SGLangClient(SGLangClientConfig(urls=[server.url], retries=3, timeout_s=5))
        assert parse_generation(client.post("/generate", {})).output_ids == [7, 1]
        assert server.calls == 3
    finally:
        server.close()


def test_client_errors_are_not_retried_and_deadlines_hold():

    from pipeline.sglang_transport import SGLangClient

    server = Flaky([(400, b'{"error": {"message": "input too long"}}'), ("sleep", 3.0)])
    try:
        client = SGLangClient(SGLangClientConfig(urls=[server.url], retries=5, timeout_s=30, deadline_s=1.0))
        with pytest.raises(EngineError, match="HTTP 400 input too long"):
            client.post("/generate", {})
        assert server.calls == 1
        # the server answers after 3 s; the client's 1 s deadline ends the request first, and says so
        with pytest.raises(EngineError, match="deadline"):
            client.post("/generate", {})
    finally:
        server.close()


def test_the_generate_stage_regenerates_multi_turn_conversations_turn_by_turn(
    servers, store, storage, tmp_path, tiny_target_dir, tiny_tokenizer
):
    import json as jsonlib

    from pipeline.config import load_config
    from pipeline.data.conversations import prompt_ids
    from tests.conftest import tiny_config_dict

    data = tiny_config_dict(storage)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"def first{i}(x):"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": f"def second{i}(y):"},
                {"role": "assistant", "content": "old"},
            ]
        }
        for i in range(3)
    ]
    path = tmp_path / "multi-turn.jsonl"
    path.write_text("\n".join(jsonlib.dumps(r) for r in rows))
    data["prompts"] = {"sources": [{"kind": "jsonl", "path": str(path)}], "eval_fraction": 0.0}
    data["generate"] = {
        "engine": "sglang",
        "max_new_tokens": 12,
        "sglang": {"urls": [servers[1]], "retries": 0},
    }
    config = load_config(data=data)
    result = run_stage(
        "generate", config, "multi", store, prompts_uri=run_stage("prompts", config, "multi", store).uri
    )
    assert published(store, result)["counts"] == {"input": 3, "succeeded": 3, "skipped": 0, "failed": 0}
    key = store.key_for(result.uri)
    records = [jsonlib.loads(line) for line in store.get_bytes(f"{key}/train-00000.jsonl").splitlines()]
    local = HFEngine(tiny_target_dir)
    for record in records:
        messages = record["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert "old" not in (messages[1]["content"], messages[3]["content"])
        # the second answer was generated after the regenerated first answer, not the original one
        second = local.generate([prompt_ids(tiny_tokenizer, messages[:3])], SamplingParams(12))[0]
        assert record["generation"]["last_output_ids"] == second.output_ids
        assert len(record["generation"]["finish_reasons"]) == 2


def test_capture_states_come_back_spilled_to_disk_and_are_removed_once_read(servers, tmp_path):
    engine = SGLangEngine(
        SGLangClientConfig(urls=[servers[0]], retries=0), hidden_size=64, spill_dir=tmp_path
    )
    try:
        captures = engine.capture([[3, 10, 11, 4], [3, 12, 4]], [1, 2, 3], TeacherRequest(("topk",), 3))
        assert [c.aux.shape for c in captures] == [(4, 192), (3, 192)]
        assert len(list(tmp_path.glob("sglang-capture-*.f32"))) == 2 and engine.received_bytes > 0
        loaded = captures[0].materialized()
        assert loaded.aux.shape == (4, 192) and len(list(tmp_path.glob("*.f32"))) == 1
        captures[1].discard()
        assert list(tmp_path.glob("*.f32")) == []
    finally:
        engine.close()


def test_a_capture_worker_that_dies_is_replaced(servers, tmp_path):
    engine = SGLangEngine(
        SGLangClientConfig(urls=[servers[0]], retries=0, concurrency=1), hidden_size=64, spill_dir=tmp_path
    )
    teacher = TeacherRequest(("topk",), 3)
    try:
        engine.capture([[3, 10, 4]], [1, 2, 3], teacher)[0].discard()
        engine._workers.workers[0].process.kill()
        with pytest.raises(EngineError, match="capture worker"):
            engine.capture([[3, 10, 4]], [1, 2, 3], teacher)
        [capture] = engine.capture([[3, 11, 4]], [1, 2, 3], teacher)  # its replacement answers
        assert capture.aux.shape == (3, 192)
        capture.discard()
        assert list(tmp_path.iterdir()) == []  # the failed request's spill file is gone too
    finally:
        engine.close()


def test_an_unreachable_server_is_a_clear_error():
    with pytest.raises(EngineError, match="cannot reach SGLang at http://127.0.0.1:9"):
        SGLangEngine(SGLangClientConfig(urls=["http://127.0.0.1:9"], retries=0, timeout_s=2))


def test_health_answers_as_sglang_0_5_23_does(tiny_target_dir, monkeypatch):
    """/health runs a one-token generation through the scheduler and answers no sooner than a second
    (so a probe with the kubelet's default timeoutSeconds of 1 never passes), counted by no metric;
    with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false only /health answers at once."""
    import time

    import requests

    from harness.sglang_standin import HEALTH_GENERATION_ENV

    backend = StandinBackend(tiny_target_dir, None, enable_metrics=True)
    generating = serve(backend)
    monkeypatch.setenv(HEALTH_GENERATION_ENV, "false")
    quick = serve(backend)
    url, quick_url = (f"http://127.0.0.1:{server.server_port}" for server in (generating, quick))

    def answer(address: str, timeout: float = 30) -> tuple[int, float]:
        started = time.monotonic()
        status = requests.get(address, timeout=timeout).status_code
        return status, time.monotonic() - started

    try:
        for path in ("/health", "/health_generate"):
            status, seconds = answer(url + path)
            assert status == 200 and seconds >= 1.0
        with pytest.raises(requests.Timeout):
            requests.get(url + "/health", timeout=0.9)
        status, seconds = answer(quick_url + "/health")
        assert status == 200 and seconds < 1.0
        status, seconds = answer(quick_url + "/health_generate")
        assert status == 200 and seconds >= 1.0
        assert backend.counters.requests == 0  # the health checks' generations count in no metric
    finally:
        generating.shutdown()
        quick.shutdown()
