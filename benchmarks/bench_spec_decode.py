"""Baseline greedy decoding, n-gram speculation and the EAGLE-3 drafter on the tiny target's held-out
prompts, in one run of the local reference decoder (the pipeline's benchmark stage).

    python benchmarks/bench_spec_decode.py [--prompts 24] [--max-new-tokens 96]

It builds what it needs on a scratch store with configs/local.yaml: prompts, the target's own answers,
captures, a drafter trained as `make demo` trains it, and its held-out evaluation. The draft setting
(steps, topk, draft tokens) is the one the speedup model predicts fastest from that evaluation and
the step costs measured here.
Headline lines: tau_simulated=, tau_measured= (goal: within 10%), speedup_vs_ngram=, and last
speedup_vs_baseline= (goal >= 1.5).
"""

from __future__ import annotations

import argparse
import json

from support import report, scratch_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    config = scratch_config(
        [
            f"benchmark.num_prompts={args.prompts}",
            f"benchmark.max_new_tokens={args.max_new_tokens}",
            "capture.parity.samples=0",
        ]
    )
    from pipeline.stages import benchmark, capture, evaluate, generate, prompts, train
    from pipeline.storage import open_store

    store = open_store(config.storage)
    prompt_set = prompts.run(config, "bench", store)
    responses = generate.run(config, prompt_set.uri, "bench", store)
    dataset = capture.publish_dataset(
        config, [capture.run(config, responses.uri, "bench", store).uri], "bench", store
    )
    trained = train.run(config, dataset.uri, "bench", store)
    evaluation = evaluate.run(config, trained.uri, dataset.uri, "bench", store)
    bench = benchmark.run(config, trained.uri, evaluation.uri, prompt_set.uri, "bench", store)
    record = json.loads(store.get_bytes(f"{store.key_for(bench.uri)}/bench.json"))
    methods = record["methods"]
    tau_sim, tau_meas = record["tau_simulated"], record["tau_measured"]
    report(
        prompts=record["prompts"],
        max_new_tokens=record["max_new_tokens"],
        draft_steps=record["draft_steps"],
        topk=record["topk"],
        draft_tokens=record["draft_tokens"],
        baseline_tok_s=methods["baseline"]["tok_s"],
        ngram_tok_s=methods["ngram"]["tok_s"],
        ngram_tau=methods["ngram"]["tau_measured"],
        drafter_tok_s=methods["candidate"]["tok_s"],
        accepted_histogram=json.dumps(methods["candidate"]["accepted_histogram"]).replace(" ", ""),
        predicted_speedup=record["speed_model"]["chosen"]["speedup"],
        tau_gap=abs(tau_meas - tau_sim) / tau_sim,
        tau_simulated=tau_sim,
        tau_measured=tau_meas,
        speedup_vs_ngram=record["speedup_vs_ngram"],
        speedup_vs_baseline=record["speedup_vs_baseline"],
    )


if __name__ == "__main__":
    main()
