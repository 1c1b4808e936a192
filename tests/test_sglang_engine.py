"""The SGLang client over real HTTP against the stand-in server (SGLang itself needs CUDA)."""

import pytest
import torch

from pipeline.config import SGLangClientConfig
from pipeline.engines import EngineError, SamplingParams
from pipeline.engines.hf import HFEngine
from pipeline.engines.sglang import SGLangEngine, parse_generation
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
    remote = engine.capture(sequences, [1, 2, 3])
    local = HFEngine(tiny_target_dir).capture(sequences, [1, 2, 3])
    for r, l in zip(remote, local):
        torch.testing.assert_close(r.aux, l.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r.last_hidden, l.last_hidden, rtol=1e-5, atol=1e-5)


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
