"""Validation of every id or name that becomes part of a path or object key."""

from __future__ import annotations

import re

MAX_ID_LENGTH = 128
_ID = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_ID_LENGTH - 1}}}$")


class InvalidIdError(ValueError):
    """An id that would be unsafe as a path component or object key."""


def validate_id(value: str, what: str = "id") -> str:
    """Return `value` if it is a safe single path component, else raise InvalidIdError."""
    if not isinstance(value, str) or not _ID.match(value) or ".." in value:
        raise InvalidIdError(
            f"{what} {value!r} is not a valid id: use 1-128 of [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..'"
        )
    return value


def validate_key(key: str) -> str:
    """An object key relative to a store root: '/'-joined valid ids, nothing absolute or upward."""
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
        raise InvalidIdError(f"object key {key!r} must be a relative path without leading/trailing '/'")
    for part in key.split("/"):
        validate_id(part, f"component of key {key!r}")
    return key


def safe_id(text: str) -> str:
    """A valid id derived from arbitrary text (e.g. a scheduler's run id), stable for the same text."""
    import hashlib

    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:100] or "id"
    if cleaned != text:
        cleaned = f"{cleaned}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    return validate_id(cleaned.replace("..", "-"), "derived id")
