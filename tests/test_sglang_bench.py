"""The production benchmark runner: launch flags, parsing of recorded SGLang responses, and a real run
over HTTP against stand-in servers started the way SGLang servers are started."""

import subprocess
import sys

import pytest

from pipeline.config import ConfigError, NgramServerSetting, ServingSampling, SGLangBenchConfig, load_config
from pipeline.drafter.export import export_drafter
from pipeline.engines.sglang_bench import (
    SGLangBenchmarkFailed,
    batches,
    launch_command,
    measure,
    ngram_method_name,
    run_methods,
    summarize_responses,
)
from pipeline.sglang_ngram_rules import launch_from_args, silent_changes
from tests.conftest import REPO, free_port

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


def standin_settings(target_dir, **changes):
    """settings() for stand-in servers of the tiny target on a free port of 127.0.0.1."""
    return settings(
        launch=[sys.executable, "-m", "pipeline.dev.sglang_standin"],
        model_path=str(target_dir),
        extra_args=["--tp", "1"],
        port=free_port(),
        startup_timeout_s=120,
        **changes,
    )


def drafter_dir_of(target_dir, tmp_path):
    """A random drafter for the tiny target, exported where SGLang loads drafters from."""
    from tests.test_spec_decode import random_drafter

    return export_drafter(random_drafter(target_dir), {"aux_layer_ids": [1, 2, 3]}, tmp_path / "d", "float32")


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
    chain = NgramServerSetting(draft_tokens=4, max_bfs_breadth=1, max_trie_depth=8)
    ngram = launch_command(config, "ngram", ngram=chain)
    assert ngram[-14:] == [
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "4",
        "--speculative-ngram-min-bfs-breadth",
        "1",
        "--speculative-ngram-max-bfs-breadth",
        "1",
        "--speculative-ngram-match-type",
        "BFS",
        "--speculative-ngram-max-trie-depth",
        "8",
        "--speculative-ngram-capacity",
        "10000000",
    ]
    with pytest.raises(SGLangBenchmarkFailed, match="ngram_settings"):
        launch_command(config, "ngram")
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


def test_an_ngram_setting_sglang_would_run_otherwise_is_refused_with_the_reason():
    # topk becomes the breadth (10) and num_steps 4 // 10 = 0: what the Kimi config used to ask for
    with pytest.raises(ValueError, match=r"num_steps 4 // 10 = 0.*speculative_hook.py:1309-1330"):
        NgramServerSetting(draft_tokens=4, max_bfs_breadth=10)
    with pytest.raises(ValueError, match=r"BFS breadth 5\.\.3.*ngram.cpp:17-26"):
        NgramServerSetting(draft_tokens=8, min_bfs_breadth=5, max_bfs_breadth=3)
    assert NgramServerSetting(draft_tokens=4, max_bfs_breadth=4).label == "tokens4-bfs1-4-depth18"
    # SGLang replaces an explicit --speculative-eagle-topk with the breadth, without a word
    topk = launch_from_args(["--speculative-num-draft-tokens", "8", "--speculative-eagle-topk", "4"])
    assert any("replaces it with the max BFS breadth 10" in change for change in silent_changes(topk))


TREE_AND_CHAIN = [{"draft_tokens": 4, "max_bfs_breadth": 1}, {"draft_tokens": 8, "max_bfs_breadth": 4}]


@pytest.mark.parametrize(
    "extra_args, refused",
    [
        ([], None),
        (
            ["--attention-backend", "flashinfer", "--page-size", "64"],
            None,
        ),  # the one backend for trees on pages
        (["--attention-backend", "flashmla"], "page size 64 on flashmla"),  # flashmla forces pages of 64
        (["--attention-backend", "trtllm_mla", "--page-size", "1"], "page size 64 on trtllm_mla"),
        (["--page-size", "16"], "page size 16 on the default backend"),
    ],
)
def test_ngram_trees_need_an_attention_backend_sglang_serves_them_on(extra_args, refused):
    if refused is None:
        assert len(settings(extra_args=extra_args, ngram_settings=TREE_AND_CHAIN).ngram_settings) == 2
        return
    with pytest.raises(ValueError, match=refused) as info:
        settings(extra_args=extra_args, ngram_settings=TREE_AND_CHAIN)
    assert "tokens8-bfs1-4" in str(info.value) and "tokens4-bfs1-1" not in str(info.value)
    settings(
        extra_args=extra_args, ngram_settings=TREE_AND_CHAIN[:1]
    )  # a chain (breadth 1) runs on any backend


def test_launch_flags_that_break_every_ngram_server_are_refused():
    with pytest.raises(ValueError, match="--enable-dp-attention: SGLang 0.5.23 fails"):
        settings(extra_args=["--enable-dp-attention"], ngram_settings=TREE_AND_CHAIN[:1])
    with pytest.raises(ValueError, match="go to every server"):
        settings(extra_args=["--speculative-eagle-topk", "4"])


