"""Credentials in URLs: the one masking function, and the log masking the CLI, workers and tasks install."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from pipeline.credentials import holds_credentials, install_log_masking, without_credentials


@pytest.mark.parametrize(
    "text, masked",
    [
        ("HTTP://u:p@h", "HTTP://***@h"),
        ("S3://AKIA:secret@bucket/key", "S3://***@bucket/key"),
        ("http://admin:p@ss/w0rd@127.0.0.1:9000/x", "http://***@127.0.0.1:9000/x"),
        ("https://token@github.com/org/repo", "https://***@github.com/org/repo"),
        ("http://:only-a-password@host", "http://***@host"),
        (
            "tried http://a:one@h1/x, HTTP://b:two@h2 and 'https://c:th/ree@h3:8'; gave up",
            "tried http://***@h1/x, HTTP://***@h2 and 'https://***@h3:8'; gave up",
        ),
        ("http://a:one@h1,http://b:two@h2", "http://***@h1,http://***@h2"),
        ("['http://a:one@h1', \"http://b:two@h2\"]", "['http://***@h1', \"http://***@h2\"]"),
        (
            'Could not connect to the endpoint URL: "http://k:s@10.0.0.1:9/b?x=1"',
            'Could not connect to the endpoint URL: "http://***@10.0.0.1:9/b?x=1"',
        ),
    ],
)
def test_every_urls_user_and_password_are_masked(text, masked):
    assert without_credentials(text) == masked


@pytest.mark.parametrize(
    "text",
    [
        "http://127.0.0.1:9000/bucket/key",
        "s3://bucket/prefix/key@v2",
        "https://host/users/@me",
        "git@github.com:org/repo.git",
        "no URL at all: a@b, c://",
    ],
)
def test_text_without_credentials_is_left_as_it_is(text):
    assert without_credentials(text) == text and not holds_credentials(text)


@pytest.mark.parametrize(
    "text, masked",
    [
        ("Invalid endpoint: user:pw@minio:9000", "Invalid endpoint: ***@minio:9000"),
        (
            "No connection adapters were found for 'admin:p@ss/w0rd@host:30000/generate'",
            "No connection adapters were found for '***@host:30000/generate'",
        ),
        ("[\"a:one@h1\", 'b:two@h2']", "[\"***@h1\", '***@h2']"),
        ("a:one@h1,http://b:two@h2", "***@h1,http://***@h2"),
        ("endpoint (AKIA:top/secret@10.0.0.1:9)", "endpoint (***@10.0.0.1:9)"),
    ],
)
def test_a_user_and_password_without_a_scheme_are_masked(text, masked):
    assert without_credentials(text) == masked and holds_credentials(text)


@pytest.mark.parametrize(
    "text",
    [
        "write to ops@example.com or bob.smith@example.org at 10:30",
        "@field_validator('root')",
        "weights@v2: loaded 3 of 3",
    ],
)
def test_e_mail_addresses_and_at_signs_in_prose_are_left_as_they_are(text):
    assert without_credentials(text) == text


def test_masking_a_huge_schemeless_text_takes_linear_time():
    huge = ":" * 1_000_000 + "@" * 1_000_000 + " a:b@c" * 200_000
    masked = without_credentials(huge)
    assert masked.endswith(" ***@c") and "a:b" not in masked


def test_masking_a_huge_text_takes_linear_time():
    """A refused value is echoed in errors whatever its size; nested scanning would take hours here."""
    huge = "http://" + "a" * 2_000_000 + "://" * 200_000 + "http://u:p@h"
    assert without_credentials(huge).endswith("http://***@h")


@pytest.fixture
def masked_logging():
    """Log masking installed for one test; Python's record factory and excepthook put back after it."""
    factory, hook = logging.getLogRecordFactory(), sys.excepthook
    sys.excepthook = sys.__excepthook__
    install_log_masking()
    yield
    logging.setLogRecordFactory(factory)
    sys.excepthook = hook


