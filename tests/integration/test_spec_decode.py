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
    from pipeline.benchmark.settings import BenchmarkConfig
    from pipeline.stages.benchmark import sweep_ngram

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
