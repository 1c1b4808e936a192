"""The EAGLE-3 training-time test: attention scheme, alignment, metrics and the vocabulary mapping."""

import pytest
import torch

from pipeline.drafter.model import DraftCache, Eagle3Drafter, dense_ttt_attention, ttt_attention
from pipeline.drafter.ttt import (
    MetricCounts,
    Teacher,
    teacher_from_last_hidden,
    teacher_from_topk,
    ttt_loss_and_counts,
)
from pipeline.drafter.vocab import build_mapping, mapping_from_d2t
from pipeline.engines.tiny_target import KIMI_ROPE_PARAMETERS
from tests.builders import small_drafter, small_mla_drafter

KIMI_YARN = {key: value for key, value in KIMI_ROPE_PARAMETERS.items() if key != "rope_theta"}


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ttt_attention_matches_a_dense_reference_values_and_gradients(steps):
    torch.manual_seed(steps)
    shape = (2, 3, 11, 8)
    q = torch.randn(shape, requires_grad=True)
    keys = [torch.randn(shape, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(shape, requires_grad=True) for _ in range(steps)]
    chunked = ttt_attention(q, keys, values, chunk=4)
    dense = dense_ttt_attention(q, keys, values)
    torch.testing.assert_close(chunked, dense, rtol=1e-5, atol=1e-5)
    grads_chunked = torch.autograd.grad(chunked.square().sum(), [q, *keys, *values])
    grads_dense = torch.autograd.grad(dense.square().sum(), [q, *keys, *values])
    for a, b in zip(grads_chunked, grads_dense, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("architecture", ["eagle3", "eagle3.1", "eagle3-mla"])
def test_training_unroll_equals_serving_time_chain_drafting(architecture):
    """TTT step k at anchor t must compute what the drafter computes at serving time, k steps into a chain
    (eagle3.1: both carry norm(h_out) from step to step and apply fc_norm; eagle3-mla: MLA attention with
    values wider than queries and keys, and YaRN RoPE)."""
    model = (
        small_mla_drafter(rope_scaling=KIMI_YARN)
        if architecture == "eagle3-mla"
        else small_drafter(architecture=architecture)
    ).eval()
    length = 9
    aux = torch.randn(1, length, 48)
    ids = torch.randint(0, 50, (1, length))
    with torch.no_grad():
        unrolled = model.ttt_forward(aux, ids, steps=3, chunk=4)
        for anchor in (0, 3, length - 4):
            cache = DraftCache()
            # real entries 0..anchor: feature f_s with the next token x_{s+1}
            h = model.decode(aux[:, : anchor + 1], ids[:, 1 : anchor + 2], 0, cache)[:, -1:]
            torch.testing.assert_close(h[0, 0], unrolled[0][0, anchor], rtol=1e-4, atol=1e-5)
            for step in (1, 2):
                token = ids[:, anchor + 1 + step : anchor + 2 + step]
                h = model.decode(h, token, anchor + step, cache)
                torch.testing.assert_close(h[0, 0], unrolled[step][0, anchor], rtol=1e-4, atol=1e-5)


def one_hot_logits_fn(choices: dict[int, torch.Tensor], vocab: int):
    """logits_fn for ttt_loss_and_counts whose step-k top-1 at anchor t is choices[k][t]."""
    calls = iter(sorted(choices))

    def logits(_h):
        return torch.nn.functional.one_hot(choices[next(calls)], vocab).float()[None] * 10

    return logits


def test_alignment_targets_and_mask_are_indexed_by_the_input_token():
    vocab, length, steps = 20, 7, 2
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0]])  # assistant tokens are x2..x5
    target_top1 = torch.arange(10, 10 + length)[None]  # teacher's top-1 at position p is 10 + p
    teacher = Teacher(
        target_top1,
        torch.softmax(torch.nn.functional.one_hot(target_top1, vocab).float() * 5, -1),
        torch.ones(1, length, dtype=torch.bool),
    )
    d2t = torch.zeros(vocab, dtype=torch.long)
    h = [torch.zeros(1, length, 4)] * steps
    t = torch.arange(length)
    # a drafter that is right everywhere: at step k, anchor t it predicts the teacher at t + 1 + k
    right = {k: (10 + t + 1 + k).clamp(max=vocab - 1) for k in range(steps)}
    _, counts = ttt_loss_and_counts(h, one_hot_logits_fn(right, vocab), ids, loss_mask, teacher, d2t, 0.8)
    # step 0 drafts where the input token x_{t+1} is an assistant token: anchors 1..4
    assert counts.masked == [4.0, 4.0]
    assert counts.correct == [4.0, 4.0]
    assert counts.chain == [4.0, 3.0] and counts.full_correct == [4.0, 3.0]
    # one position off (the classic bug) is never right
    off = {k: (10 + t + k).clamp(max=vocab - 1) for k in range(steps)}
    _, counts = ttt_loss_and_counts(h, one_hot_logits_fn(off, vocab), ids, loss_mask, teacher, d2t, 0.8)
    assert counts.correct == [0.0, 0.0]


