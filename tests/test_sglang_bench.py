"""The production benchmark runner: launch flags, parsing of recorded SGLang responses, and a real run
over HTTP against stand-in servers started the way SGLang servers are started."""

import socket
import sys

import pytest

from pipeline.config import SGLangBenchConfig
from pipeline.drafter.export import export_drafter
from pipeline.engines.sglang_bench import (
    SGLangBenchmarkFailed,
    batches,
    launch_command,
    measure,
    run_methods,
    summarize_responses,
)

# what SGLang 0.5.23 returns for two finished EAGLE3 requests (meta_info trimmed to what is read)
RECORDED = [
    {
        "text": "...",
        "output_ids": [5, 6, 7, 8, 9, 2],
        "meta_info": {
            "id": "a",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 40,
            "completion_tokens": 6,
            "cached_tokens": 0,
            "e2e_latency": 0.21,
            "spec_verify_ct": 2,
            "spec_accept_length": 3.0,
            "spec_accept_rate": 0.6667,
            "spec_num_correct_drafts": 4,
            "spec_num_proposed_drafts": 6,
            "spec_correct_drafts_histogram": [0, 0, 1, 1],
        },
    },
    {
        "text": "...",
        "output_ids": [5, 6, 7, 8],
        "meta_info": {
            "id": "b",
            "finish_reason": {"type": "length", "length": 4},
            "prompt_tokens": 12,
            "completion_tokens": 4,
            "cached_tokens": 0,
            "e2e_latency": 0.1,
            "spec_verify_ct": 3,
            "spec_accept_length": 1.3333,
            "spec_accept_rate": 0.1111,
            "spec_num_correct_drafts": 1,
            "spec_num_proposed_drafts": 9,
            "spec_correct_drafts_histogram": [2, 1],
        },
    },
]


def settings(**changes):
    base = {
        "launch": ["python", "-m", "sglang.launch_server"],
        "model_path": "/models/Kimi-K2.5",
        "extra_args": ["--tp", "8", "--trust-remote-code"],
        "steps": 3,
        "topk": 1,
        "draft_tokens": 4,
    }
    return SGLangBenchConfig(**{**base, **changes})


def test_launch_flags_per_method():
    config = settings()
    assert launch_command(config, "baseline") == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/Kimi-K2.5",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--tp",
        "8",
        "--trust-remote-code",
    ]
    ngram = launch_command(config, "ngram")
    assert ngram[ngram.index("--speculative-algorithm") + 1] == "NGRAM"
    assert "--speculative-ngram-max-trie-depth" in ngram
    eagle = launch_command(config, "candidate", drafter_dir="/d")
    assert eagle[-10:] == [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "/d",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
    ]
    with pytest.raises(ValueError, match="steps \\+ 1"):
        settings(draft_tokens=6)


def test_recorded_responses_give_throughput_and_acceptance():
    summary = summarize_responses(RECORDED, seconds=2.0)
    assert summary["tokens"] == 10 and summary["tok_s"] == 5.0
    assert summary["tau_measured"] == 2.0  # 10 completion tokens over 5 verify forwards
    assert summary["accepted_histogram"] == [2, 1, 1, 1]
    plain = summarize_responses([{"meta_info": {"completion_tokens": 8}}], seconds=4.0)
    assert plain == {"requests": 1, "tokens": 8, "seconds": 4.0, "tok_s": 2.0}


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_every_method_runs_over_http_against_started_servers(tiny_target_dir, tiny_tokenizer, tmp_path):
    from tests.test_spec_decode import random_drafter

    drafter_dir = export_drafter(
        random_drafter(tiny_target_dir), {"aux_layer_ids": [1, 2, 3]}, tmp_path / "d", "float32"
    )
    config = settings(
        launch=[sys.executable, "-m", "pipeline.dev.sglang_standin"],
        model_path=str(tiny_target_dir),
        extra_args=["--tp", "1"],
        port=free_port(),
        startup_timeout_s=120,
        concurrency=2,
        steps=2,
        topk=2,
        draft_tokens=4,
    )
    prompts = [
        tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": f"def f{i}(x):"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(3)
    ]
    methods = run_methods(config, prompts, 12, {"candidate": drafter_dir})
    assert set(methods) == {"baseline", "ngram", "candidate"}
    assert all(m["requests"] == 3 and m["tok_s"] > 0 for m in methods.values())
    assert "tau_measured" not in methods["baseline"]
    assert methods["candidate"]["tau_measured"] >= 1 and methods["ngram"]["tau_measured"] >= 1
    assert sum(methods["candidate"]["accepted_histogram"]) > 0
    # the prompts went in batches (config.rounds, at most one per prompt), one tokens/s sample each
    assert all(len(m["round_tok_s"]) == 3 and min(m["round_tok_s"]) > 0 for m in methods.values())


def test_a_server_that_dies_or_never_answers_fails_the_benchmark():
    crashing = settings(
        launch=[sys.executable, "-c", "print('CUDA error: no device'); raise SystemExit(3)"],
        port=free_port(),
        startup_timeout_s=30,
    )
    with pytest.raises(SGLangBenchmarkFailed, match="exited with code 3") as info:
        run_methods(crashing, [[1, 2]], 4, {})
    assert "CUDA error: no device" in str(info.value)
    with pytest.raises(SGLangBenchmarkFailed, match="failed"):
        measure(f"http://127.0.0.1:{free_port()}", [[1, 2]], 4, 1, 2)


def test_prompts_go_in_equal_batches_none_empty():
    assert batches(list(range(10)), 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert batches([1, 2], 5) == [[1], [2]]
