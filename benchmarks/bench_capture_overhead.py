"""What the capture stage (tokenizing, validation, fp8 encoding, shard writing, sha256, upload,
markers and manifests, the parity check) costs on top of the bare engine forward, on the same
inputs, measured side by side in one run.

    python benchmarks/bench_capture_overhead.py [--samples 300] [--budget-s 90] [--rel-width 0.1]

The two sides run interleaved (stage, bare, bare, stage, ...), one full pass over the samples each per
round, until the ratio's 95% interval is narrower than --rel-width or --budget-s runs out.
Headline (last line): capture_overhead_ratio = stage seconds / bare engine seconds, after its
capture_overhead_ratio_ci_low= and capture_overhead_ratio_ci_high= lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from support import (
    published,
    regenerated,
    report,
    report_measurement,
    report_ratio,
    spread_parser,
    stage,
)


def bare_capture(config, responses_uri, store) -> Callable[[], float]:
    """A side: seconds for the engine alone over every sample, batched as the stage batches them.

    The sequences are tokenized once, outside the timed part; each call loads the engine and runs it."""
    from pipeline.config import default_aux_layer_ids
    from pipeline.data.conversations import capture_sequence
    from pipeline.data.jsonl import decode_jsonl
    from pipeline.engines.hf import HFEngine
    from pipeline.engines.target import describe_target, load_tokenizer
    from pipeline.manifest import read_listed, read_manifest
    from pipeline.stages.capture import teacher_request

    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir, config.target.trust_remote_code)
    prefix = store.key_for(responses_uri)
    manifest = read_manifest(store, prefix, kind="responses")
    shards = []
    for shard in manifest["shards"]:
        records = decode_jsonl(read_listed(store, prefix, manifest, shard["name"]))
        sequences = [
            capture_sequence(
                tokenizer, r["messages"], r["generation"]["last_output_ids"], config.capture.max_length
            )[0]
            for r in records
        ]
        shards.append(sorted(sequences, key=len))
    layers = config.capture.aux_layer_ids or default_aux_layer_ids(target.num_layers)
    teacher = teacher_request(config)
    size = config.capture.batch_size

    def side() -> float:
        started = time.perf_counter()
        engine = HFEngine(target.model_dir, trust_remote_code=config.target.trust_remote_code)
        for sequences in shards:
            for start in range(0, len(sequences), size):
                engine.capture(sequences[start : start + size], layers, teacher)
        return time.perf_counter() - started

    return side


def main() -> None:
    parser = spread_parser(budget_s=90.0)
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    config, store, responses = regenerated(args.samples)
    from pipeline.spread import measure

    manifests: list[dict] = []

    def capture_stage() -> float:
        # a fresh snapshot each call: the stage would reuse an already published capture
        started = time.perf_counter()
        captured = stage("capture", config, store, f"bench-{len(manifests)}", responses_uri=responses.uri)
        manifests.append(published(store, captured))
        return time.perf_counter() - started

    measurement = measure(
        {"stage": capture_stage, "bare": bare_capture(config, responses.uri, store)},
        [("stage", "bare")],
        budget_s=args.budget_s,
        rel_width=args.rel_width,
    )
    manifest = manifests[-1]
    report(
        samples=manifest["totals"]["samples"],
        tokens=manifest["totals"]["tokens"],
        encoding=config.capture.encoding,
        bare_engine_seconds=measurement.geomean("bare"),
        capture_stage_seconds=measurement.geomean("stage"),
    )
    report_measurement(measurement)
    report_ratio("capture_overhead_ratio", measurement.ratio("stage", "bare"), headline=True)


if __name__ == "__main__":
    main()
