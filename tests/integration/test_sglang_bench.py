"""The production benchmark runner: launch flags, parsing of recorded SGLang responses, and a real run
over HTTP against stand-in servers started the way SGLang servers are started."""

import subprocess
import sys

import pytest

from pipeline.benchmark.sglang import (
    SGLangBenchmarkFailed,
    launch_command,
    measure_server,
    ngram_method_name,
    run_methods,
)
from pipeline.benchmark_settings import ServingSampling
from pipeline.drafter.export import export_drafter
from tests.builders import sglang_bench_settings
from tests.conftest import REPO, free_port


def standin_settings(target_dir, **changes):
    """sglang_bench_settings() for stand-in servers of the tiny target on a free port of 127.0.0.1."""
    return sglang_bench_settings(
        launch=[sys.executable, "-m", "harness.sglang_standin"],
        model_path=str(target_dir),
        extra_args=["--tp", "1"],
        port=free_port(),
        startup_timeout_s=120,
        **changes,
    )


def drafter_dir_of(target_dir, tmp_path):
    """A random drafter for the tiny target, exported where SGLang loads drafters from."""
    from tests.builders import random_drafter

    return export_drafter(random_drafter(target_dir), {"aux_layer_ids": [1, 2, 3]}, tmp_path / "d", "float32")


