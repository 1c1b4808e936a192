"""The reference speculative decoder: output identical to greedy, acceptance accounting."""

import pytest
import torch

from pipeline.data.conversations import prompt_ids
from pipeline.decoding.reference_decoder import (
    EagleProposer,
    NgramProposer,
    TargetRunner,
    greedy_decode,
    speculative_decode,
)
from pipeline.engines.tiny_target import corpus_turns
from tests.builders import AUX, random_drafter


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    turns = corpus_turns(heldout=True)[::40][:4]
    return [prompt_ids(tiny_tokenizer, [{"role": "user", "content": t.prompt}]) for t in turns]


class OracleProposer:
    """Proposes the known greedy continuation, wrong from position `wrong_at` of each chain on."""

    def __init__(self, continuation, prompt_len, wrong_at=99):
        self.continuation, self.prompt_len, self.wrong_at = continuation, prompt_len, wrong_at

    def start(self, context, aux):
        pass

    def propose(self, context, steps):
        done = len(context) - self.prompt_len
        drafts = self.continuation[done : done + steps]
        return [t if i < self.wrong_at else (t + 1) % 1000 for i, t in enumerate(drafts)]

    def accept(self, context, accepted, aux):
        pass


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_eagle_and_ngram_outputs_equal_greedy(tiny_model, tiny_tokenizer, tiny_target_dir, prompts, steps):
    eos = tiny_tokenizer.eos_token_id
    plain, with_aux = TargetRunner(tiny_model, None), TargetRunner(tiny_model, AUX)
    drafter = random_drafter(tiny_target_dir)
    with torch.inference_mode():
        for prompt in prompts:
            greedy = greedy_decode(plain, prompt, 40, eos)
            eagle = speculative_decode(with_aux, EagleProposer(drafter), prompt, 40, eos, steps)
            ngram = speculative_decode(plain, NgramProposer(), prompt, 40, eos, steps)
            assert eagle.tokens == greedy.tokens
            assert ngram.tokens == greedy.tokens
            assert sum(eagle.accepted_histogram) == eagle.verify_forwards


def test_acceptance_length_counts_accepted_drafts_plus_the_bonus(tiny_model, tiny_tokenizer, prompts):
    plain = TargetRunner(tiny_model, None)
    prompt = prompts[0]
    with torch.inference_mode():
        greedy = greedy_decode(plain, prompt, 41, None).tokens
        perfect = speculative_decode(plain, OracleProposer(greedy, len(prompt)), prompt, 41, None, 4)
        half = speculative_decode(plain, OracleProposer(greedy, len(prompt), wrong_at=2), prompt, 40, None, 4)
    assert perfect.tokens == greedy and half.tokens == greedy[:40]
    # 1 token from prefill, then 8 cycles of 4 accepted drafts + 1 bonus token
    assert perfect.verify_forwards == 8 and perfect.acceptance_length == 5.0
    assert perfect.accepted_histogram == [0, 0, 0, 0, 8]
    # then 13 cycles of 2 accepted drafts + 1 bonus token
    assert half.acceptance_length == 3.0 and half.accepted_histogram == [0, 0, 13, 0, 0]


@pytest.mark.parametrize("steps, topk, draft_tokens", [(2, 2, 4), (3, 4, 10), (4, 2, 8)])
def test_tree_drafting_output_equals_greedy(
    tiny_model, tiny_tokenizer, tiny_target_dir, prompts, steps, topk, draft_tokens
):
    from pipeline.decoding.reference_decoder import tree_speculative_decode

    eos = tiny_tokenizer.eos_token_id
    plain, with_aux = TargetRunner(tiny_model, None), TargetRunner(tiny_model, AUX)
    drafter = random_drafter(tiny_target_dir, seed=steps)
    with torch.inference_mode():
        for prompt in prompts:
            greedy = greedy_decode(plain, prompt, 40, eos)
            tree = tree_speculative_decode(
                with_aux, EagleProposer(drafter), prompt, 40, eos, steps, topk, draft_tokens
            )
            assert tree.tokens == greedy.tokens
            assert sum(tree.accepted_histogram) == tree.verify_forwards


def test_the_ngram_sweep_times_every_setting_and_keeps_the_fastest(tiny_model, tiny_tokenizer, prompts):
    from pipeline.benchmark.reference import sweep_ngram
    from pipeline.benchmark_settings import BenchmarkConfig

    settings = BenchmarkConfig(
        max_new_tokens=16,
        calibration_prompts=2,
        ngram_settings=[
            {"min_match": 1, "max_match": 1, "steps": 1},
            {"min_match": 1, "max_match": 4, "steps": 4},
            {"min_match": 3, "max_match": 8, "steps": 8},
        ],
    )
    chosen, sweep = sweep_ngram(tiny_model, tiny_tokenizer, prompts, settings)
    assert [entry.setting for entry in sweep.settings] == [
        "match1-1-steps1",
        "match1-4-steps4",
        "match3-8-steps8",
    ]
    fastest = max(sweep.settings, key=lambda entry: entry.result.tok_s)
    assert sweep.best == fastest.setting == chosen.label
    assert all(entry.result.round_tok_s and entry.result.tau_measured for entry in sweep.settings)
    assert sweep.settings[2].knobs == {"min_match": 3, "max_match": 8, "steps": 8}
    assert sum(sweep.settings[1].result.accepted_histogram or []) > 0  # 4-token drafts were verified
    assert len(sweep.settings[1].result.accepted_histogram or []) == 5


