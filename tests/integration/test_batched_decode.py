"""Batched decoding in the reference decoder: several sequences verified in one target forward, each with
its own accepted length, every output equal to that sequence's own greedy decoding."""

import pytest
import torch

from pipeline.data.conversations import prompt_ids
from pipeline.decoding.batched import (
    BatchedTarget,
    EagleRows,
    NgramRows,
    RaggedRows,
    batched_speculative_decode,
)
from pipeline.decoding.reference_decoder import (
    EagleProposer,
    NgramProposer,
    TargetRunner,
    greedy_decode,
    speculative_decode,
)
from pipeline.engines.tiny_target import corpus_turns
from tests.builders import AUX, random_drafter

MAX_NEW = 32


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    """Five prompts of different lengths, so rows are ragged from the prefill on."""
    turns = corpus_turns(heldout=True)[::25][:5]
    ids = [prompt_ids(tiny_tokenizer, [{"role": "user", "content": t.prompt}]) for t in turns]
    assert len({len(p) for p in ids}) > 1
    return ids


@pytest.fixture(scope="module")
def greedy(tiny_model, tiny_tokenizer, prompts):
    runner = TargetRunner(tiny_model, None)
    with torch.inference_mode():
        return [greedy_decode(runner, p, MAX_NEW, tiny_tokenizer.eos_token_id).tokens for p in prompts]


def test_batched_greedy_equals_each_sequence_alone(tiny_model, tiny_tokenizer, prompts, greedy):
    with torch.inference_mode():
        batch = batched_speculative_decode(
            BatchedTarget(tiny_model, None), None, prompts, MAX_NEW, tiny_tokenizer.eos_token_id, 1
        )
    assert batch.rows == greedy
    assert batch.tokens == [t for row in greedy for t in row]
    assert batch.verify_forwards == 0  # plain decoding has no verify cycles to count


@pytest.mark.parametrize("steps", [1, 4])
def test_batched_eagle_and_ngram_equal_greedy_with_each_rows_own_acceptance(
    tiny_model, tiny_tokenizer, tiny_target_dir, prompts, greedy, steps
):
    eos = tiny_tokenizer.eos_token_id
    drafter = random_drafter(tiny_target_dir)
    with torch.inference_mode():
        eagle = batched_speculative_decode(
            BatchedTarget(tiny_model, AUX), EagleRows(drafter), prompts, MAX_NEW, eos, steps
        )
        ngram = batched_speculative_decode(
            BatchedTarget(tiny_model, None), NgramRows(NgramProposer()), prompts, MAX_NEW, eos, steps
        )
        alone = [
            speculative_decode(TargetRunner(tiny_model, AUX), EagleProposer(drafter), p, MAX_NEW, eos, steps)
            for p in prompts
        ]
        ngram_alone = [
            speculative_decode(TargetRunner(tiny_model, None), NgramProposer(), p, MAX_NEW, eos, steps)
            for p in prompts
        ]
    assert eagle.rows == greedy and ngram.rows == greedy
    # the same drafts as each sequence decoded alone: the same cycles and acceptance, row by row summed
    assert eagle.verify_forwards == sum(r.verify_forwards for r in alone)
    assert eagle.accepted_histogram == [
        sum(h) for h in zip(*(r.accepted_histogram for r in alone), strict=True)
    ]
    assert ngram.accepted_histogram == [
        sum(h) for h in zip(*(r.accepted_histogram for r in ngram_alone), strict=True)
    ]
    assert ngram.verify_forwards > len(prompts) and sum(ngram.accepted_histogram[1:]) > 0


def test_a_batch_of_one_is_the_single_sequence_decoder(tiny_model, tiny_tokenizer, tiny_target_dir, prompts):
    eos = tiny_tokenizer.eos_token_id
    drafter = random_drafter(tiny_target_dir, seed=1)
    with torch.inference_mode():
        batch = batched_speculative_decode(
            BatchedTarget(tiny_model, AUX), EagleRows(drafter), prompts[:1], 20, eos, 3
        )
        alone = speculative_decode(
            TargetRunner(tiny_model, AUX), EagleProposer(drafter), prompts[0], 20, eos, 3
        )
    assert batch.rows == [alone.tokens]
    assert batch.accepted_histogram == alone.accepted_histogram


def test_ragged_rows_compact_each_rows_live_columns_to_the_right_in_order():
    rows = RaggedRows(2)
    assert rows.extend(torch.tensor([[True, True, True], [True, False, False]])) is not None
    assert rows.live.tolist() == [[True, True, True], [False, False, True]]
    index = rows.extend(torch.tensor([[True, False], [True, True]]))
    assert index is not None
    # row 0: columns 0, 1, 2, 3 live (4 dead); row 1: 2, 3, 4 live, right-aligned after one dead column
    assert rows.live.tolist() == [[True, True, True, True], [False, True, True, True]]
    assert index[0].tolist() == [0, 1, 2, 3] and index[1, 1:].tolist() == [2, 3, 4]
    assert rows.lengths.tolist() == [4, 3]
    mask = rows.mask(torch.ones(2, 1, 1, dtype=torch.bool), torch.float32)
    assert mask.shape == (2, 1, 1, 5)
    assert torch.isinf(mask[1, 0, 0, 0]) and mask[1, 0, 0, 1:].eq(0).all()
