import pytest

from pipeline.data.conversations import (
    BadRecord,
    capture_sequence,
    normalize_conversation,
    tokenize_with_loss_mask,
)


def test_sharegpt_and_openai_formats_normalize_alike():
    sharegpt = {"conversations": [{"from": "human", "value": " hi "}, {"from": "gpt", "value": "hello"}]}
    openai = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert (
        normalize_conversation(sharegpt)
        == normalize_conversation(openai)
        == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    )


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"text": "no turns"}, "no_turns"),
        ({"messages": "not a list"}, "turns_not_a_list"),
        ({"messages": [{"content": "x"}]}, "missing_role"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": "   "}]}, "empty_turn"),
        ({"messages": [{"role": "user", "content": 3}]}, "content_not_text"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "no_user_turn_first"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            "roles_not_alternating",
        ),
        ("just a string", "not_a_mapping"),
    ],
)
def test_bad_records_name_their_reason(record, reason):
    with pytest.raises(BadRecord) as info:
        normalize_conversation(record)
    assert info.value.reason == reason


def test_loss_mask_covers_exactly_the_assistant_content_and_end_token(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "def sub(a, b):"},
        {"role": "assistant", "content": "    return a - b"},
    ]
    ids, mask = tokenize_with_loss_mask(tiny_tokenizer, messages)
    masked_text = "".join(tiny_tokenizer.decode([t]) for t, m in zip(ids, mask, strict=True) if m)
    assert masked_text == "    return a + b<|end|>    return a - b<|end|>"
    unmasked = tiny_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "<|user|>" in unmasked and "<|assistant|>" in unmasked and "return" not in unmasked


def test_capture_sequence_keeps_the_generated_ids_verbatim(tiny_tokenizer):
    messages = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "ignored text"}]
    generated = [5, 6, 7, tiny_tokenizer.eos_token_id]
    ids, mask = capture_sequence(tiny_tokenizer, messages, generated, max_length=100)
    assert ids[-4:] == generated and mask[-4:] == [1, 1, 1, 1]
    assert sum(mask) == 4
    assert tiny_tokenizer.decode(ids[:-4]).endswith("<|assistant|>")
    ids, mask = capture_sequence(tiny_tokenizer, messages, generated, max_length=len(ids) - 2)
    assert len(ids) == len(mask) and sum(mask) == 2
