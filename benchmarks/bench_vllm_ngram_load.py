"""vLLM's n-gram speculation on a machine other work keeps busy: numba's default thread pool against one
numba thread (what pipeline.engines.vllm gives every engine with benchmark.vllm.cpu_threads 1).

    python benchmarks/bench_vllm_ngram_load.py [--busy 2] [--prompts 8] [--budget-s 120]

Two vLLM engines of the tiny target with vLLM's n-gram (prompt lookup 1-4, 4 tokens), one with one numba
thread and one with numba's default pool (a thread per core), alive at once and decoding the same held-out
prompts in interleaved passes (pipeline.spread.measure), while `--busy` processes spin on the cores
(started and stopped here, by PID). Needs `make vllm-venv` and the tiny target (`make demo` builds it);
the prompts are held-out turns of the built-in corpus. Lines: each engine's tokens/s per round and as a
geometric mean, then one_numba_thread_speedup= (tok/s with one numba thread over tok/s with numba's default
pool), after its interval lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack

from support import report, report_measurement, report_ratio, spread_parser

BUSY_LOOP = "while True: pass"


def main() -> None:
    parser = spread_parser(budget_s=120.0)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside the engines")
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    from support import REPO

    from pipeline.benchmark_settings import VllmBenchConfig
    from pipeline.config import load_config
    from pipeline.data.conversations import prompt_ids
    from pipeline.engines.target import describe_target, load_tokenizer
    from pipeline.engines.tiny_target import corpus_turns
    from pipeline.engines.vllm import ngram_speculation, running_engine
    from pipeline.spread import measure

    config = load_config(REPO / "configs/local.yaml")
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir)
    turns = corpus_turns(heldout=True)[: args.prompts]
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": turn.prompt}]) for turn in turns]
    settings = (config.benchmark.vllm or VllmBenchConfig()).model_copy(
        update={"python": str(REPO / ".venv-vllm/bin/python")}
    )
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.busy)]
    try:
        with ExitStack() as stack:
            engines = {}
            # numba's default pool is one thread per core; without the variable the engine gets one thread
            for name, numba_threads in (("numba_default", str(os.cpu_count())), ("numba_one", None)):
                os.environ.pop("NUMBA_NUM_THREADS", None)
                if numba_threads is not None:
                    os.environ["NUMBA_NUM_THREADS"] = numba_threads
                speculation = ngram_speculation(1, 4, 4)
                engines[name] = stack.enter_context(
                    running_engine(name, settings, target.model_dir, speculation)
                )
            os.environ.pop("NUMBA_NUM_THREADS", None)

            def side(name: str):
                def decode() -> float:
                    generation = engines[name].generate(prompts, 96, batch_size=1)
                    return sum(map(len, generation.outputs)) / sum(generation.seconds)

                return decode

            measured = measure(
                {name: side(name) for name in engines},
                [("numba_one", "numba_default")],
                rel_width=args.rel_width,
                budget_s=args.budget_s,
                min_rounds=3,
            )
    finally:
        for process in busy:
            process.kill()
            process.wait()
    report(busy_processes=args.busy, prompts=len(prompts))
    report(
        numba_default_tok_s=measured.geomean("numba_default"), numba_one_tok_s=measured.geomean("numba_one")
    )
    report_measurement(measured)
    report_ratio("one_numba_thread_speedup", measured.ratio("numba_one", "numba_default"), headline=True)


if __name__ == "__main__":
    main()
