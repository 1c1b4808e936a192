"""The SGLang client's parsing: generations, stop tokens and hidden-state blocks in any pieces, truncated
or null. Over real HTTP against the stand-in server: tests/integration/test_sglang_engine.py."""

import numpy as np
import orjson
import pytest

from pipeline.engines import EngineError
from pipeline.engines.sglang import parse_generation, prompt_states
from pipeline.sglang_transport import split_hidden_states


def test_hidden_state_blocks_parse_without_python_floats_for_every_number():
    rows = np.random.default_rng(0).standard_normal((300, 40)).astype(np.float32)
    raw = orjson.dumps(
        {
            "text": "x",
            "meta_info": {"id": "r", "hidden_states": [rows.tolist(), [0.5] * 40], "prompt_tokens": 300},
        }
    )
    rest, values = split_hidden_states(raw)
    assert np.array_equal(values.reshape(300, 40), rows)
    assert orjson.loads(rest)["meta_info"] == {"id": "r", "hidden_states": None, "prompt_tokens": 300}
    assert split_hidden_states(b'{"meta_info": {"id": 1}}')[1] is None
    with pytest.raises(EngineError, match="chunked prefill"):
        prompt_states(values, 301, 40)


def test_stop_token_is_kept_and_aborts_fail():
    assert parse_generation(
        {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 1}}}
    ).output_ids == [5, 6, 1]
    assert parse_generation(
        {"output_ids": [5, 1], "meta_info": {"finish_reason": {"type": "stop", "matched": 1}}}
    ).output_ids == [5, 1]
    assert (
        parse_generation(
            {"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}}
        ).finish_reason
        == "length"
    )
    with pytest.raises(EngineError, match="aborted"):
        parse_generation({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}})
    with pytest.raises(EngineError, match="missing"):
        parse_generation({"meta_info": {}})


def test_hidden_states_streamed_in_any_pieces_parse_exactly_as_the_whole_body():
    from pipeline.sglang_transport import HiddenStateStream

    rows = (np.random.default_rng(1).standard_normal((97, 13)) * 3).astype(np.float32)
    for extra in ([], [[0.5] * 13, [0.25] * 13]):  # with and without decode-step rows after the block
        raw = orjson.dumps(
            {"meta_info": {"id": "r", "hidden_states": [rows.tolist(), *extra], "n": 97}, "text": "]],["}
        )
        for piece in (1, 7, 4096):
            parts: list[np.ndarray] = []
            stream = HiddenStateStream(parts.append, chunk_bytes=200)  # several parses per row block
            for start in range(0, len(raw), piece):
                stream.feed(raw[start : start + piece])
            rest, count = stream.finish()
            assert count == rows.size and len(parts) > 3
            assert np.array_equal(np.concatenate(parts), rows.ravel())
            assert orjson.loads(rest) == {
                "meta_info": {"id": "r", "hidden_states": None, "n": 97},
                "text": "]],[",
            }


def test_a_body_cut_inside_its_hidden_states_is_truncated_and_null_reads_as_nan():
    from pipeline.sglang_transport import HiddenStateStream, TruncatedResponse, parse_rows

    raw = orjson.dumps({"meta_info": {"hidden_states": [[[1.0, 2.0], [3.0, 4.0]]]}})
    stream = HiddenStateStream(lambda values: None)
    stream.feed(raw[: raw.index(b"3.0")])
    with pytest.raises(TruncatedResponse):
        stream.finish()
    assert np.isnan(parse_rows(b"[1.5,null],[2,3]")).tolist() == [False, True, False, False]
    for not_numbers in (b'[1.5,"x"]', b'[1.5,"2"]', b"[true,1]"):
        with pytest.raises(EngineError, match="not JSON numbers"):
            parse_rows(not_numbers)
    for not_rows in (b"[1,2],[3]", b"[1,[2]]", b"[1,2]]"):  # ragged, nested, unbalanced
        with pytest.raises(EngineError, match="not rows of JSON numbers"):
            parse_rows(not_rows)
    assert parse_rows(b" [1, 2],\n[3e-2,-4.5E+1] ").tolist() == pytest.approx([1, 2, 0.03, -45])


def test_a_null_or_absent_block_is_no_hidden_states_not_an_empty_one():
    assert split_hidden_states(b'{"meta_info": {"hidden_states": null, "id": 1}}')[1] is None
    with pytest.raises(EngineError, match="enable-return-hidden-states"):
        prompt_states(split_hidden_states(b'{"meta_info": {"hidden_states": null}}')[1], 3, 4)


def test_the_standins_health_setting_is_read_as_sglang_reads_it():
    from harness.sglang_standin import HEALTH_GENERATION_ENV, health_generation_enabled

    assert health_generation_enabled({}) is True  # SGLang 0.5.23's default
    assert health_generation_enabled({HEALTH_GENERATION_ENV: "No"}) is False
    assert health_generation_enabled({HEALTH_GENERATION_ENV: "1"}) is True
    with pytest.raises(SystemExit, match="not a boolean"):
        health_generation_enabled({HEALTH_GENERATION_ENV: "sometimes"})


def test_the_standin_runs_at_most_its_max_running_requests_at_once_as_sglang_resolves_them():
    """Unset, SGLang 0.5.23 runs a speculative server at 48 requests (arg_groups/speculative_hook.py:
    1086-1095, 1294-1303) and a plain one at what its memory holds; the stand-in queues what exceeds it."""
    import threading
    import time

    from harness.sglang_standin import StandinBackend, resolved_max_running_requests

    assert resolved_max_running_requests(None, "EAGLE3") == 48
    assert resolved_max_running_requests(None, "NGRAM") == 48
    assert resolved_max_running_requests(None, None) is None
    assert resolved_max_running_requests(6, "EAGLE3") == 6
    with pytest.raises(SystemExit, match="not a count"):
        resolved_max_running_requests(0, None)

    backend = object.__new__(StandinBackend)  # only its admission, not a model
    backend.running = threading.BoundedSemaphore(2)
    inside, most, lock, release = [0], [0], threading.Lock(), threading.Event()

    def generate(request, ids, counted):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        release.wait(timeout=30)
        with lock:
            inside[0] -= 1
        return {}

    backend._generate = generate
    threads = [threading.Thread(target=backend.generate_one, args=({}, [1])) for _ in range(5)]
    for thread in threads:
        thread.start()
    while True:  # two run; three wait for a slot
        with lock:
            if inside[0] == 2:
                break
        time.sleep(0.01)
    release.set()
    for thread in threads:
        thread.join(timeout=30)
    assert most[0] == 2 and inside[0] == 0
