"""The SGLang client over real HTTP against the stand-in server (SGLang itself needs CUDA)."""

import numpy as np
import orjson
import pytest
import torch

from pipeline.config import SGLangClientConfig
from pipeline.engines import EngineError, SamplingParams, TeacherRequest
from pipeline.engines.hf import HFEngine
from pipeline.engines.sglang import SGLangEngine, parse_generation, prompt_states, split_hidden_states
from pipeline.sglang_standin import StandinBackend, serve


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
    prompts = [tiny_tokenizer.apply_chat_template([{"role": "user", "content": f"def f{i}(x):"}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(5)]
    remote = engine.generate(prompts, SamplingParams(max_new_tokens=20))
    local = HFEngine(tiny_target_dir).generate(prompts, SamplingParams(max_new_tokens=20))
    assert [g.output_ids for g in remote] == [g.output_ids for g in local]
    assert [g.finish_reason for g in remote] == [g.finish_reason for g in local]


def test_capture_over_http_matches_the_local_engine(servers, tiny_target_dir):
    aux_url, last_url = servers
    engine = SGLangEngine(SGLangClientConfig(urls=[aux_url], last_hidden_urls=[last_url], retries=0), hidden_size=64)
    sequences = [[3, 10, 11, 12, 4, 20], [3, 30, 4]]
    teacher = TeacherRequest(("last_hidden", "topk"), 6)
    remote = engine.capture(sequences, [1, 2, 3], teacher)
    local = HFEngine(tiny_target_dir).capture(sequences, [1, 2, 3], teacher)
    for r, l in zip(remote, local):
        torch.testing.assert_close(r.aux, l.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r.last_hidden, l.last_hidden, rtol=1e-5, atol=1e-5)
        assert torch.equal(r.topk_ids, l.topk_ids)
        torch.testing.assert_close(r.topk_logprobs, l.topk_logprobs, rtol=1e-5, atol=1e-5)


def test_one_aux_server_is_enough_with_a_topk_teacher(servers, tiny_target_dir):
    engine = SGLangEngine(SGLangClientConfig(urls=[servers[0]], retries=0), hidden_size=64)
    capture = engine.capture([[3, 10, 11, 4]], [1, 2, 3], TeacherRequest(("topk",), 3))[0]
    assert capture.aux.shape == (4, 192) and capture.topk_ids.shape == (4, 3) and capture.last_hidden is None
    with pytest.raises(EngineError, match="last_hidden_urls"):
        engine.capture([[3, 10]], [1, 2, 3], TeacherRequest(("last_hidden",), 3))


def test_hidden_state_blocks_parse_without_python_floats_for_every_number():
    rows = np.random.default_rng(0).standard_normal((300, 40)).astype(np.float32)
    raw = orjson.dumps({"text": "x", "meta_info": {"id": "r", "hidden_states": [rows.tolist(), [0.5] * 40],
                                                   "prompt_tokens": 300}})
    rest, values = split_hidden_states(raw)
    assert np.array_equal(values.reshape(300, 40), rows)
    assert orjson.loads(rest)["meta_info"] == {"id": "r", "hidden_states": None, "prompt_tokens": 300}
    assert split_hidden_states(b'{"meta_info": {"id": 1}}')[1] is None
    with pytest.raises(EngineError, match="chunked prefill"):
        prompt_states(values, 301, 40)


def test_an_unreachable_server_is_a_clear_error():
    with pytest.raises(EngineError, match="cannot reach SGLang at http://127.0.0.1:9"):
        SGLangEngine(SGLangClientConfig(urls=["http://127.0.0.1:9"], retries=0, timeout_s=2))


def test_stop_token_is_kept_and_aborts_fail():
    assert parse_generation({"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 1}}}
                            ).output_ids == [5, 6, 1]
    assert parse_generation({"output_ids": [5, 1], "meta_info": {"finish_reason": {"type": "stop", "matched": 1}}}
                            ).output_ids == [5, 1]
    assert parse_generation({"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}}
                            ).finish_reason == "length"
    with pytest.raises(EngineError, match="aborted"):
        parse_generation({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}})
    with pytest.raises(EngineError, match="missing"):
        parse_generation({"meta_info": {}})
