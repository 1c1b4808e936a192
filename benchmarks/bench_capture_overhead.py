"""What the capture stage (tokenizing, validation, fp8 encoding, shard writing, sha256, upload,
markers and manifests, the parity check) costs on top of the bare engine forward, on the same
inputs, measured side by side in one run.

    python benchmarks/bench_capture_overhead.py [--samples 300] [--rounds 2]

Headline (last line): capture_overhead_ratio = stage seconds / bare engine seconds.
"""

from __future__ import annotations

import argparse
import time

from support import report, scratch_config


def bare_capture(config, responses_uri, store) -> float:
    """Seconds for the engine alone over every sample, batched as the stage batches them."""
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
    started = time.perf_counter()
    engine = HFEngine(target.model_dir, trust_remote_code=config.target.trust_remote_code)
    size = config.capture.batch_size
    for sequences in shards:
        for start in range(0, len(sequences), size):
            engine.capture(sequences[start : start + size], layers, teacher)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = scratch_config([f"prompts.num_samples={args.samples}", "prompts.eval_fraction=0"])
    from pipeline.stages import capture, generate, prompts
    from pipeline.storage import open_store

    store = open_store(config.storage)
    responses = generate.run(config, prompts.run(config, "bench", store).uri, "bench", store)
    bare, staged, manifest = [], [], None
    for round_ in range(args.rounds):
        bare.append(bare_capture(config, responses.uri, store))
        started = time.perf_counter()
        manifest = capture.run(config, responses.uri, f"bench-{round_}", store).manifest
        staged.append(time.perf_counter() - started)
    bare_s, stage_s = sum(bare) / len(bare), sum(staged) / len(staged)
    report(
        samples=manifest["totals"]["samples"],
        tokens=manifest["totals"]["tokens"],
        encoding=config.capture.encoding,
        bare_engine_seconds=bare_s,
        capture_stage_seconds=stage_s,
        capture_overhead_ratio=stage_s / bare_s,
    )


if __name__ == "__main__":
    main()
