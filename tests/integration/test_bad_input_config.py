"""Bad input to configs, the CLI and prompt files: credentials in URLs are refused and never shown, input made
to exhaust memory or time is refused quickly, and every mistake ends in one clear error naming its source,
never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, load_config
from pipeline.ops.deployment import load_deployment
from pipeline.ops.registry import promote, pull
from pipeline.processes import free_port
from pipeline.storage import StorageConfig, open_store
from tests.builders import SERVING, TokenizerSpy, drafter_dir, one_source_prompts_config
from tests.conftest import REPO, published

pytestmark = pytest.mark.fault

LOCAL = REPO / "configs" / "local.yaml"
# a password with "@" and "/" in it, not percent-encoded, behind an upper-case scheme
SECRET_URL = "HTTP://admin:p@ss/w0rd@127.0.0.1:9000"
SECRET_PARTS = ("p@ss", "w0rd", "admin")


def _shows_no_secret(text: str) -> bool:
    return not any(part in text for part in SECRET_PARTS)


def _drafter(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    """The CLI's error: one line of stderr, no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and result.stderr.strip() == errors[0], result.stderr
    return errors[0]


@pytest.mark.parametrize(
    "overrides, field",
    [
        ([f"storage.endpoint_url={SECRET_URL}"], "storage.endpoint_url"),
        (["storage.root=s3://admin:p@ss/w0rd@bucket/prefix"], "storage.root"),
        ([f'generate.sglang.urls=["{SECRET_URL}"]'], "generate.sglang.urls"),
        (
            [
                'generate.sglang.urls=["http://127.0.0.1:1"]',
                f'generate.sglang.last_hidden_urls=["{SECRET_URL}"]',
            ],
            "generate.sglang.last_hidden_urls",
        ),
        ([f'capture.sglang.urls=["http://127.0.0.1:1", "{SECRET_URL}"]'], "capture.sglang.urls"),
        (
            [
                'capture.sglang.urls=["http://127.0.0.1:1"]',
                f'capture.sglang.last_hidden_urls=["{SECRET_URL}"]',
            ],
            "capture.sglang.last_hidden_urls",
        ),
        ([f'generate.vllm_server.urls=["{SECRET_URL}"]'], "generate.vllm_server.urls"),
        (["tracking.mlflow_uri=https://admin:p@ss/w0rd@mlflow.example.com"], "tracking.mlflow_uri"),
        (
            ['prompts.sources=[{kind: jsonl, path: "s3://admin:p@ss/w0rd@bucket/prompts.jsonl"}]'],
            "prompts.sources.0.path",
        ),
    ],
)
def test_credentials_in_a_url_field_are_refused_and_not_echoed(overrides, field, record):
    with pytest.raises(ConfigError, match="must not hold credentials") as refused:
        load_config(LOCAL, overrides)
    message = str(refused.value)
    assert field in message and _shows_no_secret(message), message
    record(
        "bad input", f"a user:password@ in {field}", "ConfigError naming the field; the password not shown"
    )


@pytest.mark.parametrize(
    "watch, field",
    [
        ({"served_acceptance": {"metrics_urls": [f"{SECRET_URL}/metrics"], "floor": 2.0}}, "metrics_urls"),
        ({"served_acceptance": {"replicas_url": f"{SECRET_URL}/metrics", "floor": 2.0}}, "replicas_url"),
        ({"target_revision": {"server_info_url": f"{SECRET_URL}/server_info"}}, "server_info_url"),
    ],
)
def test_credentials_in_a_watched_url_of_the_deployment_are_refused(tmp_path, watch, field, record):
    deployment = yaml.safe_load((REPO / "configs" / "deployment" / "local.yaml").read_text())
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump({**deployment, "watch": watch}))
    with pytest.raises(ConfigError, match="must not hold credentials") as refused:
        load_deployment(path)
    assert field in str(refused.value) and _shows_no_secret(str(refused.value)), refused.value
    record(
        "bad input", f"a user:password@ in the deployment's watch.{field}", "ConfigError; password not shown"
    )


