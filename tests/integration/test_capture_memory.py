"""A long sample at Kimi-K2.5's width (3 x 7168 floats a token) captured through SGLang's HTTP API,
against the stand-in with synthetic weights of that width: every float arrives exactly, the shard
reads back, and the worker process that receives the response streams it to a spill file instead of
holding it (its peak stays far under the size of the body it parsed).

The memory bound itself is a benchmark, not a test: `benchmarks/bench_capture_memory.py --tokens 32768`
measures the client's and the worker's peaks against holding the sample whole and prints their ratio
(docs/BENCHMARKS.md); this test runs the same script on a short sample.
"""

import subprocess
import sys

from tests.conftest import REPO

TOKENS = 2048
MIB = 1 << 20


def test_a_long_capture_at_kimi_width_arrives_exactly_and_streams_through_the_worker(tiny_target_dir):
    command = [sys.executable, "benchmarks/bench_capture_memory.py", "--tokens", str(TOKENS)]
    command += ["--model-dir", str(tiny_target_dir)]  # the suite's tiny target, built once
    # the script's bounds are for its 32K-token run; here only what this size can show is asserted
    command += ["--max-client-mib", "inf", "--max-worker-mib", "inf"]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    figures = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert figures["tokens"] == str(TOKENS) and figures["width"] == str(3 * 7168)
    assert figures["values_exact"] == "True" and figures["shard_reads_back"] == "True"
    assert figures["sample_problem"] == "None" and figures["stored_encoding"] == "fp8"
    json_mib = int(figures["json_bytes"]) / MIB
    assert json_mib > 300  # the real size of such a response: about 9 bytes of JSON a float
    # the worker parsed all of it and never held more than a part: the body went to its spill file
    assert float(figures["peak_rss_worker_mib"]) < 0.5 * json_mib
    # the headline figures the benchmark prints for its bound
    assert float(figures["naive_client_mib"]) > json_mib
    assert float(figures["naive_to_peak_client_ratio"]) > 0
