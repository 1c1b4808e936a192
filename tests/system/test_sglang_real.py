"""Real SGLang 0.5.23 on this CPU (`make sglang-venv`), driven by the pipeline's own SGLang client.

Two servers of the tiny Llama target, each started with the flags of its production manifest
(infra/k8s/sglang-generate.yaml, infra/k8s/sglang-capture.yaml), less what only suits Kimi-K2.5 on 8 GPUs,
plus what a CPU needs (LAUNCH_CHANGES, CPU_FLAGS: each with its reason):
- generation: the generate stage with generate.engine sglang (pipeline.engines.sglang.SGLangEngine) gives
  the HF engine's records: the same greedy tokens, finish reasons and teacher top-k ids, the log-probs equal
  to float32 noise (the set-up is tests/system/test_vllm_generate.py's);
- capture: SGLangEngine.verify_capture_servers accepts the capture server's real /server_info (and refuses
  it for other aux layers), and SGLangEngine.capture returns what HFEngine.capture computes: the aux hidden
  states within AUX_ABS_TOL, the same top-K teacher ids, their log-probs within LOGPROB_ABS_TOL.

SGLang runs from its own virtualenv with harness/sglang_cpu on its PYTHONPATH (a sitecustomize that sets one
module flag of SGLang's rotary embedding for the CPU; its docstring says why). EAGLE3 serving does not run
on a CPU (a Triton kernel with no CPU driver), so no test here serves a drafter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from pipeline.config import default_aux_layer_ids
from pipeline.engines import EngineError, TeacherRequest
from pipeline.retrying import await_health, poll_until
from tests.conftest import REPO, TEST_RECIPE, free_port

# the same generation set-up as vLLM's test: the target whose answers sometimes end, the prompt set (fixtures,
# used here under the same names) and the generate stage's records
from tests.system.test_vllm_generate import FUNCTIONS, ending_target, generated, stage_setup  # noqa: F401

NUM_LAYERS = TEST_RECIPE["num_layers"]
HIDDEN = TEST_RECIPE["hidden_size"]
AUX_LAYERS = default_aux_layer_ids(NUM_LAYERS)  # [1, 2, 3]: the capture contract's default for 7 layers
CAPTURE_TOPK = 6  # capture's top-K teacher
MAX_LENGTH = 512  # capture.max_length the servers are checked against
# Aux states: float32 outputs of layers whose matmuls and attention SGLang and transformers may sum in other
# orders (other kernels, other thread counts); a manual run saw at most 1.34e-5 and 1.91e-5.
AUX_ABS_TOL = 1e-4
# log-softmax of the same float32 logits: float32 rounding (a manual run saw under 1e-6)
LOGPROB_ABS_TOL = 1e-5
SITECUSTOMIZE_DIR = REPO / "harness" / "sglang_cpu"

# What changes in the production manifests' flags here, and why (none of it is about the CPU):
LAUNCH_CHANGES = {
    "--model-path": None,  # the tiny target, not Kimi-K2.5 (set per server)
    "--host": ["127.0.0.1"],  # servers a test starts listen on the loopback only (a pod: 0.0.0.0)
    "--port": None,  # a free port (set per server): pods have a network namespace each, tests share one
    "--tp": [],  # dropped: Kimi-K2.5 spans 8 GPUs; the tiny target runs in one process (SGLang's default)
    "--trust-remote-code": [],  # dropped: Kimi's remote code; the tiny Llama is transformers' own model
    # the manifest's 1 29 57 are ids for Kimi-K2.5's 61 layers: the tiny target's come from the same
    # project function the manifest's comment names (set on the capture server)
    "--return-aux-hidden-state-layer-ids": None,
}
# What a CPU needs on top (production: GPUs, where SGLang's defaults apply):
CPU_FLAGS = [
    # SGLang's default device is CUDA
    *("--device", "cpu"),
    # SGLang's GPU attention backends (flashinfer, fa3, triton) are CUDA kernels; torch_native runs torch's
    # SDPA, which works on a CPU (and it turns CUDA graphs off: nothing else here asks for them)
    *("--attention-backend", "torch_native"),
    # the KV pool: on a CPU, --mem-fraction-static is a fraction of the host's free memory
    # (sglang/srt/mem_cache/kv_cache_configurator.py:2990-3062), which the other tests share, and the
    # manifests' 0.85 and 0.80 would give the pool most of it; 4096 tokens (0.02 GB at float32) hold every
    # request here
    *("--max-total-tokens", "4096"),
    # the tiny target's own float32: SGLang's "auto" loads a float32 checkpoint as float16
    # (sglang/srt/configs/model_config.py:2304-2319), and the comparisons with transformers are in float32
    # (production's checkpoints are bf16, which "auto" keeps)
    *("--dtype", "float32"),
]


def production_args(manifest: str) -> dict[str, list[str]]:
    """The `sglang` container's flags in infra/k8s/<manifest>, each with its values, in order."""
    docs = [d for d in yaml.safe_load_all((REPO / "infra" / "k8s" / manifest).read_text()) if d]
    workload = next(d for d in docs if d["kind"] == "StatefulSet")
    container = next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "sglang")
    assert container["command"] == ["python", "-m", "sglang.launch_server"], container["command"]
    flags: dict[str, list[str]] = {}
    for token in container["args"]:
        if token.startswith("--"):
            flags[token] = []
        else:  # a value of the last flag ("-1" included)
            flags[next(reversed(flags))].append(str(token))
    return flags


