"""The in-process side of bench_sglang_capture_paths.py, run by .venv-sglang's Python: one
SGLangPrefillRunner (pipeline/engines/sglang_runner.py) on real SGLang, kept loaded, answering one JSON line
per request on stdin ({"sequences": [[ids...], ...]}) with one line on stdout ({"tokens": N, "aux_sum": S}),
after the capture's tensors are on the host, as the capture stage gets them.

    python benchmarks/sglang_prefill_worker.py SPEC.json   (SPEC: target, sglang_layer_ids, platform_args,
                                                            max_prefill_tokens, topk)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.config import InProcessCaptureConfig
from pipeline.engines import TeacherRequest
from pipeline.engines.sglang_runner import SGLangPrefillRunner


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    settings = InProcessCaptureConfig(runner="sglang", max_prefill_tokens=spec["max_prefill_tokens"])
    runner = SGLangPrefillRunner(
        Path(spec["target"]), spec["sglang_layer_ids"], settings, 0, 1, False, spec["platform_args"]
    )
    teacher = TeacherRequest(kinds=("topk",), topk=spec["topk"])
    print(json.dumps({"ready": runner.version}), flush=True)
    try:
        for line in sys.stdin:
            sequences = json.loads(line)["sequences"]
            captures = runner.prefill(sequences, teacher)
            tokens = sum(c.aux.shape[0] for c in captures)
            print(
                json.dumps({"tokens": tokens, "aux_sum": float(sum(c.aux.float().sum() for c in captures))}),
                flush=True,
            )
    finally:
        runner.close()


if __name__ == "__main__":
    main()
