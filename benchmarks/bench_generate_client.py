"""The SGLang generate client against the local stand-in server (which batches concurrent requests the
way a real server does): requests per second at client concurrency 1 and 16, same prompts, one run.

    python benchmarks/bench_generate_client.py [--requests 64] [--max-new-tokens 32] [--budget-s 90]
        [--rel-width 0.1]

The two concurrencies run interleaved, every request once each per round, until the 95% interval of
speedup_c16_over_c1 is narrower than --rel-width or --budget-s runs out.
Headline (last line): rps_c16.
"""

from __future__ import annotations

from support import report, report_measurement, report_ratio, scratch_config, spread_parser


def main() -> None:
    parser = spread_parser(budget_s=90.0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    config = scratch_config()
    from harness.sglang_standin import StandinBackend, serve
    from pipeline.data.conversations import prompt_ids
    from pipeline.engine_settings import SGLangClientConfig
    from pipeline.engines import SamplingParams
    from pipeline.engines.sglang import SGLangEngine
    from pipeline.engines.target import load_tokenizer, resolve_model_dir
    from pipeline.engines.tiny_target import demo_conversations
    from pipeline.spread import measure, timed

    model_dir = resolve_model_dir(config)
    tokenizer = load_tokenizer(model_dir, config.target.trust_remote_code)
    prompts = [
        prompt_ids(tokenizer, [{"role": "user", "content": c["conversations"][0]["value"]}])
        for c in demo_conversations()[: args.requests]
    ]
    server = serve(StandinBackend(model_dir, None, trust_remote_code=config.target.trust_remote_code))
    url = f"http://127.0.0.1:{server.server_port}"
    params = SamplingParams(args.max_new_tokens, 0.0)
    try:
        sides = {}
        for concurrency in (1, 16):
            engine = SGLangEngine(SGLangClientConfig(urls=[url], concurrency=concurrency, retries=0))
            sides[f"c{concurrency}"] = timed(lambda engine=engine: engine.generate(prompts, params))
        # a warm-up round (not counted), then rounds of both sides in alternating order
        measurement = measure(sides, [("c1", "c16")], budget_s=args.budget_s, rel_width=args.rel_width)
    finally:
        server.shutdown()
    report(
        requests=len(prompts),
        max_new_tokens=args.max_new_tokens,
        rps_c1=len(prompts) / measurement.geomean("c1"),
    )
    report_measurement(measurement)
    # same requests on both sides, so c16 requests/s over c1 requests/s = c1 seconds / c16 seconds
    report_ratio("speedup_c16_over_c1", measurement.ratio("c1", "c16"))
    report(rps_c16=len(prompts) / measurement.geomean("c16"))


if __name__ == "__main__":
    main()
