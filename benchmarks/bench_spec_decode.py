"""Baseline greedy decoding, n-gram speculation and the EAGLE-3 drafter on the tiny target's held-out
prompts, in one run of the local reference decoder (the pipeline's benchmark stage).

    python benchmarks/bench_spec_decode.py [--prompts 24] [--max-new-tokens 96] [--budget-s 150]
        [--rel-width 0.1] [--batch-sizes 1,8]

It builds what it needs on a scratch store with configs/local.yaml: prompts, the target's own answers,
captures, a drafter trained as `make demo` trains it, and its held-out evaluation (with every draft shape's
acceptance simulated by the decoder's own tree code), then runs the benchmark stage. The draft setting
(steps, topk, draft tokens) is the stage's choice: the speed model ranks every setting, the best few and
the best of each tree width are timed beside plain decoding prompt by prompt, and the fastest measured
wins, or the simplest setting within its noise (pipeline.decoding.choice). Lines calibration_<setting>=
give each timed setting's measured speedup over plain decoding with its interval and the model's
prediction; chosen=, fastest= and chosen_within_noise= (1 when the chosen setting is the fastest or its
interval against the fastest holds 1). With that setting the three methods are then timed again,
interleaved: each decodes every prompt once per round, in alternating order, until the 95% intervals of
both speedups are narrower than --rel-width or --budget-s runs out; every output must equal greedy
decoding. Headline lines: tau_simulated=, tau_measured= (goal: within 10%), tau_measured_t0= and
tau_measured_sampled= (greedy, and at configs/local.yaml's serving temperature, with speedup_sampled=),
one tau_measured_<domain>= per held-out domain, speedup_bs<N>= per batch size (the stage's interleaved
measurement: batch 1 as in the stage's headline, the larger sizes with the reference decoder's batched
decoding, each with its interval and the speed model's predicted_speedup_bs<N>=), speedup_vs_ngram= (with
its interval), and last speedup_vs_baseline= (goal >= 1.5), after its _ci_low= and _ci_high= lines.
"""

from __future__ import annotations

import json

from support import report, report_measurement, report_ratio, scratch_config, spread_parser, stage


def method_sides(config, store, train_uri: str, prompts_uri: str, record: dict, outputs: dict) -> dict:
    """Sides baseline, ngram and candidate: seconds to decode every held-out prompt, as the stage does.

    Each call stores its outputs in `outputs[name]`, so they can be checked against greedy decoding."""
    import torch

    from pipeline.benchmark.decoded import eagle_method, ngram_method
    from pipeline.benchmark_settings import NgramLocalSetting
    from pipeline.decoding.reference_decoder import TargetRunner, greedy_decode
    from pipeline.drafter.export import load_drafter, read_drafter_dir
    from pipeline.engines.target import describe_target, load_frozen_tensors, load_model, load_tokenizer
    from pipeline.records import DraftSetting
    from pipeline.stages.benchmark import heldout_prompts
    from pipeline.stages.evaluate import local_drafter_dir

    settings = config.benchmark
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir, config.target.trust_remote_code)
    prompts = heldout_prompts(store, prompts_uri, tokenizer, settings.num_prompts)
    drafter_dir = local_drafter_dir(store, store.key_for(train_uri), config.storage.run_workdir("bench"))
    aux_layer_ids = read_drafter_dir(drafter_dir)[2]["aux_layer_ids"]
    drafter = load_drafter(drafter_dir, load_frozen_tensors(target.model_dir)["embed"].float())[0]
    model = load_model(target.model_dir, trust_remote_code=config.target.trust_remote_code)
    plain, with_aux = TargetRunner(model, None), TargetRunner(model, aux_layer_ids)
    eos, new_tokens = tokenizer.eos_token_id, settings.max_new_tokens
    setting = DraftSetting.model_validate(record["speed_model"]["chosen"])
    # n-gram at the setting the stage found fastest
    sweep = record["ngram_sweep"]
    best_ngram = NgramLocalSetting.model_validate(
        next(entry["knobs"] for entry in sweep["settings"] if entry["setting"] == sweep["best"])
    )
    methods = {
        "baseline": lambda p: greedy_decode(plain, p, new_tokens, eos),
        "ngram": ngram_method(plain, best_ngram, new_tokens, eos),
        "candidate": eagle_method(
            with_aux, drafter, (setting.steps, setting.topk, setting.draft_tokens), new_tokens, eos
        ),
    }

    def side(name: str):
        def decode_all() -> float:
            with torch.inference_mode():
                results = [methods[name](prompt) for prompt in prompts]
            outputs[name] = [r.tokens for r in results]
            return sum(r.seconds for r in results)

        return decode_all

    return {name: side(name) for name in methods}


def report_batches(record: dict) -> None:
    """speedup_bs<N>= per measured batch size, with its interval, and the speed model's prediction."""
    speedups = {record["batch_size"]: (record["speedups"]["baseline"], record["speed_model"]["chosen"])}
    for batch in record["batches"]:
        speedups[batch["batch_size"]] = (
            batch["speedups"]["baseline"],
            {"speedup": batch["predicted_speedup"], "steps": batch["draft_steps"]},
        )
    for size, (speedup, predicted) in sorted(speedups.items()):
        report(
            **{
                f"draft_steps_bs{size}": predicted["steps"],
                f"predicted_speedup_bs{size}": predicted["speedup"],
                f"speedup_bs{size}_ci_low": speedup["ci_low"],
                f"speedup_bs{size}_ci_high": speedup["ci_high"],
                f"speedup_bs{size}": speedup["ratio"],
            }
        )