def test_loss_is_weighted_by_step_and_normalized_by_masked_tokens():
    vocab, length = 5, 4
    ids = torch.zeros(1, length, dtype=torch.long)
    loss_mask = torch.tensor([[0, 1, 1, 1]])
    uniform = torch.full((1, length, vocab), 1.0 / vocab)
    teacher = Teacher(
        torch.zeros(1, length, dtype=torch.long), uniform, torch.ones(1, length, dtype=torch.bool)
    )
    h = [torch.zeros(1, length, 2)] * 2
    loss, counts = ttt_loss_and_counts(
        h,
        lambda _h: torch.zeros(1, length, vocab),
        ids,
        loss_mask,
        teacher,
        torch.zeros(vocab, dtype=torch.long),
        0.8,
    )
    ce = torch.log(torch.tensor(float(vocab)))  # uniform vs uniform cross-entropy per token
    torch.testing.assert_close(loss, ce * (1 + 0.8))
    assert counts.masked == [3.0, 2.0]


def test_metrics_from_summed_counts():
    counts = MetricCounts(
        3,
        loss_sum=[10.0, 8.0, 6.0],
        correct=[80.0, 50.0, 30.0],
        masked=[100.0, 100.0, 100.0],
        full_correct=[80.0, 40.0, 20.0],
        chain=[100.0, 100.0, 100.0],
    )
    summary = counts.summary()
    assert summary["acc"] == [0.8, 0.5, 0.3]
    assert summary["full_acc"] == [0.8, 0.4, 0.2]
    assert summary["cond_acc"] == [0.8, 0.5, 0.5]
    assert summary["tau_simulated"] == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert summary["loss"] == [0.1, 0.08, 0.06]
    other = MetricCounts(
        3,
        loss_sum=[0.0] * 3,
        correct=[20.0, 0.0, 0.0],
        masked=[100.0] * 3,
        full_correct=[20.0, 0.0, 0.0],
        chain=[100.0] * 3,
    )
    counts.add(other)  # 100/200 and 80/200 after summing counts, not the mean of two ratios
    assert counts.summary()["acc"][0] == 0.5
    assert MetricCounts.from_tensor(counts.as_tensor()).summary() == counts.summary()


def test_draft_vocabulary_mapping():
    counts = torch.tensor([0, 5, 5, 9, 0, 1, 5, 0])
    mapping = build_mapping(counts, 4)
    assert mapping.used_ids.tolist() == [1, 2, 3, 6]  # 9, then the three 5s; 5 (count 1) left out
    assert mapping.d2t.tolist() == [1, 1, 1, 3]  # offsets: target = draft + d2t[draft]
    assert mapping.t2d.tolist() == [False, True, True, True, False, False, True, False]
    padded = build_mapping(torch.tensor([0, 0, 3, 0, 0]), 3)
    assert padded.used_ids.tolist() == [0, 1, 2]  # lowest unused ids fill the rest
    again = mapping_from_d2t(mapping.d2t, 8)
    assert again.used_ids.tolist() == mapping.used_ids.tolist() and torch.equal(again.t2d, mapping.t2d)
    with pytest.raises(ValueError):
        mapping_from_d2t(torch.tensor([0, 0, 9]), 8)


