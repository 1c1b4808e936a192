"""What moving aux hidden states through SGLang's HTTP JSON costs per token, at a given width.

    python benchmarks/bench_capture_transport.py [--width 21504] [--tiny-target] [--tokens 512]
        [--repeats 7] [--json FILE]

The default width is Kimi-K2.5's aux capture: 3 layers x 7168. --tiny-target takes the width of
configs/local.yaml's tiny target instead (3 x its hidden size).

The server side is emulated step by step as SGLang 0.5.23 runs it for a /generate request with
`return_hidden_states` on a server started with --enable-return-aux-hidden-states (paths relative to the
sglang package):
1. scheduler process: the bf16 hidden states [T, width] become Python floats,
   `req.hidden_states.append(req_hidden_states.cpu().clone().tolist())`
   (srt/managers/scheduler_components/batch_result_processor.py:659; the concatenated aux layers replace
   the last layer's state, srt/layers/logits_processor.py:867-871), and the BatchTokenIDOutput carrying
   them is pickled onto ZMQ (srt/managers/io_struct.py:2731-2736; SGLANG_USE_PICKLE_IPC defaults to
   true, srt/environ.py:366). Every TP rank computes the list; one sends it
   (srt/managers/scheduler.py:816-820).
2. detokenizer process (one per server, whatever the TP size: srt/entrypoints/engine.py:1061-1069): it
   unpickles the batch and pickles it again as a BatchStrOutput (srt/managers/detokenizer_manager.py:187,
   467, 505, 191).
3. tokenizer manager, the HTTP server's process (one per server unless --tokenizer-worker-num > 1:
   srt/entrypoints/http_server.py:2870, 3062): it unpickles the batch (srt/managers/tokenizer_manager.py:
   2469), puts the list in meta_info["hidden_states"] (:2598-2601) and the response is written by
   orjson.dumps(..., OPT_NON_STR_KEYS | OPT_SERIALIZE_NUMPY) (srt/utils/json_response.py:12-31;
   http_server.py:928-987).
Each step runs in one process per server, the three in a pipeline, so a server moves at most as many
tokens per second as its slowest step: capture_tok_s_ceiling_per_server. Nothing else of the server (the
GPU forward, other requests) is included, so the ceiling is an upper bound.

The client side is the project's own parser (pipeline.sglang_transport.split_hidden_states and
prompt_states) on the JSON bytes step 3 wrote, in one process: client_tok_s_per_core.

After either path, every token is encoded into a capture shard (fp8, as configs/kimi-k2.5.yaml stores it):
shard_encode_tok_s_per_core, the CPU work the in-process capture engine still pays.

Each step is timed --repeats times on the same request (after one warm-up); every figure prints as its
median with the fastest and slowest beside it (_min=, _max=). Headline (last line):
capture_tok_s_ceiling_per_server=.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from support import report

KIMI_AUX_WIDTH = 3 * 7168


def tiny_target_width() -> int:
    """3 x the hidden size of configs/local.yaml's tiny target (built on first use)."""
    from support import scratch_config

    from pipeline.engines.target import describe_target

    return 3 * describe_target(scratch_config()).hidden_size


def timed(action: Callable[[], object], repeats: int) -> list[float]:
    action()  # warm-up
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - started)
    return seconds


