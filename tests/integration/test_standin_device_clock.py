"""The forwards the stand-in holds a request to under its modelled device clock (harness.sglang_standin
DeviceClock): a plain request one target forward per token, a speculative one its prefill and one
forward per verify, EAGLE3 also one draft step per drafted position of each cycle, n-gram none."""

from harness.sglang_standin import DeviceClock, StandinBackend
from tests.integration.test_sglang_bench import drafter_dir_of

GREEDY = {"sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}


class RecordingClock(DeviceClock):
    def __init__(self):
        super().__init__(0.0, 0.0)
        object.__setattr__(self, "held", [])

    def hold(self, started: float, target_forwards: int, draft_steps: int) -> None:
        self.held.append((target_forwards, draft_steps))


def held_forwards(backend: StandinBackend, request: dict) -> tuple[tuple[int, int], dict]:
    assert isinstance(backend.device_clock, RecordingClock)
    meta = backend.generate_one(request, [5, 9, 13, 2])["meta_info"]
    return backend.device_clock.held[-1], meta


def test_plain_and_ngram_requests_hold_their_target_forwards(tiny_target_dir):
    plain = StandinBackend(tiny_target_dir, None, device_clock=RecordingClock())
    held, meta = held_forwards(plain, {"sampling_params": {"max_new_tokens": 12, "temperature": 0.0}})
    assert held == (meta["completion_tokens"], 0)
    held, meta = held_forwards(plain, {**GREEDY, "return_logprob": True, "top_logprobs_num": 2})
    assert held == (12 + 1, 0)  # the decode, then the forward that scores prompt and output
    ngram = StandinBackend(tiny_target_dir, None, "NGRAM", draft_tokens=4, device_clock=RecordingClock())
    held, meta = held_forwards(ngram, GREEDY)
    assert held == (1 + meta["spec_verify_ct"], 0) and meta["spec_verify_ct"] < 12


def test_eagle3_requests_hold_their_draft_steps_too(tiny_target_dir, tmp_path):
    drafter = drafter_dir_of(tiny_target_dir, tmp_path)
    chain = StandinBackend(
        tiny_target_dir, None, "EAGLE3", drafter, num_steps=3, device_clock=RecordingClock()
    )
    held, meta = held_forwards(chain, GREEDY)
    assert held == (1 + meta["spec_verify_ct"], 3 * meta["spec_verify_ct"])
    tree = StandinBackend(
        tiny_target_dir,
        None,
        "EAGLE3",
        drafter,
        num_steps=2,
        topk=2,
        draft_tokens=4,
        device_clock=RecordingClock(),
    )
    held, meta = held_forwards(tree, GREEDY)
    assert held == (1 + meta["spec_verify_ct"], 2 * meta["spec_verify_ct"])
