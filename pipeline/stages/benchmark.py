"""benchmark: tok/s and acceptance length of baseline, n-gram, incumbent and candidate in ONE run.

The local engine is the reference speculative decoder (pipeline.decoding.reference_decoder) over the target on
held-out prompts; methods run interleaved prompt by prompt so machine noise hits all of them alike.
Every speculative output must equal plain greedy decoding token for token, or the stage fails.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.data.conversations import prompt_ids
from pipeline.data.jsonl import decode_jsonl
from pipeline.decoding.reference_decoder import (
    DecodeResult,
    DraftTree,
    EagleProposer,
    NgramProposer,
    TargetRunner,
    greedy_decode,
    speculative_decode,
    tree_speculative_decode,
)
from pipeline.decoding.speedup import Setting, StepCosts, candidate_settings, predicted_tau, rank_settings
from pipeline.drafter.export import load_drafter, read_drafter_dir
from pipeline.drafter.model import Eagle3Drafter
from pipeline.engines.target import describe_target, load_frozen_tensors, load_model, load_tokenizer
from pipeline.manifest import publish, read_listed, read_manifest
from pipeline.progress import Progress
from pipeline.stages import StageResult
from pipeline.stages.evaluate import local_drafter_dir
from pipeline.storage import ObjectStore, open_store

log = logging.getLogger(__name__)


class BenchmarkFailed(RuntimeError):
    pass


def heldout_prompts(store: ObjectStore, prompts_uri: str, tokenizer, count: int) -> list[list[int]]:
    prefix = store.key_for(prompts_uri)
    manifest = read_manifest(store, prefix, kind="prompts")
    prompts = []
    for shard in manifest["shards"]:
        if shard["split"] != "eval":
            continue
        for record in decode_jsonl(read_listed(store, prefix, manifest, shard["name"])):
            first_user = next(i for i, m in enumerate(record["messages"]) if m["role"] == "user")
            prompts.append(prompt_ids(tokenizer, record["messages"][: first_user + 1]))
            if len(prompts) == count:
                return prompts
    if not prompts:
        raise BenchmarkFailed(f"prompts {prompts_uri} have no held-out (eval) conversations to benchmark on")
    return prompts


def _summary(results: list[DecodeResult]) -> dict[str, Any]:
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    summary: dict[str, Any] = {
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tok_s": round(tokens / seconds, 2),
    }
    forwards = sum(r.verify_forwards for r in results)
    if forwards:
        summary["tau_measured"] = round(sum(r.cycle_tokens for r in results) / forwards, 4)
        histogram = [sum(h) for h in zip(*(r.accepted_histogram for r in results), strict=True)]
        summary["accepted_histogram"] = histogram
    return summary


def _median_seconds(action, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_costs(
    model,
    drafter,
    prompt: list[int],
    aux_layer_ids: list[int],
    widths: list[int],
    chain_tokens: set[int],
    tree_tokens: set[int],
) -> StepCosts:
    """Seconds per target forward (1 token, n chained tokens, an n-token tree) and per drafter forward
    (frontier width w), on a cache already holding the prompt."""
    runner = TargetRunner(model, aux_layer_ids)
    runner.reset()
    _, aux = runner.forward(prompt)
    prefix = runner.length
    proposer = EagleProposer(drafter)
    proposer.start(list(prompt) + [prompt[-1]], aux)
    last_hidden = proposer.last_hidden
    if last_hidden is None:
        raise BenchmarkFailed("the drafter kept no hidden state after the prompt")

    def target(tokens: int):
        runner.forward(prompt[-tokens:] if tokens <= len(prompt) else [prompt[-1]] * tokens)
        runner.crop(prefix)

    def tree(tokens: int):
        nodes = DraftTree(
            tokens=[prompt[-1]] * (tokens - 1),
            parents=[-1] + list(range(tokens - 2)),
            depths=list(range(1, tokens)),
        )
        runner.forward_tree(nodes, prompt[-1])
        runner.crop(prefix)

    def draft(width: int):
        cache = proposer.cache.expanded(width)
        drafter.decode(
            last_hidden.expand(width, -1, -1),
            torch.full((width, 1), prompt[-1]),
            cache.length,
            cache,
        )

    with torch.inference_mode():
        return StepCosts(
            target_step=_median_seconds(lambda: target(1)),
            verify_chain={n: _median_seconds(lambda n=n: target(n)) for n in sorted(chain_tokens)},
            verify_tree={n: _median_seconds(lambda n=n: tree(n)) for n in sorted(tree_tokens)},
            draft={w: _median_seconds(lambda w=w: draft(w)) for w in sorted(set(widths) | {1})},
        )


def choose_setting(
    evaluation: dict[str, Any],
    model,
    tokenizer,
    drafter,
    prompts: list[list[int]],
    aux_layer_ids: list[int],
    settings,
) -> tuple[Setting, list[Setting], StepCosts, list[dict]]:
    """The draft setting to benchmark: the speedup model ranks every setting from the evaluation and
    measured step costs; the best few (and the best chain) are then timed on a few calibration prompts,
    and the fastest measured one wins. The model's misses are kept in the record."""
    max_steps = min(settings.max_draft_steps, len(evaluation["full_acc"]))
    widths = settings.tree_widths if settings.auto_select else [1]
    grid = (
        candidate_settings(max_steps, tuple(widths), settings.max_draft_tokens)
        if settings.auto_select
        else [(settings.draft_steps, 1, settings.draft_steps + 1)]
    )
    costs = measure_costs(
        model,
        drafter,
        prompts[0],
        aux_layer_ids,
        widths,
        {n for _, k, n in grid if k == 1},
        {n for _, k, n in grid if k > 1},
    )
    ranked = rank_settings(evaluation, costs, grid)
    if not ranked:
        raise BenchmarkFailed("no draft setting can be predicted from this evaluation")
    shortlist = ranked[: settings.calibration_candidates]
    shortlist += [s for s in ranked if s.topk == 1][:1] if not any(s.topk == 1 for s in shortlist) else []
    if len(shortlist) == 1:
        return shortlist[0], ranked, costs, []
    runner = TargetRunner(model, aux_layer_ids)
    calibration = []
    with torch.inference_mode():
        for setting in shortlist:
            method = eagle_method(runner, drafter, setting, settings.max_new_tokens, tokenizer.eos_token_id)
            method(prompts[0])  # warm-up
            results = [method(p) for p in prompts[: settings.calibration_prompts]]
            measured = _summary(results)
            calibration.append(
                {
                    "setting": setting.as_dict(),
                    "tok_s": measured["tok_s"],
                    "tau_measured": measured["tau_measured"],
                }
            )
    best = max(range(len(shortlist)), key=lambda i: calibration[i]["tok_s"])
    return shortlist[best], ranked, costs, calibration


