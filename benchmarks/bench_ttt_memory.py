"""Peak memory of one training-time-test forward + backward (7 steps) at L=2048 over L=512, for our
chunked diagonal attention and for a dense reference that materializes every step's [L, L*(k+1)]
scores. Each measurement runs in its own process; memory is peak RSS above the process's RSS just
before the step.

    python benchmarks/bench_ttt_memory.py [--steps 7] [--hidden 128]

Linear memory gives a ratio of ~4 (2048/512); quadratic gives ~16.
Headline lines: dense_mem_ratio= then mem_ratio= (ours) last.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from support import report


def child(length: int, steps: int, hidden: int, dense: bool) -> None:
    import torch

    import pipeline.drafter.model as drafter_model
    from pipeline.drafter.model import DrafterArch, Eagle3Drafter

    torch.manual_seed(0)
    torch.set_num_threads(2)
    if dense:  # swap in the reference, which keeps every step's dense score matrix for backward
        drafter_model.ttt_attention = lambda q, keys, values, chunk: drafter_model.dense_ttt_attention(
            q, keys, values
        )
    arch = DrafterArch.uniform(hidden, 4, 3, (2048, 1024), [1, 3, 4])
    model = Eagle3Drafter(arch, torch.randn(2048, hidden))
    aux = torch.randn(1, length, 3 * hidden)
    ids = torch.randint(0, 2048, (1, length))
    with torch.no_grad():  # touch the allocator once so the baseline includes warm buffers
        model.ttt_forward(aux[:, :64], ids[:, :64], 1, 256)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outputs = model.ttt_forward(aux, ids, steps, 256)
    sum(model.logits(h).float().logsumexp(-1).mean() for h in outputs).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mb": (peak - baseline) / 1024}))


def measure(length: int, steps: int, hidden: int, dense: bool) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(length), "--steps", str(steps), "--hidden", str(hidden)]
        + (["--dense"] if dense else []),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["mb"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--child", type=int)
    parser.add_argument("--dense", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.hidden, args.dense)
        return
    ours = {length: measure(length, args.steps, args.hidden, False) for length in (512, 2048)}
    dense = {length: measure(length, args.steps, args.hidden, True) for length in (512, 2048)}
    # memory of one deterministic computation, not a timing: the ratios print without an interval
    report(
        ttt_steps=args.steps,
        hidden=args.hidden,
        ours_mb_512=ours[512],
        ours_mb_2048=ours[2048],
        dense_mb_512=dense[512],
        dense_mb_2048=dense[2048],
        dense_mem_ratio=dense[2048] / dense[512],
        mem_ratio=ours[2048] / ours[512],
    )


if __name__ == "__main__":
    main()
