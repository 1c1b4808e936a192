"""Credentials in URLs: refused in configs, masked in every message, log line and record.

A URL's user and password (`scheme://user:password@host`) would reach run configs, manifests, XComs and
logs, so no config field takes them (they belong in connections and the environment), and every text that
may echo a URL (an error naming an endpoint, botocore's messages, a refused config value) goes through
`without_credentials` before anyone sees it.
"""

from __future__ import annotations

import logging
import re
import string
import sys
import traceback
from typing import Any

MASK = "***"

# where a URL ends: whitespace, a quote or a bracket (a repr, JSON, a log line), or the next URL
_URL_END = re.compile(r"[\s'\"<>`]")
# a word that may be a URL without a scheme: a run of what _URL_END does not end, not opening with a bracket
_WORD = re.compile(r"[^\s'\"<>`(\[{][^\s'\"<>`]*")
_SCHEME_CHARS = frozenset(string.ascii_letters + string.digits + "+.-")


def _scheme_start(text: str, separator: int, floor: int) -> int:
    """Where the scheme before the "://" at `separator` begins (not before `floor`)."""
    start = separator
    while start > floor and text[start - 1] in _SCHEME_CHARS:
        start -= 1
    return start


def _is_userinfo(text: str) -> bool:
    # "host/path/@x" is an "@" in a path, not a user; "user:pass" may hold "/" (a password in the clear)
    return "/" not in text or ":" in text


def without_credentials(text: str) -> str:
    """`text` with the user and password of every URL in it masked: `HTTP://u:p@ss/w@host` becomes
    `HTTP://***@host`, and `u:p@host` without a scheme `***@host`. A URL's user and password run to its last
    "@", since a password may hold "@" and "/" that were not percent-encoded; so an "@" further along a URL
    with a ":" before it masks the host too. Linear in the text's length (it may be a huge refused value)."""
    return _without_schemeless_credentials(_without_schemed_credentials(text))


def _without_schemed_credentials(text: str) -> str:
    """The users and passwords after a "scheme://" masked."""
    parts, done = [], 0
    separator = text.find("://")
    while separator != -1:
        authority = separator + 3
        following = text.find("://", authority)
        limit = len(text) if following == -1 else _scheme_start(text, following, authority)
        end_of_url = _URL_END.search(text, authority, limit)
        last_at = text.rfind("@", authority, end_of_url.start() if end_of_url else limit)
        if last_at != -1 and _is_userinfo(text[authority:last_at]):
            parts += [text[done:authority], MASK]
            done = last_at
        separator = following
    parts.append(text[done:])
    return "".join(parts)


def _without_schemeless_credentials(text: str) -> str:
    """`user:password@host` without a scheme masked, as botocore ("Invalid endpoint: u:p@host") and requests
    ("No connection adapters were found for 'u:p@host'") echo an endpoint given without one. Read per word
    (up to whitespace, a quote or a bracket, a leading opening bracket left out); a word's part before its
    first "scheme://" (masked already) and its last "@" is a user and password when it holds a ":". An e-mail
    address has none, so prose keeps it; "mailto:a@b" or "10:30@x" are masked too, which is harmless."""
    parts, done = [], 0
    for word in _WORD.finditer(text):
        start, end = word.span()
        separator = text.find("://", start, end)
        before_scheme = end if separator == -1 else _scheme_start(text, separator, start)
        last_at = text.rfind("@", start, before_scheme)
        if last_at != -1 and text.find(":", start, last_at) != -1:
            parts += [text[done:start], MASK]
            done = last_at
    parts.append(text[done:])
    return "".join(parts)


def holds_credentials(url: str) -> bool:
    """Whether a URL names a user or password, as `without_credentials` reads it."""
    return without_credentials(url) != url


def refuse_credentials(url: str, field: str, instead: str) -> str:
    """`url`, or ValueError when it holds a user or password; `instead` says where they belong."""
    if holds_credentials(url):
        raise ValueError(
            f"{field} must not hold credentials (they would reach configs, manifests and logs): {instead}"
        )
    return url


class _MaskedRecordFactory:
    """Builds log records whose message and traceback have every URL's credentials masked."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.wrapped(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: logging reports it when it formats the record
            return record
        masked = without_credentials(message)
        if masked != message:
            record.msg, record.args = masked, ()
        if record.exc_info and record.exc_info[1] is not None:
            shown = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            record.exc_text = without_credentials(shown)
        return record


def _print_masked_traceback(kind, error, trace) -> None:
    sys.stderr.write(without_credentials("".join(traceback.format_exception(kind, error, trace))))


def install_log_masking() -> None:
    """Mask credentials in every log record this process creates, whoever logs it and wherever it goes
    (handlers configured later included), and in the traceback of an error nothing caught; installed where
    the CLI, the training workers and tasks set up logging (more than once changes nothing)."""
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _MaskedRecordFactory):
        logging.setLogRecordFactory(_MaskedRecordFactory(factory))
    if sys.excepthook is sys.__excepthook__:  # a hook set before (one that sets the exit code) is kept
        sys.excepthook = _print_masked_traceback