def launch_args(manifest: str, **values: list[str]) -> list[str]:
    """The manifest's flags with LAUNCH_CHANGES applied (`values` for the flags set per server; keyword
    model_path for --model-path), then CPU_FLAGS."""
    flags = production_args(manifest)
    for flag, change in LAUNCH_CHANGES.items():
        if flag not in flags:  # the generation servers capture nothing; any other flag gone: a stale change
            assert flag == "--return-aux-hidden-state-layer-ids", f"{manifest} has no {flag}"
            continue
        change = values.pop(flag[2:].replace("-", "_"), change)
        assert change is not None, f"no value given for {flag}"
        if change == []:
            del flags[flag]
        else:
            flags[flag] = change
    assert not values, f"flags not in {manifest}: {values}"
    assert not set(flags) & set(CPU_FLAGS), "a CPU flag overrides a production one: list it in LAUNCH_CHANGES"
    return [part for flag, vals in flags.items() for part in (flag, *vals)] + CPU_FLAGS


def group_gone(pgid: int, within_s: float) -> bool:
    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False

    return poll_until(gone, within_s, 0.5)


def stop_group(server: subprocess.Popen) -> None:
    """SIGTERM SGLang's process group (launcher, scheduler, detokenizer), SIGKILL what is left after 30 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            continue
        if group_gone(server.pid, within_s=30):
            break
    server.wait()


def sglang_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(SITECUSTOMIZE_DIR)}  # the rope flag (harness/sglang_cpu)
    env.pop("VIRTUAL_ENV", None)
    return env


@contextmanager
def sglang_server(python: Path, args: list[str], port: int) -> Iterator[str]:
    """`python -m sglang.launch_server ARGS` until the block ends; yields its URL once /health answers."""
    # cwd: a temp dir, so that `-m` does not put this checkout's packages on the server's sys.path
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            [str(python), "-m", "sglang.launch_server", *args],
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=sglang_env(),
            start_new_session=True,
        )

        def gone() -> None:
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"SGLang exited {server.returncode}:\n{log.read().decode()[-6000:]}")

        try:
            url = f"http://127.0.0.1:{port}"
            # SGLang answers /health only after a generation through its scheduler (about 30 s here)
            assert await_health(url, timeout_s=300, gone=gone), "SGLang did not answer /health in 300 s"
            yield url
        finally:
            stop_group(server)
            assert group_gone(server.pid, within_s=5), "SGLang's processes outlived the server"


def client_settings(url: str) -> dict:
    return {"urls": [url], "concurrency": 2, "timeout_s": 120, "retries": 1}


def test_the_virtualenv_has_sglang_on_the_cpu_torch_and_the_rope_flag(sglang_python, tmp_path):
    """What the servers below run on: SGLang 0.5.23, torch's CPU build, and the sitecustomize's flag (set on
    SGLang's module, while SGLang's own check still says this is no CPU engine)."""
    probe = (
        "import json, torch, torchvision, sglang\n"
        "import sglang.srt.layers.rotary_embedding.base as rope\n"
        "from sglang.srt.utils import is_cpu\n"
        "print(json.dumps({'sglang': sglang.__version__, 'torch': torch.__version__, "
        "'cuda': torch.version.cuda, 'flag': rope._is_cpu, 'cpu_engine': is_cpu()}))\n"
    )
    out = subprocess.run(
        [str(sglang_python), "-c", probe],
        cwd=tmp_path,
        env=sglang_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    facts = json.loads(out.strip().splitlines()[-1])
    expected = {"sglang": "0.5.23", "torch": "2.13.0+cpu", "cuda": None, "flag": True, "cpu_engine": False}
    assert facts == expected


# -- generation ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generation_server(sglang_python, ending_target) -> Iterator[str]:  # noqa: F811 (the imported fixture)
    port = free_port()
    args = launch_args("sglang-generate.yaml", model_path=[str(ending_target)], port=[str(port)])
    with sglang_server(sglang_python, args, port) as url:
        yield url


def test_the_generate_stage_through_sglang_generates_what_hf_generates(
    stage_setup,  # noqa: F811 (the imported fixture)
    generation_server,
):
    hf = generated(stage_setup, "hf", {"engine": "hf"})
    ours = generated(
        stage_setup, "sglang", {"engine": "sglang", "sglang": client_settings(generation_server)}
    )
    assert {r["generation"]["engine"] for r in ours.values()} == {"sglang"}
    reasons = {reason for r in hf.values() for reason in r["generation"]["finish_reasons"]}
    assert reasons == {"stop", "length"}  # answers ending on the end token (kept in the ids) and cut off
    assert any(len(r["generation"]["finish_reasons"]) > 1 for r in hf.values())  # multi-turn covered
    assert ours.keys() == hf.keys()
    for sample_id, record in ours.items():
        mine, theirs = record["generation"], hf[sample_id]["generation"]
        assert record["messages"] == hf[sample_id]["messages"], sample_id  # every turn, decoded
        assert mine["last_output_ids"] == theirs["last_output_ids"], sample_id
        assert mine["finish_reasons"] == theirs["finish_reasons"], sample_id
        steps = list(zip(mine["last_top_logprobs"], theirs["last_top_logprobs"], strict=True))
        for step, (sglang_top, hf_top) in enumerate(steps):
            assert [int(i) for i, _ in sglang_top] == [int(i) for i, _ in hf_top], (sample_id, step)
            close = pytest.approx([v for _, v in hf_top], abs=LOGPROB_ABS_TOL)
            assert [v for _, v in sglang_top] == close, (sample_id, step)


# -- capture ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def capture_server(sglang_python, tiny_target_dir) -> Iterator[str]:
    from pipeline.engines.sglang import capture_server_flag

    port = free_port()
    flag, *ids = capture_server_flag(AUX_LAYERS, "llama", NUM_LAYERS).split()
    assert flag == "--return-aux-hidden-state-layer-ids", flag
    args = launch_args(
        "sglang-capture.yaml",
        model_path=[str(tiny_target_dir)],
        port=[str(port)],
        return_aux_hidden_state_layer_ids=ids,
    )
    with sglang_server(sglang_python, args, port) as url:
        yield url


@pytest.fixture(scope="module")
def capture_engine(capture_server):
    from pipeline.engine_settings import SGLangClientConfig
    from pipeline.engines.sglang import SGLangEngine

    engine = SGLangEngine(SGLangClientConfig(**client_settings(capture_server)), hidden_size=HIDDEN)
    yield engine
    engine.close()


TEACHER = TeacherRequest(kinds=("topk",), topk=CAPTURE_TOPK)


def test_the_capture_contract_check_accepts_the_real_capture_server(capture_engine, capture_server):
    assert capture_engine.version == "sglang-0.5.23"
    capture_engine.verify_capture_servers(AUX_LAYERS, NUM_LAYERS, MAX_LENGTH, TEACHER, family="llama")
    # the same server, checked against another contract: its real /server_info says what it captures
    with pytest.raises(EngineError, match=r"captures aux layers \[1, 2, 3\]") as refused:
        capture_engine.verify_capture_servers([1, 3, 5], NUM_LAYERS, MAX_LENGTH, TEACHER, family="llama")
    assert capture_server in str(refused.value)


def test_sglang_captures_what_hf_captures(capture_engine, tiny_target_dir):
    import torch

    from pipeline.data.conversations import prompt_ids
    from pipeline.engines import SamplingParams
    from pipeline.engines.hf import HFEngine

    hf = HFEngine(tiny_target_dir)
    prompts = [
        prompt_ids(hf.tokenizer, [{"role": "user", "content": f"def {name}(path, *args):"}])
        for name in FUNCTIONS[:3]
    ]
    # prompt and answer, as the capture stage gets them; of different lengths (HF pads the batch)
    answers = hf.generate(prompts, SamplingParams(16))
    sequences = [p + a.output_ids[: 8 + 4 * i] for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]
    assert len({len(s) for s in sequences}) == len(sequences)

    reference = hf.capture(sequences, AUX_LAYERS, TEACHER)
    captured = [c.materialized() for c in capture_engine.capture(sequences, AUX_LAYERS, TEACHER)]
    for sequence, ours, theirs in zip(sequences, captured, reference, strict=True):
        assert isinstance(ours.aux, torch.Tensor) and isinstance(theirs.aux, torch.Tensor)
        assert ours.aux.shape == theirs.aux.shape == (len(sequence), 3 * HIDDEN)
        blocks = theirs.aux.split(HIDDEN, dim=-1)  # three different layers' outputs, none of them zero
        assert all(b.abs().max() > 0.1 for b in blocks) and not torch.equal(blocks[0], blocks[1])
        assert (ours.aux - theirs.aux).abs().max().item() <= AUX_ABS_TOL
        assert ours.topk_ids is not None and theirs.topk_ids is not None
        assert torch.equal(ours.topk_ids, theirs.topk_ids)
        assert ours.topk_logprobs is not None and theirs.topk_logprobs is not None
        assert (ours.topk_logprobs - theirs.topk_logprobs).abs().max().item() <= LOGPROB_ABS_TOL
        assert ours.last_hidden is None  # no last_hidden teacher asked for
    assert capture_engine.received_bytes > 0  # through the capture workers, their spill files read


# -- in-process capture -------------------------------------------------------------------------------------

# SGLang's ServerArgs for this CPU: CPU_FLAGS, as the in-process runner's platform_args (production: none)
CPU_SERVER_ARGS = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "max_total_tokens": 4096,
    "dtype": "float32",
}
assert CPU_FLAGS == [
    part for key, value in CPU_SERVER_ARGS.items() for part in (f"--{key.replace('_', '-')}", str(value))
]


def test_the_in_process_runner_captures_what_hf_and_the_capture_server_capture(
    sglang_python, tiny_target_dir, capture_engine, tmp_path
):
    """pipeline/engines/sglang_runner.py on SGLang's own ModelRunner, in SGLang's virtualenv, against
    transformers and the real capture server over HTTP, token by token: aux states and the last hidden
    state within AUX_ABS_TOL, the same top-K ids, log-probs within LOGPROB_ABS_TOL. A prefill budget of
    20 tokens splits the batch, so the pools are freed and taken again between forwards."""
    import torch
    from safetensors import safe_open

    from pipeline.engines.hf import HFEngine
    from pipeline.engines.inprocess import sglang_layer_ids

    sequences = [list(range(5, 17)), list(range(40, 47)), [3, 9, 27, 81, 243, 100, 7, 7, 7]]
    teacher = TeacherRequest(kinds=("topk", "last_hidden"), topk=CAPTURE_TOPK)
    spec = {
        "target": str(tiny_target_dir),
        "sglang_layer_ids": sglang_layer_ids(AUX_LAYERS, "llama", NUM_LAYERS),
        "platform_args": CPU_SERVER_ARGS,
        "max_prefill_tokens": 20,
        "sequences": sequences,
        "teacher": list(teacher.kinds),
        "topk": teacher.topk,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "captures.safetensors"
    env = {
        **sglang_env(),
        "PYTHONPATH": f"{SITECUSTOMIZE_DIR}:{REPO}",
    }  # the rope flag; the checkout's pipeline
    script = REPO / "tests" / "system" / "sglang_prefill_runner.py"
    subprocess.run(
        [str(sglang_python), str(script), str(tmp_path / "spec.json"), str(out)],
        cwd=tmp_path,
        env=env,
        timeout=600,
        check=True,
    )
    with safe_open(str(out), "pt") as captured:
        assert captured.metadata()["version"] == "sglang-0.5.23-model-runner"
        ours = [
            {
                key.split(".", 1)[1]: captured.get_tensor(key)
                for key in captured.keys()
                if key.startswith(f"{i}.")
            }
            for i in range(len(sequences))
        ]
    reference = HFEngine(tiny_target_dir).capture(sequences, AUX_LAYERS, teacher)
    # over HTTP the last hidden state comes from other servers (capture.sglang.last_hidden_urls): top-K only
    served = [c.materialized() for c in capture_engine.capture(sequences, AUX_LAYERS, TEACHER)]
    for sequence, mine, hf, http in zip(sequences, ours, reference, served, strict=True):
        assert mine["aux"].shape == (len(sequence), 3 * HIDDEN)
        assert hf.last_hidden is not None
        assert (mine["last_hidden"].float() - hf.last_hidden.float()).abs().max().item() <= AUX_ABS_TOL
        for other in (hf, http):
            assert (mine["aux"].float() - other.aux.float()).abs().max().item() <= AUX_ABS_TOL
            assert torch.equal(mine["topk_ids"], other.topk_ids)
            difference = (mine["topk_logprobs"].float() - other.topk_logprobs.float()).abs().max().item()
            assert difference <= LOGPROB_ABS_TOL