def eagle_method(runner: TargetRunner, drafter, setting: Setting, max_new_tokens: int, eos: int | None):
    if setting.topk == 1:
        return lambda p: speculative_decode(
            runner, EagleProposer(drafter), p, max_new_tokens, eos, setting.steps
        )
    return lambda p: tree_speculative_decode(
        runner,
        EagleProposer(drafter),
        p,
        max_new_tokens,
        eos,
        setting.steps,
        setting.topk,
        setting.draft_tokens,
    )


def compare_methods(
    model,
    tokenizer,
    prompts: list[list[int]],
    drafters: dict[str, Eagle3Drafter],
    aux_layer_ids: list[int],
    settings,
    setting: Setting,
) -> dict[str, Any]:
    """Run every method on every prompt, interleaved, and check outputs against greedy."""
    plain = TargetRunner(model, None)
    with_aux = TargetRunner(model, aux_layer_ids)
    eos = tokenizer.eos_token_id
    methods = {
        "baseline": lambda p: greedy_decode(plain, p, settings.max_new_tokens, eos),
        "ngram": lambda p: speculative_decode(
            plain,
            NgramProposer(settings.ngram_max_match, settings.ngram_min_match),
            p,
            settings.max_new_tokens,
            eos,
            settings.draft_steps,
        ),
    }
    for name, drafter in drafters.items():
        methods[name] = eagle_method(with_aux, drafter, setting, settings.max_new_tokens, eos)
    results: dict[str, list[DecodeResult]] = {name: [] for name in methods}
    mismatches = {name: 0 for name in methods}
    with torch.inference_mode():
        for method in methods.values():  # warm-up, not measured
            method(prompts[0])
        for _ in range(settings.repeats):
            for prompt in Progress(prompts, desc="benchmark", unit="prompt"):
                reference = None
                for name, method in methods.items():
                    result = method(prompt)
                    results[name].append(result)
                    reference = reference if reference is not None else result.tokens
                    mismatches[name] += int(result.tokens != reference)
    bad = {name: n for name, n in mismatches.items() if n}
    if bad:
        raise BenchmarkFailed(f"speculative outputs differ from greedy decoding on some prompts: {bad}")
    return {name: _summary(r) for name, r in results.items()}


