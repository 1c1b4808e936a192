"""Peak memory of capturing one long sample at Kimi-K2.5's width through SGLang's HTTP API (the stand-in).

    python benchmarks/bench_capture_memory.py [--tokens 32768] [--hidden-size 7168]
        [--max-client-mib 1536] [--max-worker-mib 384] [--model-dir DIR]

Starts the SGLang stand-in (harness.sglang_standin --synthetic-hidden-size H, on 127.0.0.1; stopped
by PID) over the tiny target's tokenizer: it answers a capture request with a response of the size a real
server sends, 3 x H floats per token as JSON, streamed. Then, in this process, the capture client's whole
path for one --tokens-token sample:
1. SGLangEngine.capture: a worker process posts the request and streams the response's hidden states to a
   spill file (pipeline.sglang_transport);
2. the capture stage's sample checks (pipeline.stages.capture.sample_problem), a chunk of rows at a time;
3. ShardWriter to an fp8 shard with top-K teacher, as configs/kimi-k2.5.yaml stores it.
Every float is checked to have arrived exactly (against the synthetic weights) and the shard to read
back within fp8's error.

Prints json_bytes, seconds and tokens/s of the capture, naive_client_mib (what holding the JSON body and
the float32 rows at once would take), peak_rss_worker_mib (the largest worker process),
peak_rss_client_mib (this process from its start to the shard written: Python, torch and the rest
included; taken before the checks, which are this harness's and not the client's) and last the headline
naive_to_peak_client_ratio (how many times the peak fits in what holding the sample whole would take).
Exits 1 when either peak exceeds its bound (`inf` sets none) or a value is wrong. The memory bound lives
here, not in a test: the 32K figures in docs/BENCHMARKS.md come from the default, and
tests/integration/test_capture_memory.py runs this script on a 2K-token sample for its values alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from support import REPO, report, scratch_config

TEACHER_TOPK = 16


def start_standin(model_dir: Path, hidden_size: int):
    """The stand-in with synthetic states of hidden_size, healthy; (process, url)."""
    import requests

    from harness.json_http import free_port
    from pipeline.processes import start_process_group

    port = free_port()
    command = [sys.executable, "-m", "harness.sglang_standin", "--model-path", str(model_dir)]
    command += ["--port", str(port), "--aux-layer-ids", "1", "2", "3"]
    command += ["--synthetic-hidden-size", str(hidden_size)]
    process = start_process_group(command, {"PYTHONPATH": str(REPO), **_environment()})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the stand-in exited: {process.stdout.read() if process.stdout else ''}")
        try:
            if requests.get(url + "/health", timeout=30).status_code == 200:
                return process, url
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise SystemExit("the stand-in did not become healthy within 120 s")


def _environment() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def capture_one(url: str, ids: list[int], hidden_size: int, spill_dir: Path):
    """SGLangEngine.capture of one sequence through one worker process; (capture, response bytes, worker
    peak RSS MiB)."""
    from pipeline.engine_settings import SGLangClientConfig
    from pipeline.engines import TeacherRequest
    from pipeline.engines.sglang import SGLangEngine

    engine = SGLangEngine(
        SGLangClientConfig(urls=[url], concurrency=1, timeout_s=1800, retries=0),
        hidden_size=hidden_size,
        spill_dir=spill_dir,
    )
    try:
        [capture] = engine.capture([ids], [1, 2, 3], TeacherRequest(("topk",), TEACHER_TOPK))
    finally:
        engine.close()
    return capture, engine.received_bytes, engine.worker_peak_rss_mib


def arrived_exactly(capture, expected_rows) -> bool:
    """Every spilled row equals the synthetic weights' row, bit for bit."""
    import numpy as np

    from pipeline.data.spilled_rows import row_chunks

    start = 0
    for chunk in row_chunks(capture.aux):
        stop = start + chunk.shape[0]
        if not np.array_equal(chunk.numpy(), expected_rows(start, stop)):
            return False
        start = stop
    return start == capture.aux.shape[0]


