"""The standard evaluation sets a team reports a drafter on, read from the files their publishers ship, each
record turned into the prompts of one conversation (the target answers them; their reference answers are
not used). `prompts.sources[].format` names the set:

- mt_bench: FastChat's `data/mt_bench/question.jsonl`, {"question_id", "category", "turns": [two prompts]};
  the second prompt is asked after the target's answer to the first.
- gsm8k: OpenAI's `grade_school_math/data/test.jsonl`, {"question", "answer"}.
- humaneval: OpenAI's `HumanEval.jsonl.gz`, {"task_id", "prompt" (a signature and docstring), ...}; the
  target is asked to complete the function.
- math500: `test.jsonl` of HuggingFaceH4/MATH-500, {"problem", "solution", "answer", "subject", ...}.
- bfcl: the Berkeley Function Calling Leaderboard's single-turn files (`BFCL_v4_simple_python.json`,
  `_multiple`, `_parallel`...: JSON lines, despite the name), {"id", "question": [[messages]], "function":
  [JSON-schema function specs]}; the functions are offered in a system message, as text, because the chat
  template is rendered without tools. Its multi-turn files name their functions in other files and are
  refused (no "function").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pipeline.data.conversations import PROMPTS_IN_TURN, BadRecord

HUMANEVAL_ASK = "Complete the following Python function. Reply with the whole function in a code block.\n\n"
BFCL_TOOLS = (
    "You can call the following functions. To call one, reply with a JSON object "
    '{"name": <function name>, "arguments": {<argument>: <value>}}.\n\n'
)


def _text(record: dict[str, Any], field: str) -> str:
    value = record.get(field)
    if not isinstance(value, str) or not value.strip():
        raise BadRecord("missing_field", f"expected text in {field!r}")
    return value


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _record_id(record: dict[str, Any], field: str) -> str:
    value = record.get(field)
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise BadRecord("missing_field", f"expected an id in {field!r}")
    return str(value)


def _mt_bench(record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise BadRecord("missing_field", "expected 'turns', a list of prompts")
    return _record_id(record, "question_id"), [_user(turn) for turn in turns]


def _gsm8k(record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
    question = _text(record, "question")
    return str(record.get("id", question[:60])), [_user(question)]


def _humaneval(record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
    prompt = _text(record, "prompt")
    return _record_id(record, "task_id"), [_user(f"{HUMANEVAL_ASK}```python\n{prompt}```")]


def _math500(record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
    problem = _text(record, "problem")
    return str(record.get("unique_id", problem[:60])), [_user(problem)]


def _bfcl(record: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
    turns, functions = record.get("question"), record.get("function")
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, list) for turn in turns):
        raise BadRecord("missing_field", "expected 'question', a list of turns (lists of messages)")
    if not isinstance(functions, list) or not functions:
        raise BadRecord("missing_field", "expected 'function', a list of function specs")
    asked = [m for turn in turns for m in turn if isinstance(m, dict) and m.get("role") == "user"]
    if not asked or not all(isinstance(m.get("content"), str) and m["content"].strip() for m in asked):
        raise BadRecord("missing_field", "expected user messages with text in 'question'")
    tools = {"role": "system", "content": BFCL_TOOLS + json.dumps(functions, indent=1, sort_keys=True)}
    return _record_id(record, "id"), [tools] + [_user(m["content"]) for m in asked]


ADAPTERS: dict[str, Callable[[dict[str, Any]], tuple[str, list[dict[str, str]]]]] = {
    "mt_bench": _mt_bench,
    "gsm8k": _gsm8k,
    "humaneval": _humaneval,
    "math500": _math500,
    "bfcl": _bfcl,
}


def as_conversation(set_name: str, record: Any) -> dict[str, Any]:
    """A record of the standard set `set_name` as a conversation record: its prompts as user turns (after
    a system message, for BFCL's functions), its own `source` ("<set>:<its id>"). A record lacking what the
    set's format has raises BadRecord, counted and skipped like any bad record."""
    if not isinstance(record, dict):
        raise BadRecord("not_a_mapping")
    record_id, messages = ADAPTERS[set_name](record)
    converted: dict[str, Any] = {
        "messages": messages,
        "source": f"{set_name}:{record_id}",
        PROMPTS_IN_TURN: True,
    }
    if "domain" in record:
        converted["domain"] = record["domain"]
    return converted