def test_the_cli_refuses_an_engine_url_with_credentials_without_printing_them(record):
    result = _drafter(
        "generate",
        "--config",
        str(LOCAL),
        "--run-id",
        "credentials",
        "generate.engine=sglang",
        f'generate.sglang.urls=["{SECRET_URL}"]',
    )
    assert result.returncode == 2, result.stderr
    assert "must not hold credentials" in result.stderr and "Traceback" not in result.stderr
    assert _shows_no_secret(result.stdout + result.stderr), result.stderr
    record("bad input", "an SGLang URL with user:password@ on the command line", "exit 2, password not shown")


def test_an_s3_endpoint_with_credentials_from_the_environment_is_an_error_without_them(record):
    """boto3 takes AWS_ENDPOINT_URL_S3 where no storage.endpoint_url is set: botocore's error names it."""
    port = free_port()
    result = _drafter(
        "list",
        "--config",
        str(LOCAL),
        "storage.root=s3://drafter-tests/credentials",
        env={"AWS_ENDPOINT_URL_S3": f"http://AKIAKEY:top/secret@127.0.0.1:{port}"},
    )
    assert result.returncode == 1
    line = _one_error_line(result)
    assert "StorageError" in line and f"***@127.0.0.1:{port}" in line, line
    assert "top/secret" not in result.stderr + result.stdout and "AKIAKEY" not in result.stderr
    record("bad input", "an S3 endpoint with user:password@ in the environment", "one masked line, exit 1")


