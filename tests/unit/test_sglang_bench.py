"""The production benchmark runner, without servers: launch flags per method, the n-gram settings SGLang
refuses, parsing of recorded responses. Against started stand-in servers:
tests/integration/test_sglang_bench.py."""

import pytest

from pipeline.benchmark.sglang import (
    SGLangBenchmarkFailed,
    batches,
    launch_command,
    summarize_responses,
)
from pipeline.benchmark_settings import BenchmarkConfig, NgramServerSetting
from pipeline.config import ConfigError, load_config
from pipeline.sglang_ngram_rules import launch_from_args, silent_changes
from tests.builders import sglang_bench_settings
from tests.conftest import KIMI_CONFIG, REPO

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


def test_launch_flags_per_method():
    config = sglang_bench_settings()
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
        "--max-running-requests",
        "8",
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
        sglang_bench_settings(draft_tokens=6)


def test_every_method_serves_the_same_load_and_a_benchmark_without_one_is_refused():
    """SGLang 0.5.23 runs an EAGLE or NGRAM server at 48 requests when --max-running-requests is unset,
    and a plain one at what its memory holds: every server gets the configured load, the baseline's too,
    and a benchmark with no load, or not measured at it, or measured above it, is refused."""
    config = sglang_bench_settings(max_running_requests=16)
    chain = NgramServerSetting(draft_tokens=4, max_bfs_breadth=1, max_trie_depth=8)
    for command in (
        launch_command(config, "baseline"),
        launch_command(config, "ngram", ngram=chain),
        launch_command(config, "candidate", drafter_dir="/d"),
    ):
        assert command.count("--max-running-requests") == 1
        assert command[command.index("--max-running-requests") + 1] == "16"
    with pytest.raises(ValueError, match="max_running_requests"):
        sglang_bench_settings(extra_args=["--max-running-requests=64"])
    sglang = {"launch": ["x"], "model_path": "/m", "concurrency": 8}
    with pytest.raises(ValueError, match="max_running_requests is not set.*48"):
        BenchmarkConfig(engine="sglang", sglang=sglang)
    with pytest.raises(ValueError, match="max_running_requests 48 is not measured"):
        BenchmarkConfig(engine="sglang", sglang={**sglang, "max_running_requests": 48}, batch_sizes=[1, 16])
    with pytest.raises(ValueError, match=r"batch sizes \[16\] exceed .*max_running_requests 8"):
        BenchmarkConfig(engine="sglang", sglang={**sglang, "max_running_requests": 8}, batch_sizes=[1, 16])
    measured = BenchmarkConfig(
        engine="sglang", sglang={**sglang, "max_running_requests": 48}, batch_sizes=[48]
    )
    assert measured.measured_batch_sizes() == [8, 48]


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
        assert (
            len(sglang_bench_settings(extra_args=extra_args, ngram_settings=TREE_AND_CHAIN).ngram_settings)
            == 2
        )
        return
    with pytest.raises(ValueError, match=refused) as info:
        sglang_bench_settings(extra_args=extra_args, ngram_settings=TREE_AND_CHAIN)
    assert "tokens8-bfs1-4" in str(info.value) and "tokens4-bfs1-1" not in str(info.value)
    sglang_bench_settings(
        extra_args=extra_args, ngram_settings=TREE_AND_CHAIN[:1]
    )  # a chain (breadth 1) runs on any backend


def test_launch_flags_that_break_every_ngram_server_are_refused():
    with pytest.raises(ValueError, match="--enable-dp-attention: SGLang 0.5.23 fails"):
        sglang_bench_settings(extra_args=["--enable-dp-attention"], ngram_settings=TREE_AND_CHAIN[:1])
    with pytest.raises(ValueError, match="go to every server"):
        sglang_bench_settings(extra_args=["--speculative-eagle-topk", "4"])


def test_the_ngram_settings_of_the_configs_are_what_sglang_serves():
    for name in ("kimi-k2.5", "rehearsal"):
        sweep = load_config(REPO / "configs" / f"{name}.yaml").benchmark.sglang.ngram_settings
        assert len(sweep) >= 3 and {s.max_bfs_breadth for s in sweep} >= {1, 10}
        assert all(s.draft_tokens >= s.max_bfs_breadth for s in sweep)
    kimi = KIMI_CONFIG
    with pytest.raises(ConfigError, match="replaced by benchmark.sglang.ngram_settings"):
        load_config(kimi, ["benchmark.sglang.ngram_args=[--speculative-ngram-capacity, '100']"])
    with pytest.raises(ConfigError, match="the same setting twice"):
        load_config(kimi, ["benchmark.sglang.ngram_settings=[{draft_tokens: 12}, {draft_tokens: 12}]"])


def test_each_domain_gets_the_acceptance_of_its_own_requests_with_ngram_at_its_fastest():
    from pipeline.benchmark.sglang import acceptance_of, domain_acceptance, per_domain

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


def test_prompts_go_in_equal_batches_none_empty():
    assert batches(list(range(10)), 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert batches([1, 2], 5) == [[1], [2]]


def test_a_candidate_setting_must_be_one_sglang_serves():
    with pytest.raises(ValueError, match="draft_tokens == steps \\+ 1"):
        sglang_bench_settings(candidates=[{"steps": 3, "topk": 1, "draft_tokens": 6}])
    with pytest.raises(ValueError, match="exceeds the 7 nodes"):
        sglang_bench_settings(candidates=[{"steps": 2, "topk": 2, "draft_tokens": 8}])
    with pytest.raises(ValueError, match="lists a setting twice"):
        sglang_bench_settings(candidates=[{"steps": 2, "topk": 1, "draft_tokens": 3}] * 2)
