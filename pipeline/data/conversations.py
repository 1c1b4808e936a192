"""Conversations: normalizing common formats, and rendering them with the target's chat template.

A normalized conversation is a list of {"role": "system"|"user"|"assistant", "content": str} that
starts (after an optional system message) with a user turn and alternates user/assistant, or, in a
record marked PROMPTS_IN_TURN (a standard set's, pipeline/data/standard_sets.py), holds user turns only:
prompts that the target answers in turn, as MT-Bench's two. Elsewhere two user turns in a row are a bad
record (an export that lost an answer).
"""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}


PROMPTS_IN_TURN = "prompts_in_turn"


class BadRecord(ValueError):
    """A source record that cannot become a conversation; `reason` is a short counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _turns_of(record: Any) -> list[Any]:
    if not isinstance(record, dict):
        raise BadRecord("not_a_mapping")
    for key in ("messages", "conversations", "conversation"):
        if key in record and record[key] is not None:
            turns = record[key]
            if not isinstance(turns, list):
                raise BadRecord("turns_not_a_list", key)
            return turns
    raise BadRecord("no_turns", "expected 'messages' or 'conversations'")


def _normalize_turn(turn: Any) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise BadRecord("turn_not_a_mapping")
    raw_role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if not isinstance(raw_role, str):
        raise BadRecord("missing_role")
    role = ROLE_ALIASES.get(raw_role.strip().lower())
    if role is None:
        raise BadRecord("unknown_role", raw_role)
    if not isinstance(content, str):
        raise BadRecord("content_not_text")
    content = content.replace("\r\n", "\n").strip()
    if not content:
        raise BadRecord("empty_turn")
    return {"role": role, "content": content}


def normalize_conversation(record: Any) -> list[dict[str, str]]:
    """ShareGPT (`conversations`/`from`/`value`) or OpenAI (`messages`/`role`/`content`) -> messages."""
    messages = [_normalize_turn(turn) for turn in _turns_of(record)]
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if any(m["role"] == "system" for m in body):
        raise BadRecord("system_not_first")
    if not body or body[0]["role"] != "user":
        raise BadRecord("no_user_turn_first")
    # a standard set's prompts asked in turn (as_conversation marks them): several user turns, no answers
    prompts_only = record.get(PROMPTS_IN_TURN) is True and all(m["role"] == "user" for m in body)
    for index, message in enumerate(body):
        expected = "user" if prompts_only or index % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise BadRecord("roles_not_alternating")
    return messages


def user_turn_count(messages: list[dict[str, str]]) -> int:
    return sum(1 for m in messages if m["role"] == "user")


def prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation prefix ending with the generation prompt for the next assistant turn."""
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def assistant_spans(
    tokenizer, messages: list[dict[str, str]], generation_prompt: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans the target generates (content + end-of-turn token)."""
    text = _render(tokenizer, messages, generation_prompt)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], True)
        through = _render(tokenizer, messages[: index + 1], False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError("the chat template does not render conversation prefixes as text prefixes")
        start = through.find(message["content"], len(before))
        if start < 0:
            raise ValueError("assistant content not found verbatim in the rendered conversation")
        end = start + len(message["content"])
        eos = tokenizer.eos_token
        if eos and through.startswith(eos, end):
            end += len(eos)
        spans.append((start, end))
    return text, spans


def _mask_from_offsets(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for start, end in encoded["offset_mapping"]:
        inside = end > start and any(s <= start and end <= e for s, e in spans)
        mask.append(1 if inside else 0)
    return list(encoded["input_ids"]), mask


def _mask_from_pieces(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """For tokenizers without character offsets (Python ones, such as Kimi's tiktoken tokenizer): the text
    tokenized piece by piece, cut at the span edges. That equals tokenizing it whole when every edge is a
    token edge, as where a turn starts after a special token and ends with one; checked, never assumed."""

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"]) if piece else []

    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, inside in ((text[cursor:start], 0), (text[start:end], 1)):
            piece_ids = encode(piece)
            ids += piece_ids
            mask += [inside] * len(piece_ids)
        cursor = end
    if ids != encode(text):
        raise ValueError(
            "the tokenizer gives no character offsets and the assistant turns do not start and end "
            "on token boundaries, so the loss mask cannot be placed"
        )
    return ids, mask


def tokenize_with_loss_mask(
    tokenizer, messages: list[dict[str, str]], max_length: int | None = None, generation_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and a mask that is 1 exactly on assistant-generated tokens."""
    text, spans = assistant_spans(tokenizer, messages, generation_prompt)
    mask_of = _mask_from_offsets if tokenizer.is_fast else _mask_from_pieces
    ids, mask = mask_of(tokenizer, text, spans)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def capture_sequence(
    tokenizer, messages: list[dict[str, str]], last_output_ids: list[int] | None, max_length: int
) -> tuple[list[int], list[int]]:
    """The token sequence to capture and its loss mask.

    When the final assistant turn's exact generated token ids are known, they are used verbatim
    after the rendered prefix (what the server saw), so the drafter trains on the very tokens the
    target produced; earlier turns are rendered from text, as a server renders chat history.
    """
    if last_output_ids is None or messages[-1]["role"] != "assistant":
        return tokenize_with_loss_mask(tokenizer, messages, max_length)
    ids, mask = tokenize_with_loss_mask(tokenizer, messages[:-1], generation_prompt=True)
    ids, mask = ids + list(last_output_ids), mask + [1] * len(last_output_ids)
    return ids[:max_length], mask[:max_length]
