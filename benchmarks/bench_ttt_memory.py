"""Peak memory of one training-time-test forward + backward (7 steps) at L=512, 2048 and 16384, for our
chunked diagonal attention, and at L=512 and 2048 for a dense reference that materializes every step's
[L, L*(k+1)] scores. Each measurement runs in its own process; memory is peak RSS above the process's
RSS just before the step.

    python benchmarks/bench_ttt_memory.py [--steps 7] [--hidden 128]

Linear memory gives ratios of ~4 (2048/512) and ~8 (16384/2048); quadratic gives ~16 and ~64. The dense
reference is skipped at 16384: its scores alone would take steps x 4 heads x 16384 x 16384 x 4 bytes
(~34 GB at 7 steps), more than this machine has.
Headline lines: dense_mem_ratio= and mem_ratio= (ours, 2048/512), then mem_ratio_16k= (ours, 16384/2048,
the context the Kimi config trains at; goal <= 9) last.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from support import report

LONG = 16384  # the Kimi config's train.max_length
OURS_LENGTHS = (512, 2048, LONG)
DENSE_LENGTHS = (512, 2048)  # the dense reference only where its scores fit in memory


def child(length: int, steps: int, hidden: int, dense: bool) -> None:
    import torch

    import pipeline.drafter.model as drafter_model
    from pipeline.drafter.arch import DrafterArch
    from pipeline.drafter.model import Eagle3Drafter

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
    ours = {length: measure(length, args.steps, args.hidden, False) for length in OURS_LENGTHS}
    dense = {length: measure(length, args.steps, args.hidden, True) for length in DENSE_LENGTHS}
    print(f"dense_skipped_at={LONG}", flush=True)  # its [L, L*(k+1)] scores would not fit in memory
    # memory of one deterministic computation, not a timing: the ratios print without an interval
    report(
        ttt_steps=args.steps,
        hidden=args.hidden,
        **{f"ours_mb_{length}": ours[length] for length in OURS_LENGTHS},
        **{f"dense_mb_{length}": dense[length] for length in DENSE_LENGTHS},
        dense_mem_ratio=dense[2048] / dense[512],
        mem_ratio=ours[2048] / ours[512],
        mem_ratio_16k=ours[LONG] / ours[2048],
    )


if __name__ == "__main__":
    main()
