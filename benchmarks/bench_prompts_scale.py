"""The prompts stage on a large synthetic corpus: wall time and peak memory, at n and at n/4 so one can
see memory does not grow with the input (conversations stream through; only 8-byte ids and a fixed
Bloom filter are kept).

    python benchmarks/bench_prompts_scale.py [--n 200000]

The corpus mixes ShareGPT and OpenAI records with 2% exact duplicates, 2% near duplicates and 1% bad
records. Each size runs in its own process so peak RSS is that run's alone.
Headline (last lines): seconds= and peak_rss_mb= for n.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support import REPO, published, report, scratch_config


def synthetic_corpus(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = [f"w{rng.randrange(10**6)}" for _ in range(20000)]
    written = []
    with open(path, "w") as out:
        for index in range(n):
            roll = rng.random()
            if written and roll < 0.02:
                record = rng.choice(written)
            elif written and roll < 0.04:
                record = json.loads(json.dumps(rng.choice(written)))
                turns = record.get("messages") or record["conversations"]
                key = "content" if "messages" in record else "value"
                turns[0][key] += " please"
            elif roll < 0.05:
                record = (
                    {"messages": [{"role": "user", "content": ""}]}
                    if index % 2
                    else {"conversations": [{"value": "x"}]}
                )
            else:
                text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
                record = (
                    {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}
                    if index % 2
                    else {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}
                )
                if len(written) < 5000:
                    written.append(record)
            out.write(json.dumps(record) + "\n")


def child(source: str, n: int) -> None:
    config = scratch_config(
        [
            f"prompts.sources=[{{kind: jsonl, path: {source}}}]",
            f"prompts.num_samples={n}",
            "prompts.shard_size=2000",
            "prompts.max_prompt_tokens=1024",
            "prompts.eval_fraction=0.01",
        ]
    )
    from pipeline.engines.target import resolve_model_dir
    from pipeline.stages import run_stage
    from pipeline.storage import open_store

    resolve_model_dir(config)  # the tokenizer's target, built outside the timed part if missing
    started = time.perf_counter()
    store = open_store(config.storage)
    manifest = published(store, run_stage("prompts", config, "scale", store))
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_rss_mb": peak_mb, "counts": manifest["counts"]}))


def measure(source: Path, n: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(source), "--n", str(n)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.n)
        return
    with tempfile.TemporaryDirectory(prefix="prompts-scale-") as tmp:
        quarter_source, full_source = Path(tmp) / "quarter.jsonl", Path(tmp) / "full.jsonl"
        synthetic_corpus(quarter_source, args.n // 4)
        synthetic_corpus(full_source, args.n)
        quarter = measure(quarter_source, args.n // 4)
        full = measure(full_source, args.n)
    counts = full["counts"]
    rejected = {k.split(".", 1)[1]: v for k, v in counts.items() if k.startswith("rejected.")}
    report(
        n=args.n,
        kept=counts["kept"],
        rejected=json.dumps(rejected, sort_keys=True).replace(" ", ""),
        conversations_per_s=args.n / full["seconds"],
        seconds_quarter=quarter["seconds"],
        peak_rss_mb_quarter=quarter["peak_rss_mb"],
        seconds=full["seconds"],
        peak_rss_mb=full["peak_rss_mb"],
    )


if __name__ == "__main__":
    main()
