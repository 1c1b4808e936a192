"""JSON Lines shards of conversation records (prompts and regenerated responses)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson


def encode_jsonl(records: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(record) + b"\n" for record in records)


def decode_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    Path(path).write_bytes(encode_jsonl(records))


def conversation_id(messages: list[dict[str, str]]) -> str:
    """Content hash of what the target is asked (system + user turns): the sample id.

    Assistant turns are excluded because generation replaces them; re-running a stage on the same
    prompts therefore yields the same ids and never duplicates a sample.
    """
    digest = hashlib.sha256()
    for message in messages:
        if message["role"] != "assistant":
            digest.update(message["role"].encode() + b"\x00" + message["content"].encode() + b"\x01")
    return digest.hexdigest()[:24]