def report_rate(name: str, tokens: int, seconds: list[float]) -> float:
    """tokens/s at the median time, with the fastest and slowest repeat beside it."""
    rate = tokens / statistics.median(seconds)
    report(**{f"{name}_min": tokens / max(seconds), f"{name}_max": tokens / min(seconds), name: rate})
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=KIMI_AUX_WIDTH, help="floats per token (3 x hidden)")
    parser.add_argument("--tiny-target", action="store_true", help="the tiny target's width instead")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens of the captured request")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--json", type=Path, help="also write the figures here, for `drafter plan --transport FILE`"
    )
    args = parser.parse_args()
    import orjson
    import torch

    from pipeline.engines.sglang import prompt_states
    from pipeline.sglang_transport import split_hidden_states

    width = tiny_target_width() if args.tiny_target else args.width
    tokens = args.tokens
    states = torch.randn(tokens, width).to(torch.bfloat16)  # the aux states on the scheduler's side

    def scheduler_step() -> bytes:
        hidden_states = [states.cpu().clone().tolist()]  # req.hidden_states after prefill
        batch = {"rids": ["r"], "output_ids": [[1]], "output_hidden_states": [hidden_states]}
        return pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)

    to_detokenizer = scheduler_step()

    def detokenizer_step() -> bytes:
        return pickle.dumps(pickle.loads(to_detokenizer), protocol=pickle.HIGHEST_PROTOCOL)

    to_tokenizer = detokenizer_step()

    def tokenizer_step() -> bytes:
        batch = pickle.loads(to_tokenizer)
        meta_info = {"id": "r", "prompt_tokens": tokens, "completion_tokens": 1}
        meta_info["hidden_states"] = batch["output_hidden_states"][0]
        response = {"text": "", "output_ids": [1], "meta_info": meta_info}
        return orjson.dumps(response, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)

    body = tokenizer_step()

    def client_parse() -> torch.Tensor:
        _, values = split_hidden_states(body)
        return prompt_states(values, tokens, width)

    parsed = client_parse()
    if not torch.equal(parsed, states.float()):
        raise SystemExit("the client's parse differs from the states the server sent")
    report(width=width, tokens=tokens, repeats=args.repeats)
    rates = {
        step: report_rate(f"server_{step}_tok_s", tokens, timed(action, args.repeats))
        for step, action in (
            ("scheduler", scheduler_step),
            ("detokenizer", detokenizer_step),
            ("tokenizer", tokenizer_step),
        )
    }
    slowest = min(rates, key=lambda step: rates[step])
    report(
        pickle_bytes_per_token=len(to_detokenizer) / tokens,
        slowest_server_step=slowest,
        server_tok_s_per_process=rates[slowest],
    )
    client = report_rate("client_tok_s_per_core", tokens, timed(client_parse, args.repeats))
    torch.set_num_threads(1)  # per core, as the client's parse is
    encode = report_rate(
        "shard_encode_tok_s_per_core", tokens, timed(lambda: encode_shard(parsed), args.repeats)
    )
    figures = {
        "width": width,
        "server_tok_s_per_process": rates[slowest],
        "slowest_server_step": slowest,
        "client_tok_s_per_core": client,
        "shard_encode_tok_s_per_core": encode,
        "json_bytes_per_token": len(body) / tokens,
        "capture_tok_s_ceiling_per_server": rates[slowest],
    }
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "bench_capture_transport.py", **figures}, indent=2))
    report(
        json_bytes_per_token=figures["json_bytes_per_token"], capture_tok_s_ceiling_per_server=rates[slowest]
    )


def encode_shard(aux) -> None:
    """What every captured token costs after it arrives, on either capture path: ShardWriter's checks-free
    fp8 encoding (with the bf16 fall-back spool and error sums of configs/kimi-k2.5.yaml's bound) of the
    aux rows and a top-16 teacher, written to a local shard."""
    import tempfile

    import torch

    from pipeline.data.shard_writer import PendingSample, ShardWriter

    tokens = aux.shape[0]
    teacher = torch.log_softmax(torch.randn(tokens, 64), -1).topk(16, -1)
    with tempfile.TemporaryDirectory() as tmp, ShardWriter("fp8", 128, 0.05, spool_dir=Path(tmp)) as writer:
        ids = torch.arange(tokens)
        writer.add(PendingSample("s", ids, torch.ones(tokens), aux, None, teacher.indices, teacher.values))
        writer.finish(Path(tmp) / "s.safetensors")


if __name__ == "__main__":
    main()
