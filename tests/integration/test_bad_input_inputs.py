"""Bad input, issue 41's review: URL fields without a scheme (where a `user:password@` escaped the credentials
check and botocore and requests printed it), a huge later turn of a conversation (only the first was bounded
before tokenizing), and a prompt source whose directory holds an empty part among others (Spark writes one
for each empty partition)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.processes import free_port
from tests.builders import TokenizerSpy, one_source_prompts_config
from tests.conftest import REPO, published

pytestmark = pytest.mark.fault

LOCAL = REPO / "configs" / "local.yaml"
# a URL's user and password without its scheme: what a user pastes from a MinIO console or a cluster note
SCHEMELESS_SECRET = "admin:p@ss/w0rd@minio:9000"
SECRET_PARTS = ("p@ss", "w0rd", "admin")


def _shows_no_secret(text: str) -> bool:
    return not any(part in text for part in SECRET_PARTS)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ([f"storage.endpoint_url={SCHEMELESS_SECRET}"], "storage.endpoint_url"),
        (["storage.endpoint_url=minio:9000"], "storage.endpoint_url"),
        ([f'generate.sglang.urls=["{SCHEMELESS_SECRET}"]'], "generate.sglang.urls"),
        (['generate.sglang.urls=["sglang-0:30000"]'], "generate.sglang.urls"),
        (
            [
                'generate.sglang.urls=["http://127.0.0.1:1"]',
                f'generate.sglang.last_hidden_urls=["{SCHEMELESS_SECRET}"]',
            ],
            "generate.sglang.last_hidden_urls",
        ),
        ([f'capture.sglang.urls=["http://127.0.0.1:1", "{SCHEMELESS_SECRET}"]'], "capture.sglang.urls"),
        (
            [
                'capture.sglang.urls=["http://127.0.0.1:1"]',
                'capture.sglang.last_hidden_urls=["127.0.0.1:2"]',
            ],
            "capture.sglang.last_hidden_urls",
        ),
        ([f'generate.vllm_server.urls=["{SCHEMELESS_SECRET}"]'], "generate.vllm_server.urls"),
        (['generate.vllm_server.urls=["ftp://vllm:8000"]'], "generate.vllm_server.urls"),
    ],
)
def test_a_url_field_without_http_or_https_is_refused_naming_it(overrides, field, record):
    with pytest.raises(
        ConfigError, match="must start with http:// or https://|must not hold credentials"
    ) as no:
        load_config(LOCAL, overrides)
    message = str(no.value)
    assert field in message and _shows_no_secret(message), message
    record(
        "bad input", f"a URL without http(s):// in {field}", "ConfigError naming the field; no password shown"
    )


@pytest.mark.parametrize(
    "root", ["admin:p@ss/w0rd@minio:9000/bucket", "s3:admin:p@ss/w0rd@bucket/prefix", "S3://AKIA:p@ss@bucket"]
)
def test_a_storage_root_with_credentials_but_no_s3_scheme_is_refused(root, record):
    with pytest.raises(ConfigError, match="storage.root") as refused:
        load_config(LOCAL, [f"storage.root={root}"])
    assert _shows_no_secret(str(refused.value)), refused.value
    record(
        "bad input",
        f"a storage.root of {root.split(':')[0]}:...@ without s3://",
        "ConfigError, password not shown",
    )


def test_url_fields_with_a_scheme_or_a_plain_root_still_load(tmp_path):
    config = load_config(
        LOCAL,
        [
            f"storage.root={tmp_path / 'store'}",
            "storage.endpoint_url=HTTPS://minio.example.com:9000",
            'generate.sglang.urls=["http://sglang-0:30000", "https://sglang-1"]',
            'generate.vllm_server.urls=["http://vllm:8000"]',
        ],
    )
    assert config.generate.sglang is not None and config.generate.sglang.urls[1] == "https://sglang-1"


def test_a_schemeless_s3_endpoint_with_credentials_from_the_environment_is_masked(record):
    """boto3 takes AWS_ENDPOINT_URL_S3 where no storage.endpoint_url is set, and its error names it as given:
    `Invalid endpoint: AKIAKEY:top/secret@127.0.0.1:PORT`."""
    port = free_port()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "list",
            "--config",
            str(LOCAL),
            "storage.root=s3://drafter-tests/credentials",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AWS_ENDPOINT_URL_S3": f"AKIAKEY:top/secret@127.0.0.1:{port}"},
    )
    shown = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in shown, shown
    assert f"***@127.0.0.1:{port}" in shown, shown
    assert "top/secret" not in shown and "AKIAKEY" not in shown, shown
    record(
        "bad input", "an S3 endpoint user:password@host without a scheme in the environment", "masked, exit 1"
    )


def test_a_huge_later_turn_is_rejected_before_tokenizing_or_dedup(
    tmp_path, monkeypatch, tiny_tokenizer, record
):
    from pipeline.data.dedup import NearDuplicateFilter
    from pipeline.stages import prompts, run_stage

    spy = TokenizerSpy(tiny_tokenizer)
    monkeypatch.setattr(prompts, "load_tokenizer", lambda *args: spy)
    minhashed: list[int] = []

    class NearDuplicateSpy(NearDuplicateFilter):
        def check_and_add(self, text: str) -> bool:
            minhashed.append(len(text))
            return super().check_and_add(text)

    monkeypatch.setattr(prompts, "NearDuplicateFilter", NearDuplicateSpy)
    huge = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "def f(x):"},
                {"role": "assistant", "content": "return x"},
                {"role": "user", "content": "def g(x): return x  # " * 250_000},
            ]
        }
    )
    good = [json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) for i in range(8)]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(good[:4] + [huge] + good[4:]) + "\n")
    config, store = one_source_prompts_config(tmp_path, {"kind": "jsonl", "path": str(source)})
    manifest = published(store, run_stage("prompts", config, "huge-turn", store))
    counts = manifest["counts"]
    assert counts["kept"] == 8 and counts["rejected.too_long"] == 1, counts
    assert manifest["rejected_examples"]["too_long"] == [f"{source}:5"]
    assert 0 < spy.longest < 10_000, spy.longest  # the 5.5 MB turn never reached the tokenizer
    assert minhashed and max(minhashed) < 10_000, max(minhashed)  # nor near-dedup's MinHash
    record("bad input", "a 5.5 MB second user turn", "rejected.too_long before tokenizing or dedup; 8 kept")


def _conversations(count: int, start: int = 0) -> str:
    return "".join(
        json.dumps({"messages": [{"role": "user", "content": f"def part_{i}(x): return x + {i}"}]}) + "\n"
        for i in range(start, start + count)
    )


def test_an_empty_part_among_others_is_skipped_and_named(tmp_path, caplog, record):
    from pipeline.stages import run_stage

    parts = tmp_path / "export"
    parts.mkdir()
    (parts / "part-00000.jsonl").write_text(_conversations(5))
    (parts / "part-00001.jsonl").write_text("")  # an empty partition
    (parts / "part-00002.jsonl").write_text(_conversations(5, start=5))
    config, store = one_source_prompts_config(tmp_path, {"kind": "jsonl", "path": str(parts)})
    with caplog.at_level(logging.WARNING, logger="pipeline.stages.prompts"):
        manifest = published(store, run_stage("prompts", config, "empty-part", store))
    assert manifest["counts"]["kept"] == 8, manifest["counts"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(parts / "part-00001.jsonl") in line and "skipp" in line for line in warnings), warnings
    record(
        "bad input",
        "a directory of JSONL parts, one of them empty",
        "the empty part skipped, named in a warning",
    )


@pytest.mark.parametrize("kind, suffix", [("jsonl", ".jsonl"), ("json", ".json")])
def test_a_source_whose_parts_are_all_empty_is_an_error_naming_them(tmp_path, kind, suffix, record):
    from pipeline.stages import run_stage
    from pipeline.stages.prompts import PromptSourceError

    parts = tmp_path / "export"
    parts.mkdir()
    for index in range(2):
        (parts / f"part-0000{index}{suffix}").write_text("")
    config, store = one_source_prompts_config(tmp_path, {"kind": kind, "path": str(parts)})
    with pytest.raises(PromptSourceError, match="empty") as refused:
        run_stage("prompts", config, "all-empty", store)
    assert all(str(parts / f"part-0000{i}{suffix}") in str(refused.value) for i in range(2)), refused.value
    assert store.list("prompts") == []
    record("bad input", f"a directory of {kind} parts, all empty", "PromptSourceError naming the empty parts")


def test_an_empty_json_part_among_others_is_skipped(tmp_path, caplog, record):
    from pipeline.stages import run_stage

    parts = tmp_path / "export"
    parts.mkdir()
    rows = [
        {"messages": [{"role": "user", "content": f"def part_{i}(x): return x + {i}"}]} for i in range(10)
    ]
    (parts / "part-00000.json").write_text(json.dumps(rows[:5]))
    (parts / "part-00001.json").write_text("")
    (parts / "part-00002.json").write_text(json.dumps(rows[5:]))
    config, store = one_source_prompts_config(tmp_path, {"kind": "json", "path": str(parts)})
    with caplog.at_level(logging.WARNING, logger="pipeline.stages.prompts"):
        manifest = published(store, run_stage("prompts", config, "empty-json-part", store))
    assert manifest["counts"]["kept"] == 8, manifest["counts"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(parts / "part-00001.json") in line for line in warnings), warnings
    record(
        "bad input",
        "a directory of JSON parts, one of them empty",
        "the empty part skipped, named in a warning",
    )