def test_the_ngram_settings_of_the_configs_are_what_sglang_serves():
    for name in ("kimi-k2.5", "rehearsal"):
        sweep = load_config(REPO / "configs" / f"{name}.yaml").benchmark.sglang.ngram_settings
        assert len(sweep) >= 3 and {s.max_bfs_breadth for s in sweep} >= {1, 10}
        assert all(s.draft_tokens >= s.max_bfs_breadth for s in sweep)
    kimi = REPO / "configs" / "kimi-k2.5.yaml"
    with pytest.raises(ConfigError, match="replaced by benchmark.sglang.ngram_settings"):
        load_config(kimi, ["benchmark.sglang.ngram_args=[--speculative-ngram-capacity, '100']"])
    with pytest.raises(ConfigError, match="the same setting twice"):
        load_config(kimi, ["benchmark.sglang.ngram_settings=[{draft_tokens: 12}, {draft_tokens: 12}]"])


def test_the_standin_refuses_ngram_flags_sglang_refuses():
    base = [
        sys.executable,
        "-m",
        "pipeline.dev.sglang_standin",
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


def test_each_domain_gets_the_acceptance_of_its_own_requests_with_ngram_at_its_fastest():
    from pipeline.engines.sglang_bench import acceptance_of, per_domain
    from pipeline.stages.benchmark import domain_acceptance

    by_request = per_domain(RECORDED + RECORDED[:1], ["math", "code", "math"])
    assert by_request["math"]["tokens"] == 12 and by_request["math"]["tau_measured"] == 3.0  # a, a
    assert by_request["code"]["tokens"] == 4 and by_request["code"]["accepted_histogram"] == [2, 1]  # b
    pooled = acceptance_of(RECORDED)
    # per position: the share of verify steps that accepted more than i drafts, from the summed histogram
    assert pooled["acceptance_per_position"] == [round(3 / 5, 4), round(2 / 5, 4), round(1 / 5, 4)]
    chosen = {"tokens": 10, "requests": 2, "tau_measured": 2.0}
    record = domain_acceptance(
        {
            "baseline": {"math": {"tokens": 10, "requests": 2}},
            "ngram:fast": {"math": chosen},
            "ngram:slow": {"math": {"tokens": 10, "requests": 2, "tau_measured": 9.0}},
            "candidate": {"math": {**chosen, "tau_measured": 3.0}},
        },
        "ngram:fast",
    )
    assert set(record["math"]) == {"baseline", "ngram", "candidate"}
    assert record["math"]["ngram"].tau_measured == 2.0 and record["math"]["candidate"].tau_measured == 3.0


def test_recorded_responses_give_throughput_and_acceptance():
    summary = summarize_responses(RECORDED, seconds=2.0)
    assert summary["tokens"] == 10 and summary["tok_s"] == 5.0
    assert summary["tau_measured"] == 2.0  # 10 completion tokens over 5 verify forwards
    assert summary["accepted_histogram"] == [2, 1, 1, 1]
    plain = summarize_responses([{"meta_info": {"completion_tokens": 8}}], seconds=4.0)
    assert plain == {"requests": 1, "tokens": 8, "seconds": 4.0, "tok_s": 2.0}


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


def test_the_drafters_setting_is_chosen_by_timing_each_candidate_server(
    tiny_target_dir, tiny_tokenizer, tmp_path
):
    """benchmark.sglang.candidates: one stand-in server per setting, each checked to serve the flags it was
    launched with, timed on the same prompts in the same rounds; the choice rule picks among them."""
    from pipeline.decoding.choice import choose
    from pipeline.engines.sglang_bench import time_settings
    from pipeline.records import MethodResult
    from pipeline.stages.benchmark import server_rounds, timed_server_settings
    from tests.test_records import eval_record

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
    from pipeline.engines.sglang_bench import require_served_setting, running_server
    from pipeline.ops.registry import sglang_flags

    drafter_dir = drafter_dir_of(tiny_target_dir, tmp_path)
    config = standin_settings(tiny_target_dir)
    command = [*launch_command(config, "baseline"), *sglang_flags(str(drafter_dir), 3, 1, 6)]
    with running_server(command, config) as url:
        require_served_setting(url, (3, 1, 4))
        with pytest.raises(SGLangBenchmarkFailed, match=r"launched with .* \(3, 1, 6\) serves \(3, 1, 4\)"):
            require_served_setting(url, (3, 1, 6))


def test_a_candidate_setting_must_be_one_sglang_serves():
    with pytest.raises(ValueError, match="draft_tokens == steps \\+ 1"):
        settings(candidates=[{"steps": 3, "topk": 1, "draft_tokens": 6}])
    with pytest.raises(ValueError, match="exceeds the 7 nodes"):
        settings(candidates=[{"steps": 2, "topk": 2, "draft_tokens": 8}])
    with pytest.raises(ValueError, match="lists a setting twice"):
        settings(candidates=[{"steps": 2, "topk": 1, "draft_tokens": 3}] * 2)
