import pytest

from pipeline.data.conversations import (
    BadRecord,
    normalize_conversation,
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
