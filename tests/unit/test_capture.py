"""Capture, without the model: a captured sample is validated, each problem named."""

import torch

from pipeline.engines import Capture, TeacherRequest
from pipeline.stages.capture import sample_problem


def test_sample_validation_names_the_problem():
    both = TeacherRequest(("last_hidden", "topk"), 2)
    topk = torch.log_softmax(torch.randn(4, 9), -1).topk(2, -1)
    good = Capture(torch.randn(4, 6), torch.randn(4, 2), topk.indices, topk.values)
    assert sample_problem(good, 4, 2, both) is None
    assert sample_problem(good, 5, 2, both) == "wrong_shape_aux"  # length disagrees with the token ids
    assert (
        sample_problem(Capture(good.aux, None, topk.indices, topk.values), 4, 2, both)
        == "missing_last_hidden"
    )
    nan = Capture(good.aux.clone(), good.last_hidden, topk.indices, topk.values)
    nan.aux[2, 1] = float("nan")
    assert sample_problem(nan, 4, 2, both) == "non_finite_aux"
    zero_row = Capture(good.aux.clone(), good.last_hidden, topk.indices, topk.values)
    zero_row.aux[1, 2:4] = 0  # the middle layer of one token
    assert sample_problem(zero_row, 4, 2, both) == "zero_row_aux"
    constant = Capture(good.aux, good.last_hidden.clone(), topk.indices, topk.values)
    constant.last_hidden[3] = 0.5
    assert sample_problem(constant, 4, 2, both) == "constant_row_last_hidden"
    assert (
        sample_problem(Capture(good.aux, good.last_hidden, topk.indices, -topk.values), 4, 2, both)
        == "invalid_topk"
    )
