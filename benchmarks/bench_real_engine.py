"""A real serving engine in the loop: vLLM (its CPU build, `make vllm-venv`) serves the target with the
promoted drafter, beside the project's reference decoder, on the held-out prompts of the run that promoted it.

    python benchmarks/bench_real_engine.py [--config configs/local.yaml] [--alias production] [--prompts 16]
        [--max-new-tokens 96] [--steps 4] [--budget-s 120] [--rel-width 0.1]

Defaults: what `make demo` produced (configs/local.yaml's store, the drafter behind `production`, the held-out
prompts of the run that promoted it), and the benchmark's draft chain (benchmark.draft_steps). The drafter is
pulled as vLLM would pull it; a version exported before drafters carried vLLM's aux layer ids gets them in a
local copy (pipeline.drafter.export.copy_with_layer_ids, the ids export now writes), said in
`drafter_vllm_ids=`.

Acceptance: vLLM's own speculative-decoding counters against the reference decoder's chain
(pipeline.benchmark.reference.chain_acceptance with whole_chain: the same drafts, counted the way vLLM
counts them), as the benchmark stage checks it with benchmark.reference_beside.
Speed: the candidate and vLLM's plain greedy decoding, both engines alive at once, interleaved pass by pass
(pipeline.spread.measure) until the 95% interval is --rel-width narrow or --budget-s runs out; prompts one at
a time (batch size 1). Every output must equal the reference decoder's (its speculative decoding equals
its greedy decoding: tests/integration/test_spec_decode.py).
Lines: vllm_tau=, reference_tau=, tau_rel_diff= (|vllm - reference| / reference), per-position acceptances,
and last vllm_speedup= (candidate over vLLM baseline tokens/s), after its _ci_low= and _ci_high= lines.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from support import REPO, report, report_measurement, report_ratio, spread_parser


def parse_args():
    parser = spread_parser(budget_s=120.0)
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--alias", default="production", help="registry alias or version of the drafter")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=None, help="draft chain (default benchmark.draft_steps)")
    return parser.parse_args()


def vllm_drafter(store, config, alias: str, dest: Path, target_dir: Path) -> tuple[Path, str, str]:
    """The drafter behind `alias`, pulled and checked: (the directory vLLM loads, the version, where its vLLM
    ids came from)."""
    import json

    from pipeline.drafter.export import (
        CONFIG_NAME,
        copy_with_layer_ids,
        engine_layer_ids,
        read_drafter_dir,
        written_layer_ids,
    )
    from pipeline.ops import registry

    version = registry.resolve(store, config.target.name, alias)
    pulled = registry.pull(store, config.target.name, version, dest / "pulled", target_dir, engine="sglang")
    if written_layer_ids(json.loads((pulled / CONFIG_NAME).read_text()), "vllm") is not None:
        return pulled, version, "exported"
    ids = engine_layer_ids(read_drafter_dir(pulled)[2], "vllm")
    corrected = copy_with_layer_ids(pulled, dest / "with-vllm-ids", "vllm", ids)
    read_drafter_dir(corrected)  # the corrected copy must feed vLLM the trained layers
    return corrected, version, f"added-locally:{ids}"


def positions(acceptance: list[float]) -> str:
    return ",".join(f"{p:.3f}" for p in acceptance)


def promoting_run(store, config, version: str) -> str:
    from pipeline import layout
    from pipeline.manifest import read_manifest

    manifest = read_manifest(
        store, layout.drafter_version_prefix(config.target.name, version), kind="drafter"
    )
    return manifest["lineage"]["run_id"]


def main() -> None:
    args = parse_args()
    import logging

    from pipeline.benchmark.figures import histogram_acceptance
    from pipeline.benchmark.reference import chain_acceptance
    from pipeline.benchmark.vllm import EngineSpec, measure_engines, running_engines, summed_counters
    from pipeline.benchmark_settings import BenchmarkConfig, VllmBenchConfig
    from pipeline.cli import quiet_libraries
    from pipeline.config import load_config
    from pipeline.drafter.export import load_drafter, read_drafter_dir
    from pipeline.engines.target import describe_target, load_frozen_tensors, load_model, load_tokenizer
    from pipeline.engines.vllm import eagle3_speculation
    from pipeline.stages.benchmark import heldout_prompts
    from pipeline.storage import open_store

    quiet_libraries()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = load_config(REPO / args.config)
    store = open_store(config.storage)
    target = describe_target(config)
    target_dir = Path(target.model_dir)
    tokenizer = load_tokenizer(target_dir, config.target.trust_remote_code)
    steps = args.steps or config.benchmark.draft_steps
    with tempfile.TemporaryDirectory(prefix="bench-real-engine-") as scratch:
        drafter_dir, version, vllm_ids = vllm_drafter(store, config, args.alias, Path(scratch), target_dir)
        run_id = promoting_run(store, config, version)
        prompts = heldout_prompts(store, store.uri(f"prompts/{run_id}"), tokenizer, args.prompts)
        report(drafter=version, drafter_vllm_ids=vllm_ids, prompts_of_run=run_id, prompts=len(prompts))
        report(max_new_tokens=args.max_new_tokens, steps=steps)

        model = load_model(target_dir, trust_remote_code=config.target.trust_remote_code)
        drafter = load_drafter(drafter_dir, load_frozen_tensors(target_dir)["embed"].float())[0]
        aux_layer_ids = read_drafter_dir(drafter_dir)[2]["aux_layer_ids"]
        eos = tokenizer.eos_token_id
        reference_outputs, histogram = chain_acceptance(
            model, drafter, aux_layer_ids, prompts, args.max_new_tokens, eos, steps, whole_chain=True
        )

        settings = config.benchmark.vllm or VllmBenchConfig()
        if not Path(settings.python).is_absolute():
            settings = settings.model_copy(update={"python": str(REPO / settings.python)})
        bench = BenchmarkConfig(
            max_new_tokens=args.max_new_tokens, budget_s=args.budget_s, ci_rel_width=args.rel_width
        )
        specs = {
            "baseline": EngineSpec(target_dir),
            "candidate": EngineSpec(target_dir, eagle3_speculation(drafter_dir, steps)),
        }
        with running_engines(specs, settings, config.target.trust_remote_code) as engines:
            vllm_version = engines["baseline"].vllm_version
            passes, measured = measure_engines(engines, prompts, bench, [("candidate", "baseline")])

    mismatched = {
        name: sum(o != r for run in runs for o, r in zip(run.outputs, reference_outputs, strict=True))
        for name, runs in passes.items()
    }
    if any(mismatched.values()):
        raise SystemExit(f"vLLM's outputs differ from the reference decoder's greedy outputs: {mismatched}")
    served = summed_counters(passes["candidate"])
    vllm_tau = served.tau() if served is not None else None
    reference_tau, reference_positions = histogram_acceptance(histogram)
    if served is None or vllm_tau is None:
        raise SystemExit("no draft was verified: nothing to compare")
    report(vllm_version=vllm_version, outputs_equal_reference=True)
    report(
        vllm_acceptance_per_position=positions(served.per_position_acceptance()),
        reference_acceptance_per_position=positions(reference_positions),
    )
    report(
        vllm_tau=vllm_tau,
        reference_tau=reference_tau,
        tau_rel_diff=abs(vllm_tau - reference_tau) / reference_tau,
    )
    report_measurement(measured)
    report(
        vllm_baseline_tok_s=measured.geomean("baseline"),
        vllm_candidate_tok_s=measured.geomean("candidate"),
    )
    report_ratio("vllm_speedup", measured.ratio("candidate", "baseline"), headline=True)


if __name__ == "__main__":
    main()
