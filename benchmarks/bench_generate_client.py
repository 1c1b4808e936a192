"""The SGLang generate client against the local stand-in server (which batches concurrent requests the
way a real server does): requests per second at client concurrency 1 and 16, same prompts, one run.

    python benchmarks/bench_generate_client.py [--requests 64] [--max-new-tokens 32]

Headline (last line): rps_c16.
"""

from __future__ import annotations

import argparse
import time

from support import report, scratch_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    config = scratch_config()
    from pipeline.config import SGLangClientConfig
    from pipeline.data.conversations import prompt_ids
    from pipeline.dev.sglang_standin import StandinBackend, serve
    from pipeline.engines import SamplingParams
    from pipeline.engines.sglang import SGLangEngine
    from pipeline.engines.target import load_tokenizer, resolve_model_dir
    from pipeline.engines.tiny_target import demo_conversations

    model_dir = resolve_model_dir(config)
    tokenizer = load_tokenizer(model_dir, config.target.trust_remote_code)
    prompts = [
        prompt_ids(tokenizer, [{"role": "user", "content": c["conversations"][0]["value"]}])
        for c in demo_conversations()[: args.requests]
    ]
    server = serve(StandinBackend(model_dir, None, trust_remote_code=config.target.trust_remote_code))
    url = f"http://127.0.0.1:{server.server_port}"
    params = SamplingParams(args.max_new_tokens, 0.0)
    results = {}
    try:
        for concurrency in (1, 16, 1, 16):  # interleaved, each measured twice; the better run counts
            engine = SGLangEngine(SGLangClientConfig(urls=[url], concurrency=concurrency, retries=0))
            engine.generate(prompts[:2], params)  # warm-up
            started = time.perf_counter()
            outputs = engine.generate(prompts, params)
            rps = len(outputs) / (time.perf_counter() - started)
            results[concurrency] = max(results.get(concurrency, 0.0), rps)
    finally:
        server.shutdown()
    report(
        requests=len(prompts),
        max_new_tokens=args.max_new_tokens,
        rps_c1=results[1],
        speedup_c16_over_c1=results[16] / results[1],
        rps_c16=results[16],
    )


if __name__ == "__main__":
    main()