def test_log_lines_and_their_tracebacks_show_no_credentials(masked_logging):
    shown = io.StringIO()
    handler = logging.StreamHandler(shown)
    logger = logging.getLogger("credentials-test")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.error("cannot reach SGLang at %s: refused", "HTTP://admin:p@ss/w0rd@10.0.0.1:30000")
        try:
            raise ConnectionError("endpoint http://AKIA:top/secret@127.0.0.1:9 refused")
        except ConnectionError:
            logger.exception("S3 request failed")
    finally:
        logger.removeHandler(handler)
    text = shown.getvalue()
    assert "cannot reach SGLang at HTTP://***@10.0.0.1:30000: refused" in text
    assert "endpoint http://***@127.0.0.1:9 refused" in text and "Traceback" in text
    assert not any(secret in text for secret in ("p@ss", "w0rd", "admin", "top/secret", "AKIA"))


def test_an_uncaught_errors_traceback_shows_no_credentials(masked_logging, capsys):
    try:
        raise RuntimeError("cannot reach http://u:pa55@host:1")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    printed = capsys.readouterr().err
    assert "RuntimeError: cannot reach http://***@host:1" in printed and "pa55" not in printed


def test_installing_twice_masks_once_and_keeps_an_exit_code_hook(masked_logging):
    def exit_code_hook(kind, error, trace) -> None:
        raise AssertionError("not called here")

    sys.excepthook = exit_code_hook
    install_log_masking()
    assert sys.excepthook is exit_code_hook
    record = logging.getLogRecordFactory()("x", logging.INFO, __file__, 1, "at %s", ("http://u:p@h",), None)
    assert record.getMessage() == "at http://***@h"


# the mask's table of query, fragment and host cases (issue 55): what a URL may carry its secret in
@pytest.mark.parametrize(
    "text, masked",
    [
        ("https://mlflow.example/?token=S3KR1T", "https://mlflow.example/?token=***"),
        ("https://h/x?a=1&api_key=ZZ&b=2", "https://h/x?a=1&api_key=***&b=2"),
        ("https://h/cb#access_token=abc&state=1", "https://h/cb#access_token=***&state=1"),
        (
            "https://h/?X-Amz-Signature=dead&X-Amz-Credential=AKIA/x",
            "https://h/?X-Amz-Signature=***&X-Amz-Credential=***",
        ),
        ("https://maps.example/?key=AIzaXYZ", "https://maps.example/?key=***"),
        ("https://acct.blob.example/c?sv=2024&sig=abc%2Bd", "https://acct.blob.example/c?sv=2024&sig=***"),
        (
            "https://h/?client_secret=x;Authorization=Bearer1",
            "https://h/?client_secret=***;Authorization=***",
        ),
        ("https://hooks.slack.com/services/T00/B00/XXXX", "https://hooks.slack.com/services/***"),
        ("https://discord.com/api/webhooks/123/abcDEF", "https://discord.com/api/webhooks/123/***"),
        (
            "https://org.webhook.office.com/webhookb2/abc@def/IncomingWebhook/x",
            "https://org.webhook.office.com/***",
        ),
        ("cloned with ghp_abcdefghijklmnopqrstuvwxyz0123", "cloned with ***"),
        ("HF_TOKEN hf_abcdefghijklmnopqrstuvwx", "HF_TOKEN ***"),
        ("http://u:p@h/?token=t", "http://***@h/?token=***"),
    ],
)
def test_secrets_in_a_urls_query_fragment_and_known_forms_are_masked(text, masked):
    assert without_credentials(text) == masked and holds_credentials(text)


@pytest.mark.parametrize(
    "text",
    [
        "https://h/?author=me&page=2",
        "http://sglang:30000/generate?stream=1",
        "prose that says token=5 without a URL",
        "https://hooks.example.com/services/T00",
    ],
)
def test_parameters_that_name_no_secret_are_left_as_they_are(text):
    assert without_credentials(text) == text and not holds_credentials(text)