def test_topk_teacher_restricts_and_renormalizes_to_the_draft_vocabulary():
    draft_index = torch.tensor([-1, 0, -1, 1, 2])  # target ids 1, 3, 4 are in a 3-token draft vocabulary
    topk_ids = torch.tensor([[[3, 0, 4], [0, 2, 3], [2, 0, 1]]])
    logprobs = torch.log(torch.tensor([[[0.5, 0.3, 0.1], [0.6, 0.3, 0.05], [0.7, 0.2, 0.1]]]))
    teacher = teacher_from_topk(topk_ids, logprobs, draft_index, 3)
    assert teacher.argmax.tolist() == [[3, 0, 2]]  # the full-vocabulary top-1, in or out of the draft vocab
    torch.testing.assert_close(teacher.probs[0, 0], torch.tensor([0.0, 0.5 / 0.6, 0.1 / 0.6]))
    torch.testing.assert_close(teacher.probs[0, 1], torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(teacher.probs[0, 2], torch.tensor([1.0, 0.0, 0.0]))


def test_topk_and_last_hidden_teachers_agree_when_k_covers_the_vocabulary():
    torch.manual_seed(0)
    vocab, hidden = 12, 4
    lm_head = torch.randn(vocab, hidden)
    last = torch.randn(1, 5, hidden)
    used = torch.tensor([1, 2, 5, 7, 11])
    draft_index = torch.full((vocab,), -1)
    draft_index[used] = torch.arange(5)
    exact = teacher_from_last_hidden(last, lm_head, used)
    top = torch.log_softmax(last @ lm_head.T, -1).topk(vocab, -1)
    approx = teacher_from_topk(top.indices, top.values, draft_index, 5)
    assert torch.equal(exact.argmax, approx.argmax)
    torch.testing.assert_close(exact.probs, approx.probs)
    assert torch.equal(exact.expressible, torch.isin(exact.argmax, used))
    assert torch.equal(exact.expressible, approx.expressible)


def test_tree_width_counts_follow_the_draft_top_k():
    vocab, length = 6, 4
    ids = torch.zeros(1, length, dtype=torch.long)
    loss_mask = torch.tensor([[1, 1, 1, 1]])
    target_top1 = torch.tensor([[0, 2, 3, 1]])
    teacher = Teacher(
        target_top1,
        torch.nn.functional.one_hot(target_top1, vocab).float(),
        torch.ones(1, length, dtype=torch.bool),
    )
    d2t = torch.zeros(vocab, dtype=torch.long)
    # the draft ranks token 1 first and token 2 second everywhere
    logits = torch.tensor([0.0, 5.0, 4.0, 0.0, 0.0, 0.0]).expand(1, length, vocab)
    h = [torch.zeros(1, length, 2)] * 2
    _, counts = ttt_loss_and_counts(h, lambda _h: logits, ids, loss_mask, teacher, d2t, 0.8, topk_levels=(2,))
    # step 0 targets positions 1..3 -> tokens 2, 3, 1: top-1 right once (1), top-2 right twice (2 and 1)
    assert counts.correct[0] == 1 and counts.full_correct_at[2][0] == 2
    # step 1: no anchor has both of its targets (steps 0 and 1) within the top-2
    assert counts.full_correct_at[2][1] == 0
    again = MetricCounts.from_tensor(counts.as_tensor(), (2,))
    assert again.summary()["full_acc_at"] == counts.summary()["full_acc_at"]


def test_topk_teacher_marks_positions_whose_top1_is_outside_the_draft_vocabulary():
    draft_index = torch.tensor([-1, 0, -1, 1, 2])  # target ids 1, 3, 4 are in a 3-token draft vocabulary
    # top-1 inside; top-1 outside but the rest inside; no draft token in the top-K at all
    topk_ids = torch.tensor([[[3, 0], [0, 4], [2, 0]]])
    logprobs = torch.log(torch.tensor([[[0.6, 0.3], [0.6, 0.3], [0.7, 0.2]]]))
    teacher = teacher_from_topk(topk_ids, logprobs, draft_index, 3)
    assert teacher.expressible.tolist() == [[True, False, False]]


def masked_loss_case():
    """Five positions, all assistant tokens; the target's top-1 at position 2 is outside a 3-token
    draft vocabulary (target ids 1, 3, 4), though its top-2 is inside."""
    draft_index = torch.tensor([-1, 0, -1, 1, 2])
    topk_ids = torch.tensor([[[1, 3], [3, 1], [0, 4], [4, 1], [1, 4]]])
    logprobs = torch.log(torch.tensor([[[0.7, 0.2]] * 5]))
    teacher = teacher_from_topk(topk_ids, logprobs, draft_index, 3)
    d2t = torch.tensor([1, 2, 2])  # draft 0 -> 1, 1 -> 3, 2 -> 4
    loss_mask = torch.ones(1, 5, dtype=torch.long)
    return teacher, d2t, loss_mask


def test_loss_leaves_out_positions_the_draft_vocabulary_cannot_express():
    """SpecForge's position_mask = t2d[top-1] * loss_mask: no loss where the target's top-1 is not a
    draft token (the drafter cannot be right there), and no all-zero target ever enters the mean."""
    teacher, d2t, loss_mask = masked_loss_case()
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 3)
    h = [torch.zeros(1, 5, 2)]
    loss, counts = ttt_loss_and_counts(h, lambda _h: logits, loss_mask, loss_mask, teacher, d2t, 0.8)
    # step 0's draft at anchor t is trained on the teacher at position t + 1: anchors 0..3 see positions
    # 1..4, and position 2 (anchor 1) is inexpressible
    per_anchor = -(teacher.probs[0, 1:] * torch.log_softmax(logits[0, :4], -1)).sum(-1)
    expected = per_anchor[[0, 2, 3]].mean()
    torch.testing.assert_close(loss, expected)
    assert counts.masked == [4.0] and counts.inexpressible == [1.0]
    assert counts.loss_sum[0] == pytest.approx(float(per_anchor[[0, 2, 3]].sum()), rel=1e-6)
    summary = counts.summary()
    assert summary["inexpressible_fraction"] == [0.25]
    assert summary["loss"][0] == pytest.approx(float(expected), rel=1e-5)