def test_an_unreachable_s3_endpoint_is_one_line_naming_it(record):
    port = free_port()  # nothing listens there: every connection is refused
    started = time.monotonic()
    result = _drafter(
        "list",
        "--config",
        str(LOCAL),
        "storage.root=s3://drafter-tests/x",
        f"storage.endpoint_url=http://127.0.0.1:{port}",
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    line = _one_error_line(result)
    assert f"cannot reach the S3 endpoint http://127.0.0.1:{port}" in line, line
    assert elapsed < 90, (
        elapsed
    )  # botocore's retries back off from 50 ms on connection errors: seconds, not minutes
    record(
        "bad input",
        "storage.endpoint_url at a closed port",
        f"one line naming the endpoint, exit 1 ({elapsed:.0f} s)",
    )


@pytest.mark.parametrize(
    "arguments, named, what",
    [
        (
            ["train.epochs=["],
            "override train.epochs is not valid YAML",
            "a malformed override value (train.epochs=[)",
        ),
        (["--config", "configs"], "config file configs is a directory", "a config path that is a directory"),
    ],
)
def test_cli_mistakes_are_one_line_naming_the_source(arguments, named, what, record):
    config = [] if "--config" in arguments else ["--config", str(LOCAL)]
    result = _drafter("list", *config, *arguments)
    assert result.returncode == 2
    assert named in _one_error_line(result), result.stderr
    record("bad input", what, f"one line of error naming it ({named!r}), exit 2, no traceback")


def test_a_config_that_is_not_utf8_is_named(tmp_path, record):
    config = tmp_path / "latin1.yaml"
    config.write_bytes("storage:\n  root: /tmp/caf\u00e9\ntarget:\n  name: t\n".encode("latin-1"))
    result = _drafter("list", "--config", str(config))
    assert result.returncode == 2
    line = _one_error_line(result)
    assert f"config file {config} is not UTF-8 text" in line, line
    record("bad input", "a config file in Latin-1, not UTF-8", "one line naming the file, exit 2")


def _alias_bomb(levels: int) -> str:
    """Billion laughs: each anchor a list of ten aliases of the one before."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, record):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(
        "storage: {root: /tmp/x}\ntarget: {name: t}\n" + _alias_bomb(9) + "generate: {sglang: {urls: *l8}}\n"
    )
    # refused while its nodes are counted, at the limit: 10^9 strings once expanded, it never got that far
    with pytest.raises(ConfigError, match=r"expands to more than \d+ YAML nodes") as refused:
        load_config(bomb)
    assert str(bomb) in str(refused.value)
    with pytest.raises(ConfigError, match=r"override train\.epochs expands to more than"):
        load_config(LOCAL, ["train.epochs=" + _alias_bomb(9).replace("\n", ", ").join("{}")])
    with pytest.raises(ConfigError, match=r"override train\.epochs expands to more than"):
        load_config(LOCAL, ["train.epochs=&itself [*itself]"])  # an alias inside itself: endless
    record(
        "bad input",
        "a YAML alias bomb (10^9 nodes) as a config file and an override; an alias inside itself",
        "ConfigError at once",
        tried=3,
    )


@pytest.mark.parametrize(
    "overrides, what",
    [
        (["storage.root=ftp://host/" + "x" * 5_000_000], "a 5 MB value a validator quotes"),
        (["generate.sglang.urls=" + json.dumps(list(range(90_000)))], "90,000 URLs that are not strings"),
    ],
)
def test_validation_errors_of_huge_values_are_bounded(overrides, what, record):
    with pytest.raises(ConfigError) as refused:
        load_config(LOCAL, overrides)
    assert len(str(refused.value)) < 5_000, len(str(refused.value))
    record("bad input", f"a config with {what}", f"ConfigError of {len(str(refused.value))} characters")


def test_a_huge_prompt_line_is_rejected_without_tokenizing_it(tmp_path, monkeypatch, tiny_tokenizer, record):
    from pipeline.stages import prompts, run_stage

    spy = TokenizerSpy(tiny_tokenizer)
    monkeypatch.setattr(prompts, "load_tokenizer", lambda *args: spy)
    huge = json.dumps({"messages": [{"role": "user", "content": "def f(x): return x  # " * 250_000}]})
    good = [json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"}]}) for i in range(8)]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(good[:4] + [huge] + good[4:]) + "\n")
    config, store = one_source_prompts_config(tmp_path, {"kind": "jsonl", "path": str(source)})
    manifest = published(store, run_stage("prompts", config, "huge-line", store))
    assert manifest["counts"]["kept"] == 8 and manifest["counts"]["rejected.too_long"] == 1, manifest[
        "counts"
    ]
    assert manifest["rejected_examples"]["too_long"] == [f"{source}:5"]
    assert 0 < spy.longest < 10_000, spy.longest  # the 5.5 MB prompt never reached the tokenizer
    record("bad input", "a 5.5 MB prompt line", "rejected.too_long before templating or tokenizing; 8 kept")


@pytest.mark.parametrize(
    "kind, name, content",
    [("jsonl", "prompts.jsonl", ""), ("jsonl", "blank.jsonl", "\n\n  \n"), ("json", "prompts.json", "")],
)
def test_an_empty_prompt_file_is_named(tmp_path, kind, name, content, record):
    from pipeline.stages import run_stage
    from pipeline.stages.prompts import PromptSourceError

    empty = tmp_path / name
    empty.write_text(content)
    config, store = one_source_prompts_config(tmp_path, {"kind": kind, "path": str(empty)})
    with pytest.raises(PromptSourceError, match=f"prompt file {empty} is empty"):
        run_stage("prompts", config, "empty", store)
    assert store.list("prompts") == []
    record("bad input", f"an empty prompt file of kind {kind} ({name})", "PromptSourceError naming it, empty")


@pytest.fixture
def pulled(tmp_path) -> tuple[Path, Path]:
    """A store with a promoted drafter version of target `tgt`, and a verified pull of it."""
    root = tmp_path / "store"
    store = open_store(StorageConfig(root=str(root)))
    promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)
    return root, pull(store, "tgt", "production", tmp_path / "served")


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"{not json", "not a readable JSON config.json"),
        (b'{"hidden_size": 16, "caf\xe9": 1}', "not a readable JSON config.json"),
        (b"[1, 2, 3]", "holds no JSON object"),
        (
            b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 16}',
            "no integer num_hidden_layers, vocab_size",
        ),
    ],
)
def test_a_bad_target_config_is_named(tmp_path, pulled, content, problem, record):
    root, served = pulled
    bad = tmp_path / "target-config.json"
    bad.write_bytes(content)
    verify = _drafter("verify", str(served), "--target-config", str(bad))
    dest = tmp_path / "dest"
    pull_options = ["--target", "tgt", "--dest", str(dest), "--target-config", str(bad)]
    pulling = _drafter("pull", "--config", str(LOCAL), f"storage.root={root}", *pull_options)
    for result in (verify, pulling):
        assert result.returncode == 2
        line = _one_error_line(result)
        assert f"target config {bad}" in line and problem in line, line
    assert not dest.exists()
    record("bad input", f"--target-config ({problem}) to verify and pull", "one line naming the file, exit 2")
