"""SGLang capture-server settings checked against the capture contract. The capture engine against an
independent reference: tests/integration/test_parity.py."""

import pytest

from pipeline.engines.sglang import capture_server_problems
from tests.builders import sglang_server_info


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({}, None),
        (
            {"return_aux_hidden_state_layer_ids": None},
            None,
        ),  # the EAGLE3 default for 61 layers is [1, 29, 57]
        ({"return_aux_hidden_state_layer_ids": [2, 30, 58]}, "captures aux layers [2, 30, 58]"),
        ({"disable_radix_cache": False}, "--disable-radix-cache"),
        ({"chunked_prefill_size": 2048}, "chunked_prefill_size 2048"),
        ({"enable_return_aux_hidden_states": False}, "needs --enable-return-aux-hidden-states"),
        ({"chunked_prefill_size": "absent"}, "cannot be verified"),
        ({"version": "0.5.14"}, "runs SGLang 0.5.14; captures are coded to 0.5.23"),
        ({"version": "absent"}, "runs SGLang (unreported)"),
    ],
)
def test_capture_servers_must_agree_with_the_contract(changes, problem):
    problems = capture_server_problems(
        sglang_server_info(**changes), [1, 29, 57], 61, 4096, aux_server=True, prompt_logprobs=False
    )
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_prompt_logprobs_make_the_radix_cache_harmless():
    info = sglang_server_info(disable_radix_cache=False)
    assert capture_server_problems(info, [1, 29, 57], 61, 4096, aux_server=True, prompt_logprobs=True) == []