def test_inexpressible_positions_count_as_misses_in_acceptance():
    """A drafter right at every position it can be right at: acceptance is 3 of 4, not 3 of 3."""
    teacher, d2t, loss_mask = masked_loss_case()
    draft_of = {1: 0, 3: 1, 4: 2}
    # the draft at anchor t predicts the teacher's top-1 at position t + 1, whenever it is a draft token
    best = torch.tensor([draft_of.get(int(t), 0) for t in teacher.argmax[0, 1:]] + [0])
    logits = torch.nn.functional.one_hot(best, 3).float()[None] * 10
    h = [torch.zeros(1, 5, 2)]
    _, counts = ttt_loss_and_counts(h, lambda _h: logits, loss_mask, loss_mask, teacher, d2t, 0.8)
    summary = counts.summary()
    assert summary["acc"] == [0.75] and summary["tau_simulated"] == pytest.approx(1.75)
    assert MetricCounts.from_tensor(counts.as_tensor()).summary() == summary


def test_both_teachers_mask_the_same_positions_in_the_objective():
    """The full-distribution teacher (last hidden state through lm_head) and a top-K teacher whose K
    covers the vocabulary give the same loss and counts, masking included."""
    from pipeline.drafter.objective import DraftObjective

    torch.manual_seed(3)
    vocab, hidden, length = 12, 16, 9
    drafter = small_drafter(vocab=vocab, hidden=hidden)
    mapping = build_mapping(torch.arange(vocab).flip(0), 5)  # target ids 7..11 are the draft vocabulary
    arch = drafter.arch
    arch.draft_vocab_size = 5
    drafter = Eagle3Drafter(arch, torch.randn(vocab, hidden))
    drafter.set_vocab_mapping(mapping.d2t, mapping.t2d)
    lm_head = torch.randn(vocab, hidden)
    last = torch.randn(1, length, hidden)
    top = torch.log_softmax(last @ lm_head.T, -1).topk(vocab, -1)
    batch = {
        "input_ids": torch.randint(0, vocab, (1, length)),
        "loss_mask": torch.ones(1, length, dtype=torch.long),
        "aux": torch.randn(1, length, 3 * hidden),
    }
    full = DraftObjective(drafter, lm_head, "last_hidden", 2, 0.8, 4).eval()
    topk = DraftObjective(drafter, None, "topk", 2, 0.8, 4).eval()
    with torch.no_grad():
        full_loss, full_counts = full(**batch, last_hidden=last)
        topk_loss, topk_counts = topk(**batch, topk_ids=top.indices, topk_logprobs=top.values)
    torch.testing.assert_close(full_loss, topk_loss)
    torch.testing.assert_close(full_counts.as_tensor(), topk_counts.as_tensor())
    expressible = torch.isin((last @ lm_head.T).argmax(-1), mapping.used_ids)[0]
    assert 0 < full_counts.inexpressible[0] == float((~expressible[1:]).sum())