def promotion_decision(methods: dict[str, Any], settings) -> dict[str, Any]:
    candidate = methods["candidate"]["tok_s"]
    checks = [("baseline", settings.min_speedup_vs_baseline), ("ngram", settings.min_speedup_vs_ngram)]
    if "incumbent" in methods:
        checks.append(("incumbent", settings.min_speedup_vs_incumbent))
    reasons, passed = [], True
    for other, margin in checks:
        ratio = candidate / methods[other]["tok_s"]
        ok = ratio >= margin
        passed &= ok
        reasons.append(f"candidate/{other} speed {ratio:.3f} {'>=' if ok else '<'} required {margin}")
    return {"promotable": passed, "reasons": reasons}


def local_record(
    config: RunConfig,
    target,
    tokenizer,
    drafter_dirs: dict[str, Path],
    prompts: list[list[int]],
    evaluation: dict[str, Any],
    aux_layer_ids: list[int],
) -> dict[str, Any]:
    """The reference decoder on this machine: costs measured, best setting chosen, every method run."""
    settings = config.benchmark
    frozen = load_frozen_tensors(target.model_dir)
    drafters = {name: load_drafter(path, frozen["embed"].float())[0] for name, path in drafter_dirs.items()}
    model = load_model(target.model_dir, trust_remote_code=config.target.trust_remote_code)
    chosen, ranked, costs, calibration = choose_setting(
        evaluation, model, tokenizer, drafters["candidate"], prompts, aux_layer_ids, settings
    )
    methods = compare_methods(model, tokenizer, prompts, drafters, aux_layer_ids, settings, chosen)
    speedup = round(methods["candidate"]["tok_s"] / methods["baseline"]["tok_s"], 4)
    return {
        "engine": "local",
        "draft_steps": chosen.steps,
        "topk": chosen.topk,
        "draft_tokens": chosen.draft_tokens,
        "methods": methods,
        "tau_simulated": chosen.tau,
        "speed_model": {
            "costs": costs.as_dict(),
            "chosen": chosen.as_dict(),
            "calibration": calibration,
            "predicted_vs_measured": {
                "tau": [chosen.tau, methods["candidate"]["tau_measured"]],
                "speedup": [chosen.speedup, speedup],
            },
            "ranked": [s.as_dict() for s in ranked[:10]],
        },
    }