def stored_within_fp8_error(path: Path, expected_rows, length: int) -> bool:
    """The shard's first and last rows read back within fp8's per-block error (7% of a block's amax)."""
    import torch

    from pipeline.data.capture_shards import ShardReader

    reader = ShardReader.from_file(path)
    try:
        for start, stop in ((0, 64), (length - 64, length)):
            want = torch.from_numpy(expected_rows(start, stop))
            error = (reader.decoded_rows("aux", 3, start, stop) - want).abs().amax() / want.abs().amax()
            if float(error) > 0.07:
                return False
    finally:
        reader.close()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768, help="the sample's length in tokens")
    parser.add_argument("--hidden-size", type=int, default=7168, help="the target's width (Kimi-K2.5's)")
    parser.add_argument("--max-client-mib", type=float, default=1536, help="bound on this process's peak")
    parser.add_argument("--max-worker-mib", type=float, default=384, help="bound on a worker's peak")
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="the stand-in's model (its tokenizer and vocabulary); default: configs/local.yaml's tiny target",
    )
    args = parser.parse_args()

    import torch

    from harness.synthetic_states import SyntheticStates
    from pipeline.data.shard_writer import PendingSample, ShardWriter
    from pipeline.engines import TeacherRequest
    from pipeline.engines.target import describe_target, text_config
    from pipeline.sglang_transport import peak_rss_mib
    from pipeline.stages.capture import sample_problem

    if args.model_dir is not None:
        model_dir = args.model_dir.resolve()
        vocab_size = int(text_config(model_dir)["vocab_size"])
    else:
        target = describe_target(scratch_config())
        model_dir, vocab_size = target.model_dir, target.vocab_size
    states = SyntheticStates(vocab_size, args.hidden_size)
    ids = [(7919 * i + 3) % vocab_size for i in range(args.tokens)]

    def expected_rows(start: int, stop: int):
        return states.rows(ids[start:stop])

    process, url = start_standin(model_dir, args.hidden_size)
    try:
        with tempfile.TemporaryDirectory(prefix="capture-memory-") as tmp:
            started = time.monotonic()
            capture, capture_bytes, worker_mib = capture_one(url, ids, args.hidden_size, Path(tmp))
            problem = sample_problem(
                capture, len(ids), args.hidden_size, TeacherRequest(("topk",), TEACHER_TOPK)
            )
            with ShardWriter("fp8", 128, 0.05, spool_dir=Path(tmp)) as writer:
                writer.add(
                    PendingSample(
                        "long",
                        torch.tensor(ids),
                        torch.ones(len(ids), dtype=torch.uint8),
                        capture.aux,
                        None,
                        capture.topk_ids,
                        capture.topk_logprobs,
                    )
                )
                stats, _ = writer.finish(Path(tmp) / "long.safetensors")
            seconds = time.monotonic() - started
            # the capture path's peak: the checks below are this harness's, not the capture client's
            client_mib = peak_rss_mib()
            exact = arrived_exactly(capture, expected_rows)
            capture.discard()
            stored = stored_within_fp8_error(Path(tmp) / "long.safetensors", expected_rows, len(ids))
            shard_bytes = (Path(tmp) / "long.safetensors").stat().st_size
    finally:
        from pipeline.processes import stop_process_group

        stop_process_group(process, grace_s=10)
    json_bytes = capture_bytes
    naive_mib = (json_bytes + args.tokens * 3 * args.hidden_size * 4) / (1 << 20)
    report(
        tokens=args.tokens,
        width=3 * args.hidden_size,
        json_bytes=json_bytes,
        shard_bytes=shard_bytes,
        stored_encoding=stats["encoding"],
        values_exact=exact,
        sample_problem=problem,
        shard_reads_back=stored,
        capture_s=seconds,
        capture_tok_s=args.tokens / seconds,
        naive_client_mib=naive_mib,
        max_worker_mib=args.max_worker_mib,
        max_client_mib=args.max_client_mib,
        peak_rss_worker_mib=worker_mib,
        peak_rss_client_mib=client_mib,
        naive_to_peak_client_ratio=naive_mib / client_mib,
    )
    within = client_mib <= args.max_client_mib and worker_mib <= args.max_worker_mib
    if not (exact and stored and problem is None and within):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