def report_calibration(record: dict) -> None:
    """Every setting the stage timed: measured speedup over plain decoding (interval), predicted tau and
    speedup (forwards only, and with the fitted bookkeeping), measured tau; and how it chose."""
    model = record["speed_model"]
    choice = model["choice"]
    for timed in model["calibration"]:
        setting, speedup = timed["setting"], timed["speedup"]
        name = label(setting)
        report(
            **{
                f"calibration_{name}": (
                    f"{speedup['ratio']:.3f} [{speedup['ci_low']:.3f}, {speedup['ci_high']:.3f}] "
                    f"predicted {timed['predicted_speedup']:.3f} (forwards only {setting['speedup']:.3f}) "
                    f"tau {timed['tau_measured']:.3f} predicted {setting['tau']:.3f} phase {timed['phase']}"
                )
            }
        )
    chosen = next(t for t in model["calibration"] if label(t["setting"]) == choice["chosen"])
    within = chosen["vs_fastest"] is None or chosen["vs_fastest"]["ci_high"] >= 1.0
    report(
        calibration_rounds=choice["rounds"],
        calibration_stopped_by=choice["stopped_by"],
        fastest=choice["fastest"],
        chosen=choice["chosen"],
        chosen_within_noise=int(within),
    )


def label(setting: dict) -> str:
    from pipeline.decoding.choice import shape_label

    return shape_label((setting["steps"], setting["topk"], setting["draft_tokens"]))


def main() -> None:
    parser = spread_parser(budget_s=150.0)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--batch-sizes", default="1,8", help="comma-separated batch sizes the stage measures (1 always)"
    )
    args = parser.parse_args()
    batch_sizes = sorted({1, *(int(size) for size in args.batch_sizes.split(","))})
    config = scratch_config(
        [
            f"benchmark.num_prompts={args.prompts}",
            f"benchmark.max_new_tokens={args.max_new_tokens}",
            "capture.parity.samples=0",
            f"benchmark.batch_sizes={batch_sizes}",
        ]
    )
    from pipeline.spread import measure
    from pipeline.storage import open_store

    store = open_store(config.storage)
    outputs_of = {name: stage(name, config, store, "bench") for name in ("prompts", "generate", "capture")}
    for name in ("dataset", "train", "evaluate", "benchmark"):
        outputs_of[name] = stage(name, config, store, "bench")
    prompt_set, trained, bench = outputs_of["prompts"], outputs_of["train"], outputs_of["benchmark"]
    record = json.loads(store.get_bytes(f"{store.key_for(bench.uri)}/bench.json"))
    outputs: dict[str, list[list[int]]] = {}
    measurement = measure(
        method_sides(config, store, trained.uri, prompt_set.uri, record, outputs),
        [("baseline", "candidate"), ("ngram", "candidate")],
        budget_s=args.budget_s,
        rel_width=args.rel_width,
    )
    differ = [name for name, tokens in outputs.items() if tokens != outputs["baseline"]]
    if differ:
        raise SystemExit(f"speculative outputs differ from greedy decoding: {differ}")
    tokens = sum(len(t) for t in outputs["baseline"])
    tau_sim, tau_meas = record["tau_simulated"], record["tau_measured"]
    report(
        prompts=record["prompts"],
        max_new_tokens=record["max_new_tokens"],
        draft_steps=record["draft_steps"],
        topk=record["topk"],
        draft_tokens=record["draft_tokens"],
        baseline_tok_s=tokens / measurement.geomean("baseline"),
        ngram_tok_s=tokens / measurement.geomean("ngram"),
        ngram_setting=record["ngram_sweep"]["best"],
        ngram_tau=record["methods"]["ngram"]["tau_measured"],
        drafter_tok_s=tokens / measurement.geomean("candidate"),
        accepted_histogram=json.dumps(record["methods"]["candidate"]["accepted_histogram"]).replace(" ", ""),
        # the speedup model's prediction for the chosen setting, not a measurement (no interval)
        predicted_speedup=record["speed_model"]["chosen"]["speedup"],
        # acceptance is exact: greedy outputs and drafts are deterministic, so tau has no timing noise
        tau_gap=abs(tau_meas - tau_sim) / tau_sim,
        tau_simulated=tau_sim,
        tau_measured=tau_meas,
    )
    # acceptance greedy (temperature 0) and at the serving temperature (configs/local.yaml's
    # benchmark.serving_sampling, as Kimi-K2.5 serves: 1.0 / top_p 0.95), from the stage's record
    sampled = record.get("sampled")
    report(
        tau_measured_t0=tau_meas,
        tau_measured_sampled=sampled["methods"]["candidate"]["tau_measured"] if sampled else None,
        speedup_sampled=sampled["speedups"]["baseline"]["ratio"] if sampled else None,
    )
    report(
        **{
            f"tau_measured_{domain}": figures["candidate"]["tau_measured"]
            for domain, figures in sorted(record["domains"].items())
        }
    )
    report_batches(record)
    report_calibration(record)
    report_measurement(measurement)
    # the same tokens on every side, so a ratio of tok/s is the inverse ratio of seconds
    report_ratio("speedup_vs_ngram", measurement.ratio("ngram", "candidate"))
    report_ratio("speedup_vs_baseline", measurement.ratio("baseline", "candidate"), headline=True)


if __name__ == "__main__":
    main()