def test_a_whole_chain_counts_drafts_as_an_engine_that_drafts_no_partial_chains(tiny_model, prompts):
    """vLLM drafts its whole chain in every step and counts every draft accepted, also past max_tokens;
    WholeChainProposer makes the reference decoder count so: the same outputs, the last cycle's drafts
    counted in full (8 tokens, a chain of 4 that is always right: 1 + 5, then 2 drafts needed, 4 drafted)."""
    from pipeline.decoding.reference_decoder import WholeChainProposer

    runner = TargetRunner(tiny_model, None)
    prompt = prompts[0]
    greedy = greedy_decode(runner, prompt, 20, None).tokens
    needed = speculative_decode(runner, OracleProposer(greedy, len(prompt)), prompt, 8, None, 4)
    whole_chain = WholeChainProposer(OracleProposer(greedy, len(prompt)), 4)
    whole = speculative_decode(runner, whole_chain, prompt, 8, None, 4)
    assert needed.tokens == whole.tokens == greedy[:8]
    assert needed.accepted_histogram == [0, 0, 1, 0, 1] and whole.accepted_histogram == [0, 0, 0, 0, 2]


def test_the_serving_engines_acceptance_must_match_the_reference_decoders_counted_its_way(
    tiny_model, tiny_tokenizer, tiny_target_dir, prompts, tmp_path
):
    """The reference decoder beside a serving engine (benchmark.reference_beside): the engine's candidate
    acceptance against the reference decoder's on the same prompts and chain, counted as the engine counts;
    a relative difference past benchmark.acceptance_tolerance refuses the candidate (verdict "mismatch"),
    and outputs that differ fail the benchmark."""
    from pipeline.benchmark.figures import histogram_acceptance, outputs_sha256
    from pipeline.benchmark.job import BenchJob, BenchmarkFailed
    from pipeline.benchmark.reference import acceptance_check, chain_acceptance
    from pipeline.config import load_config
    from pipeline.promotion import speed_decision
    from tests.builders import bench_record, eval_record
    from tests.conftest import storage_config, tiny_config_dict

    config = load_config(data=tiny_config_dict(storage_config("file", tmp_path, None)))
    drafter = random_drafter(tiny_target_dir)
    job = BenchJob(
        config=config,
        run_id="r1",
        target_dir=tiny_target_dir,
        tokenizer=tiny_tokenizer,
        prompts=prompts,
        domains=["general"] * len(prompts),
        drafter_dirs={},
        evaluation=eval_record(),
        aux_layer_ids=AUX,
    )
    new_tokens, eos = config.benchmark.max_new_tokens, tiny_tokenizer.eos_token_id
    outputs, histogram = chain_acceptance(tiny_model, drafter, AUX, prompts, new_tokens, eos, 2, True)
    tau, per_position = histogram_acceptance(histogram)
    recorded = bench_record()  # a chain of 2

    def served(tau_measured: float, sha256: str):
        candidate = recorded.methods.candidate.model_copy(
            update={
                "tau_measured": tau_measured,
                "acceptance_per_position": per_position,
                "outputs_sha256": sha256,
            }
        )
        methods = recorded.methods.model_copy(update={"candidate": candidate})
        return recorded.model_copy(update={"engine": "vllm", "engine_version": "0.32.0", "methods": methods})

    same = acceptance_check(job, tiny_model, drafter, served(round(tau, 4), outputs_sha256(outputs)))
    assert same.passed and same.rel_diff == 0 and (same.engine, same.draft_steps) == ("vllm", 2)
    assert same.reference_tau == round(tau, 4) and same.tolerance == config.benchmark.acceptance_tolerance

    more = served(round(tau * 1.05, 4), outputs_sha256(outputs))
    check = acceptance_check(job, tiny_model, drafter, more)
    assert not check.passed and check.rel_diff == pytest.approx(0.05, abs=1e-3)
    decision = speed_decision(more.model_copy(update={"acceptance": check}), config.benchmark)
    assert decision.verdict == "mismatch" and not decision.promotable
    assert decision.reasons[0] == "speed decided by vllm 0.32.0"
    assert decision.reasons[-1].endswith("the engine serves other drafts than the ones judged")

    with pytest.raises(BenchmarkFailed, match="differ from the reference decoder's greedy outputs"):
        acceptance_check(job, tiny_model, drafter, served(round(tau, 4), "0" * 64))
