"""The reference speculative decoder's parts without a target: the n-gram proposer and draft-tree masks.
Decoding the tiny target: tests/integration/test_spec_decode.py."""

import pytest
import torch

from pipeline.decoding.reference_decoder import (
    NgramProposer,
)


def test_ngram_proposer_continues_the_latest_match():
    proposer = NgramProposer(max_match=3, min_match=1)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert proposer.propose([5, 6, 7], 3) == []
    assert proposer.propose([4, 8, 4], 2) == [8, 4]


def test_draft_tree_masks_and_acceptance():
    from pipeline.decoding.reference_decoder import DraftTree

    # root -> a(5) -> c(7);  root -> b(6)
    tree = DraftTree(tokens=[5, 6, 7], parents=[-1, -1, 0], depths=[1, 1, 2])
    assert tree.ancestor_rows() == [[0], [0, 1], [0, 2], [0, 1, 3]]
    # the target predicts 5 after the root, 7 after a, 9 after c
    assert tree.accepted_path(torch.tensor([5, 7, 0, 9])) == [0, 2]
    assert tree.accepted_path(torch.tensor([6, 7, 1, 9])) == [1]
    assert tree.accepted_path(torch.tensor([8, 7, 1, 9])) == []


def test_an_ngram_match_window_must_be_a_window():
    with pytest.raises(ValueError, match="1 <= min_match <= max_match, got 3..2"):
        NgramProposer(max_match=2, min_match=3)
    from pipeline.benchmark_settings import BenchmarkConfig

    with pytest.raises(ValueError, match="min_match 3 exceeds max_match 2"):
        BenchmarkConfig(ngram_settings=[{"min_match": 3, "max_match": 2}])
    with pytest.raises(ValueError, match="replaced by benchmark.ngram_settings"):
        BenchmarkConfig.model_validate({"ngram_max_match": 4})
