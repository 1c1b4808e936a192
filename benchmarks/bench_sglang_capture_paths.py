"""Capture transport on real SGLang 0.5.23 on this CPU (`make sglang-venv`; issue 56): the aux states and
top-16 teacher of the same sequences through the capture server over HTTP (SGLangEngine.capture: SGLang's
JSON and the client's parse, the capture manifest's flags plus the CPU's) and through the in-process runner
(pipeline/engines/sglang_runner.py on SGLang's ModelRunner, tensors in the capturing process;
benchmarks/sglang_prefill_worker.py), in interleaved rounds (pipeline.spread.measure). Prints each path's
tokens per second per capture process and the ratio with its 95% interval.

    python benchmarks/bench_sglang_capture_paths.py [--sequences 8] [--tokens 256] [--budget-s 180]

On the embedded default's tiny target (8 layers, hidden 128: 384 floats per token). Kimi-K2.5's width
(21,504 floats per token) is not measured: a target that wide does not run on this CPU, and SGLang's CPU
path does not load the MLA architecture. One round runs one path at a time on this machine's two cores.
Last line: inprocess_speedup_vs_http.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from support import REPO, report, report_measurement, report_ratio, scratch_config, spread_parser

SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
SITECUSTOMIZE = REPO / "harness" / "sglang_cpu"
TOPK = 16  # configs/kimi-k2.5.yaml's capture.teacher_topk
# SGLang's ServerArgs for this CPU (tests/system/test_sglang_real.py's CPU_FLAGS)
CPU_SERVER_ARGS = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "max_total_tokens": 4096,
    "dtype": "float32",
}


def sglang_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PYTHONPATH": f"{SITECUSTOMIZE}:{REPO}"}  # the rope flag; the checkout's pipeline


def capture_server(model_dir: Path, sglang_ids: list[int], port: int, log) -> subprocess.Popen:
    """infra/k8s/sglang-capture.yaml's flags (less --tp 8 and --trust-remote-code, Kimi's), then the CPU's."""
    cpu = [
        part for key, value in CPU_SERVER_ARGS.items() for part in (f"--{key.replace('_', '-')}", str(value))
    ]
    command = [str(SGLANG_PYTHON), "-m", "sglang.launch_server", "--model-path", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--mem-fraction-static", "0.80"]
    command += ["--enable-return-hidden-states", "--enable-return-aux-hidden-states"]
    command += [
        "--speculative-algorithm",
        "EAGLE3",
        "--return-aux-hidden-state-layer-ids",
        *map(str, sglang_ids),
    ]
    command += ["--disable-radix-cache", "--chunked-prefill-size", "-1", *cpu]
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=sglang_environment(), start_new_session=True
    )


def stop(process: subprocess.Popen) -> None:
    from pipeline.processes import stop_process_group

    stop_process_group(process, grace_s=30)


def main() -> None:
    parser = spread_parser(budget_s=180.0)
    parser.add_argument("--sequences", type=int, default=8, help="sequences per round")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    args = parser.parse_args()
    if not SGLANG_PYTHON.is_file():
        raise SystemExit(f"{SGLANG_PYTHON} is missing: run `make sglang-venv`")

    from harness.json_http import free_port
    from pipeline.config import default_aux_layer_ids
    from pipeline.engine_settings import SGLangClientConfig
    from pipeline.engines import TeacherRequest
    from pipeline.engines.inprocess import sglang_layer_ids
    from pipeline.engines.layer_ids import model_family_of
    from pipeline.engines.sglang import SGLangEngine
    from pipeline.engines.target import describe_target, text_config
    from pipeline.retrying import await_health
    from pipeline.spread import measure, timed

    target = describe_target(scratch_config())
    config = text_config(target.model_dir)
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    family = model_family_of(target.model_dir)
    aux = default_aux_layer_ids(layers)
    ids = sglang_layer_ids(aux, family, layers)
    rng = random.Random(0)
    rounds = [
        [[rng.randrange(3, target.vocab_size) for _ in range(args.tokens)] for _ in range(args.sequences)]
        for _ in range(1000)
    ]
    tokens = args.sequences * args.tokens
    teacher = TeacherRequest(kinds=("topk",), topk=TOPK)

    with (
        tempfile.TemporaryDirectory(prefix="sglang-paths-") as tmp,
        open(Path(tmp) / "server.log", "wb") as log,
    ):
        spec = Path(tmp) / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "target": str(target.model_dir),
                    "sglang_layer_ids": ids,
                    "platform_args": CPU_SERVER_ARGS,
                    "max_prefill_tokens": tokens,
                    "topk": TOPK,
                }
            )
        )
        port = free_port()
        server = capture_server(target.model_dir, ids, port, log)
        worker = subprocess.Popen(
            [str(SGLANG_PYTHON), str(REPO / "benchmarks" / "sglang_prefill_worker.py"), str(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=tmp,
            env=sglang_environment(),
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"

            def server_gone() -> None:
                if server.poll() is not None:
                    raise SystemExit(f"the capture server exited {server.returncode} (its log: {log.name})")

            if not await_health(url, timeout_s=300, gone=server_gone):
                raise SystemExit("the capture server did not answer /health in 300 s")
            ready = json.loads(worker.stdout.readline() or "{}")  # type: ignore[union-attr]
            if "ready" not in ready:
                raise SystemExit(f"the in-process worker did not start (exit {worker.poll()})")
            engine = SGLangEngine(
                SGLangClientConfig(urls=[url], concurrency=4, timeout_s=600, retries=0), hidden_size=hidden
            )
            engine.verify_capture_servers(aux, layers, args.tokens, teacher, family=family)
            next_round: dict[str, int] = {}

            def sequences_for(side: str) -> list[list[int]]:  # both sides get the same batch in a round
                index = next_round.get(side, 0)
                next_round[side] = index + 1
                return rounds[index % len(rounds)]

            def http() -> None:
                captured = [c.materialized() for c in engine.capture(sequences_for("http"), aux, teacher)]
                assert sum(c.aux.shape[0] for c in captured) == tokens

            def in_process() -> None:
                worker.stdin.write(json.dumps({"sequences": sequences_for("inprocess")}) + "\n")  # type: ignore[union-attr]
                worker.stdin.flush()  # type: ignore[union-attr]
                answer = json.loads(worker.stdout.readline() or "{}")  # type: ignore[union-attr]
                assert answer.get("tokens") == tokens, answer

            started = time.monotonic()
            measured = measure(
                {"http": timed(http), "inprocess": timed(in_process)},
                [("http", "inprocess")],
                rel_width=args.rel_width,
                budget_s=args.budget_s,
            )
            engine.close()
        finally:
            worker.kill()
            stop(server)
    from pipeline.spread import ratio_from_samples

    seconds = measured.samples
    report(
        width_floats_per_token=3 * hidden,
        tokens_per_round=tokens,
        wall_s=time.monotonic() - started,
        http_tok_s=tokens / measured.geomean("http"),
        inprocess_tok_s=tokens / measured.geomean("inprocess"),
    )
    report_measurement(measured)
    report_ratio(
        "inprocess_speedup_vs_http", ratio_from_samples(seconds["http"], seconds["inprocess"]), headline=True
    )


if __name__ == "__main__":
    main()