def test_the_standin_refuses_ngram_flags_sglang_refuses():
    base = [
        sys.executable,
        "-m",
        "harness.sglang_standin",
        "--model-path",
        "/nonexistent",
        "--port",
        "1",
    ]
    ngram = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    for flags, reason in [
        (
            ["--speculative-ngram-max-bfs-breadth", "4", "--attention-backend", "trtllm_mla"],
            "speculative_hook.py:1355",
        ),
        (
            ["--speculative-ngram-min-bfs-breadth", "3", "--speculative-ngram-max-bfs-breadth", "2"],
            "ngram.cpp:17",
        ),
        (["--speculative-ngram-max-trie-depth", "1"], "ngram.cpp:13"),
    ]:
        out = subprocess.run(base + ngram + flags, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 1 and reason in out.stderr, (flags, out.stderr[-2000:])
        assert "would not start this NGRAM server" in out.stderr


def test_every_method_runs_over_http_against_started_servers(tiny_target_dir, tiny_tokenizer, tmp_path):
    drafter_dir = drafter_dir_of(tiny_target_dir, tmp_path)
    config = standin_settings(
        tiny_target_dir,
        concurrency=2,
        steps=2,
        topk=2,
        draft_tokens=4,
        ngram_settings=[{"draft_tokens": 4, "max_bfs_breadth": 1}, {"draft_tokens": 6, "max_bfs_breadth": 2}],
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
    serving = ServingSampling(temperature=1.0, top_p=0.95)
    domains = ["code", "chat", "code"]
    figures = run_methods(config, prompts, 12, {"candidate": drafter_dir}, serving, [1, 2], domains)
    methods, sampled = figures.greedy, figures.sampled
    ngrams = [ngram_method_name(setting) for setting in config.ngram_settings]  # one server per setting
    assert set(methods) == {"baseline", *ngrams, "candidate"} and len(ngrams) == 2
    assert all(m["requests"] == 3 and m["tok_s"] > 0 for m in methods.values())
    assert "tau_measured" not in methods["baseline"]
    assert methods["candidate"]["tau_measured"] >= 1 and all(methods[n]["tau_measured"] >= 1 for n in ngrams)
    assert sum(methods["candidate"]["accepted_histogram"]) > 0
    # the prompts went in batches (config.rounds, at most one per prompt), one tokens/s sample each
    assert all(len(m["round_tok_s"]) == 3 and min(m["round_tok_s"]) > 0 for m in methods.values())
    # sampled at the serving temperature too, on the baseline's and the drafter's servers
    assert set(sampled) == {"baseline", "candidate"}
    assert all(m["requests"] == 3 and len(m["round_tok_s"]) == 3 for m in sampled.values())
    assert sampled["candidate"]["tau_measured"] >= 1 and "tau_measured" not in sampled["baseline"]
    # each domain's acceptance from its own requests' meta_info, on every speculative server
    code, chat = methods["candidate"]["domains"]["code"], methods["candidate"]["domains"]["chat"]
    assert (code["requests"], chat["requests"]) == (2, 1)
    assert code["tokens"] + chat["tokens"] == methods["candidate"]["tokens"]
    assert sum(code["accepted_histogram"]) + sum(chat["accepted_histogram"]) == sum(
        methods["candidate"]["accepted_histogram"]
    )
    assert all(0 <= p <= 1 for p in code["acceptance_per_position"])
    assert "tau_measured" not in methods["baseline"]["domains"]["code"]
    # greedy with 1 request in flight too (2, the configured concurrency, is the headline): every server
    assert set(figures.at_concurrency) == {1}
    one_at_a_time = figures.at_concurrency[1]
    assert set(one_at_a_time) == set(methods)
    assert all(m["requests"] == 3 and len(m["round_tok_s"]) == 3 for m in one_at_a_time.values())
    assert one_at_a_time["candidate"]["tau_measured"] >= 1


def test_a_server_that_dies_or_never_answers_fails_the_benchmark():
    crashing = sglang_bench_settings(
        launch=[sys.executable, "-c", "print('CUDA error: no device'); raise SystemExit(3)"],
        port=free_port(),
        startup_timeout_s=30,
    )
    with pytest.raises(SGLangBenchmarkFailed, match="exited with code 3") as info:
        run_methods(crashing, [[1, 2]], 4, {})
    assert "CUDA error: no device" in str(info.value)
    with pytest.raises(SGLangBenchmarkFailed, match="failed"):
        measure_server(f"http://127.0.0.1:{free_port()}", [[1, 2]], 4, 1, 2)


def test_the_drafters_setting_is_chosen_by_timing_each_candidate_server(
    tiny_target_dir, tiny_tokenizer, tmp_path
):
    """benchmark.sglang.candidates: one stand-in server per setting, each checked to serve the flags it was
    launched with, timed on the same prompts in the same rounds; the choice rule picks among them."""
    from pipeline.benchmark.sglang import server_rounds, time_settings, timed_server_settings
    from pipeline.decoding.choice import choose
    from pipeline.records import MethodResult
    from tests.builders import eval_record

    drafter_dir = drafter_dir_of(tiny_target_dir, tmp_path)
    config = standin_settings(
        tiny_target_dir,
        concurrency=2,
        rounds=3,
        candidates=[{"steps": 2, "topk": 1, "draft_tokens": 3}, {"steps": 2, "topk": 2, "draft_tokens": 4}],
    )
    prompts = [[1, 5 + i, 9, 12, 40 + i, 7] for i in range(6)]
    timed = time_settings(config, prompts, 8, drafter_dir)
    assert list(timed) == [(2, 1, 3), (2, 2, 4)]
    assert all(len(f["round_tok_s"]) == 3 and f["requests"] == 6 for f in timed.values())
    choice = choose(server_rounds(timed, 0.95), {"chain2": (2, 1, 3), "tree2x2-4": (2, 2, 4)})
    assert choice.chosen in choice.tied and choice.fastest in {"chain2", "tree2x2-4"}
    baseline = MethodResult(tokens=48, seconds=1.0, tok_s=48.0, round_tok_s=[16.0, 16.0, 16.0])
    entries, recorded = timed_server_settings(timed, choice, baseline, eval_record(), 0.95)
    assert [(e.steps, e.topk, e.draft_tokens) for e in entries] == [(2, 1, 3), (2, 2, 4)]
    assert all(e.speedup.rounds == 3 and e.tau_measured >= 1 for e in entries)
    assert [e.vs_fastest is None for e in entries].count(True) == 1  # the fastest's own
    assert recorded.chosen == choice.chosen and recorded.rounds == 3 and recorded.prompts == 6


def test_a_server_that_serves_other_flags_than_it_was_given_fails_the_benchmark(tiny_target_dir, tmp_path):
    """SGLang serves topk 1 with steps + 1 draft tokens whatever it is given: a setting it did not serve
    is not timed under its name."""
    from pipeline.benchmark.sglang import require_served_load, require_served_setting, running_server
    from pipeline.drafter.servable import sglang_flags

    drafter_dir = drafter_dir_of(tiny_target_dir, tmp_path)
    config = standin_settings(tiny_target_dir)
    command = [*launch_command(config, "baseline"), *sglang_flags(str(drafter_dir), 3, 1, 6)]
    with running_server(command, config) as url:
        require_served_setting(url, (3, 1, 4))
        with pytest.raises(SGLangBenchmarkFailed, match=r"launched with .* \(3, 1, 6\) serves \(3, 1, 4\)"):
            require_served_setting(url, (3, 1, 6))
        require_served_load(url, 8)  # launch_command's --max-running-requests 8
        with pytest.raises(SGLangBenchmarkFailed, match="max-running-requests 16 runs 8 requests at once"):
            require_served_load(url, 16)