def sglang_record(
    config: RunConfig, drafter_dirs: dict[str, Path], prompts: list[list[int]], evaluation: dict[str, Any]
) -> dict[str, Any]:
    """SGLang servers started one method at a time (production); the setting comes from the config."""
    from pipeline.engines.sglang_bench import run_methods

    settings = config.benchmark.sglang
    if settings is None:
        raise BenchmarkFailed("benchmark.engine 'sglang' needs benchmark.sglang")
    methods = run_methods(settings, prompts, config.benchmark.max_new_tokens, drafter_dirs)
    return {
        "engine": "sglang",
        "draft_steps": settings.steps,
        "topk": settings.topk,
        "draft_tokens": settings.draft_tokens,
        "methods": methods,
        "tau_simulated": round(predicted_tau(evaluation, settings.steps, settings.topk), 4),
    }


def run(
    config: RunConfig,
    train_uri: str,
    eval_uri: str,
    prompts_uri: str,
    run_id: str,
    store: ObjectStore | None = None,
    incumbent_dir: Path | None = None,
) -> StageResult:
    store = store or open_store(config.storage)
    settings = config.benchmark
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir, config.target.trust_remote_code)
    drafter_dirs = {
        "candidate": local_drafter_dir(store, store.key_for(train_uri), config.storage.run_workdir(run_id))
    }
    if incumbent_dir is not None:
        drafter_dirs["incumbent"] = incumbent_dir
    contracts = {name: read_drafter_dir(path)[2] for name, path in drafter_dirs.items()}
    aux_layer_ids = contracts["candidate"]["aux_layer_ids"]
    for name, contract in contracts.items():
        if contract["aux_layer_ids"] != aux_layer_ids:
            raise BenchmarkFailed(
                f"{name} drafter reads aux layers {contract['aux_layer_ids']}, the candidate {aux_layer_ids}"
            )
    prompts = heldout_prompts(store, prompts_uri, tokenizer, settings.num_prompts)
    eval_prefix = store.key_for(eval_uri)
    evaluation = json.loads(read_listed(store, eval_prefix, read_manifest(store, eval_prefix), "eval.json"))
    if settings.engine == "sglang":
        record = sglang_record(config, drafter_dirs, prompts, evaluation)
    else:
        record = local_record(config, target, tokenizer, drafter_dirs, prompts, evaluation, aux_layer_ids)
    methods = record["methods"]
    candidate, baseline = methods["candidate"], methods["baseline"]
    record.update(
        {
            "run_id": run_id,
            "prompts": len(prompts),
            "max_new_tokens": settings.max_new_tokens,
            "baseline_tok_s": baseline["tok_s"],
            "drafter_tok_s": candidate["tok_s"],
            "tau_measured": candidate.get("tau_measured"),
            "speedup_vs_baseline": round(candidate["tok_s"] / baseline["tok_s"], 4),
            "speedup_vs_ngram": round(candidate["tok_s"] / methods["ngram"]["tok_s"], 4),
            "decision": promotion_decision(methods, settings),
        }
    )
    prefix = f"{layout.run_prefix(run_id)}/bench"
    info = store.put_bytes(f"{prefix}/bench.json", json.dumps(record, indent=2).encode())
    manifest = publish(
        store,
        prefix,
        "bench",
        [info],
        {
            "run_id": run_id,
            "summary": {
                k: record[k]
                for k in (
                    "engine",
                    "baseline_tok_s",
                    "drafter_tok_s",
                    "tau_measured",
                    "tau_simulated",
                    "speedup_vs_baseline",
                    "speedup_vs_ngram",
                    "decision",
                )
            },
        },
    )
    log.info(
        "benchmark (%s): baseline %.1f tok/s, ngram %.1f, candidate %.1f at steps %d topk %d tokens %d "
        "(tau %s measured, %.2f simulated)",
        record["engine"],
        baseline["tok_s"],
        methods["ngram"]["tok_s"],
        candidate["tok_s"],
        record["draft_steps"],
        record["topk"],
        record["draft_tokens"],
        record["tau_measured"],
        record["tau_simulated"],
    )
    return StageResult(store.uri(prefix), manifest)
