"""The stand-in refuses the aux-capture flags SGLang 0.5.23 refuses
(srt/arg_groups/validation_hook.py:697-747), as the real server did when run on this machine
(docs/BENCHMARKS.md, issue 56)."""

import pytest

from harness.sglang_standin import aux_capture_refusal


@pytest.mark.parametrize(
    ("enabled", "ids", "algorithm", "draft", "refusal"),
    [
        (False, [1, 2, 3], None, None, "requires --enable-return-aux-hidden-states"),
        (True, [1, 2, 3], None, None, "needs --speculative-algorithm EAGLE3, DFLASH or DSPARK"),
        (True, None, "NGRAM", None, "got 'NGRAM'"),
        (True, [1, 2, 3], "EAGLE3", "/drafter", "drop --speculative-draft-model-path"),
        (True, [1, -2, 3], "EAGLE3", None, "must be non-negative"),
        (True, [1, 2, 2], "EAGLE3", None, "must not repeat a layer"),
        (True, [1, 2], "EAGLE3", None, "captures three layers"),
    ],
)
def test_capture_flags_sglang_refuses_are_refused(enabled, ids, algorithm, draft, refusal):
    assert refusal in aux_capture_refusal(enabled, ids, algorithm, draft)


@pytest.mark.parametrize(
    ("enabled", "ids", "algorithm", "draft"),
    [
        (True, [1, 2, 3], "EAGLE3", None),  # the capture manifest's flags
        (True, None, "EAGLE3", None),  # SGLang's default layers
        (False, None, "EAGLE3", "/drafter"),  # a serving replica
        (False, None, None, None),  # a plain server
    ],
)
def test_the_flags_sglang_accepts_are_accepted(enabled, ids, algorithm, draft):
    assert aux_capture_refusal(enabled, ids, algorithm, draft) is None
