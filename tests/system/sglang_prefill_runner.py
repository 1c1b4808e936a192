"""Run by .venv-sglang's Python for tests/system/test_sglang_real.py: pipeline/engines/sglang_runner.py's
SGLangPrefillRunner on real SGLang, one rank, with the platform ServerArgs the spec gives (a CPU's here).

    python tests/system/sglang_prefill_runner.py SPEC.json OUT.safetensors

SPEC: target, sglang_layer_ids, platform_args, max_prefill_tokens, sequences, teacher (kinds), topk. OUT:
each sequence's capture as `<i>.aux`, `<i>.last_hidden`, `<i>.topk_ids`, `<i>.topk_logprobs`, the runner's
version in the metadata."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from pipeline.config import InProcessCaptureConfig
from pipeline.engines import TeacherRequest
from pipeline.engines.sglang_runner import SGLangPrefillRunner


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    settings = InProcessCaptureConfig(runner="sglang", max_prefill_tokens=spec["max_prefill_tokens"])
    runner = SGLangPrefillRunner(
        Path(spec["target"]), spec["sglang_layer_ids"], settings, 0, 1, False, spec["platform_args"]
    )
    try:
        captures = runner.prefill(
            spec["sequences"], TeacherRequest(kinds=tuple(spec["teacher"]), topk=spec["topk"])
        )
    finally:
        runner.close()
    tensors = {}
    for index, capture in enumerate(captures):
        parts = {
            "aux": capture.aux,
            "last_hidden": capture.last_hidden,
            "topk_ids": capture.topk_ids,
            "topk_logprobs": capture.topk_logprobs,
        }
        tensors |= {f"{index}.{name}": t.contiguous() for name, t in parts.items() if t is not None}
    save_file(tensors, sys.argv[2], metadata={"version": runner.version})


if __name__ == "__main__":
    main()
