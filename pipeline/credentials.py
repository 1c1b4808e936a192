"""Credentials in URLs: refused in configs, masked in every message, log line and record.

A URL's user and password (`scheme://user:password@host`), a query parameter or fragment with a token-like
name (`?token=...`, `#access_token=...`, `&X-Amz-Signature=...`), or the secret part of a host whose URLs
are themselves secrets (a Slack or Discord webhook, a GitHub token) would reach run configs, manifests,
XComs and logs, so no config field takes them (they belong in connections and the environment), and every
text that may echo a URL (an error naming an endpoint, botocore's messages, a refused config value) goes
through `without_credentials`, the one mask, before anyone sees it. Its cases, each with an example, are
tests/unit/test_credentials.py's tables.
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


# A query parameter's or fragment's name that says its value is a secret: one of these words in it
# (access_token, X-Amz-Security-Token, api_key, client_secret, X-Amz-Signature, X-Amz-Credential, auth, ...),
# or one of the short names services use for one (Google's `key`, Azure SAS's `sig`, OAuth's `code`)
_SECRET_WORDS = (
    r"token|secret|passw(?:or)?d|pwd|api[_-]?key|signature|credential|auth(?!ors?\b)|session|jwt|bearer"
)
_SECRET_NAMES = r"key|sig|code|sas"
_SECRET_PARAMETER = re.compile(
    rf"(?i)(?<=[?&#;])((?:[\w.-]*(?:{_SECRET_WORDS})[\w.-]*|(?:{_SECRET_NAMES}))=)([^&#;\s'\"<>`]+)"
)
# hosts whose URLs carry their secret in the path, and tokens recognisable by their prefix: (what, pattern
# whose group "secret" is masked)
SECRET_URL_FORMS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "a Slack webhook",
        re.compile(r"(?i)hooks\.slack\.com/(?:services|workflows|triggers)/(?P<secret>[^\s'\"<>`?#]+)"),
    ),
    (
        "a Discord webhook",
        re.compile(r"(?i)discord(?:app)?\.com/api/webhooks/\d+/(?P<secret>[^\s'\"<>`/?#]+)"),
    ),
    ("a Teams webhook", re.compile(r"(?i)\.webhook\.office\.com/(?P<secret>[^\s'\"<>`?#]+)")),
    (
        "a GitHub token",
        re.compile(r"(?P<secret>\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}))"),
    ),
    ("a Hugging Face token", re.compile(r"(?P<secret>\bhf_[A-Za-z0-9]{20,})")),
)


def without_credentials(text: str) -> str:
    """`text` with every secret a URL in it may carry masked (the one mask; refusals use it too):
    - a user and password: `HTTP://u:p@ss/w@host` becomes `HTTP://***@host`, and `u:p@host` without a scheme
      `***@host`. A URL's user and password run to its last "@", since a password may hold "@" and "/" that
      were not percent-encoded; so an "@" further along a URL with a ":" before it masks the host too;
    - the value of a query parameter or fragment with a token-like name (_SECRET_PARAMETER):
      `https://h/?token=S&x=1` becomes `https://h/?token=***&x=1`;
    - the secret part of SECRET_URL_FORMS (webhook paths, tokens known by their prefix).
    Linear in the text's length (it may be a huge refused value)."""
    masked = _without_schemeless_credentials(_without_schemed_credentials(text))
    masked = _SECRET_PARAMETER.sub(lambda found: found.group(1) + MASK, masked)
    return _without_secret_forms(masked)


def _without_secret_forms(text: str) -> str:
    for _, pattern in SECRET_URL_FORMS:
        text = pattern.sub(lambda found: _masked_group(found, "secret"), text)
    return text


def _masked_group(found: re.Match[str], group: str) -> str:
    start, end = found.span(group)
    whole = found.group(0)
    return whole[: start - found.start()] + MASK + whole[end - found.start() :]


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
    """`url`, or ValueError when it holds a secret (a user or password, a token-like query parameter or
    fragment, a secret path: whatever `without_credentials` masks); `instead` says where they belong. The
    message shows the URL masked."""
    masked = without_credentials(url)
    if masked != url:
        raise ValueError(
            f"{field} must not hold credentials, as {masked[:200]} does (a user or password, a token in its "
            f"query, fragment or path: they would reach configs, manifests and logs): {instead}"
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
