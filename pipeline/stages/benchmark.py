"""benchmark: tok/s and acceptance length of baseline, n-gram, incumbent and candidate in ONE run.

The local engine is the reference speculative decoder (pipeline.spec_decode) over the target on
held-out prompts; methods run interleaved prompt by prompt so machine noise hits all of them alike.
Every speculative output must equal plain greedy decoding token for token, or the stage fails.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from pipeline import layout
from pipeline.chat import prompt_ids
from pipeline.config import RunConfig
from pipeline.export import load_drafter
from pipeline.manifest import publish, read_listed, read_manifest
from pipeline.progress import Progress
from pipeline.records import decode_jsonl
from pipeline.spec_decode import DecodeResult, EagleProposer, NgramProposer, TargetRunner, greedy_decode, \
    speculative_decode
from pipeline.stages import StageResult
from pipeline.stages.evaluate import local_drafter_dir
from pipeline.storage import ObjectStore, open_store
from pipeline.target import describe_target, load_frozen_tensors, load_model, load_tokenizer

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
            prompts.append(prompt_ids(tokenizer, record["messages"][:first_user + 1]))
            if len(prompts) == count:
                return prompts
    if not prompts:
        raise BenchmarkFailed(f"prompts {prompts_uri} have no held-out (eval) conversations to benchmark on")
    return prompts


def _summary(results: list[DecodeResult]) -> dict[str, Any]:
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    summary: dict[str, Any] = {"tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 2)}
    forwards = sum(r.verify_forwards for r in results)
    if forwards:
        summary["tau_measured"] = round(sum(r.cycle_tokens for r in results) / forwards, 4)
        histogram = [sum(h) for h in zip(*(r.accepted_histogram for r in results))]
        summary["accepted_histogram"] = histogram
    return summary


def compare_methods(model, tokenizer, prompts: list[list[int]], drafters: dict[str, torch.nn.Module],
                    aux_layer_ids: list[int], settings) -> dict[str, Any]:
    """Run every method on every prompt, interleaved, and check outputs against greedy."""
    plain = TargetRunner(model, None)
    with_aux = TargetRunner(model, aux_layer_ids)
    eos = tokenizer.eos_token_id
    methods = {"baseline": lambda p: greedy_decode(plain, p, settings.max_new_tokens, eos),
               "ngram": lambda p: speculative_decode(plain, NgramProposer(settings.ngram_max_match,
                                                                          settings.ngram_min_match),
                                                     p, settings.max_new_tokens, eos, settings.draft_steps)}
    for name, drafter in drafters.items():
        methods[name] = (lambda d: lambda p: speculative_decode(with_aux, EagleProposer(d), p, settings.max_new_tokens,
                                                                eos, settings.draft_steps))(drafter)
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


def run(config: RunConfig, train_uri: str, eval_uri: str, prompts_uri: str, run_id: str,
        store: ObjectStore | None = None, incumbent_dir: Path | None = None) -> StageResult:
    store = store or open_store(config.storage)
    settings = config.benchmark
    target = describe_target(config)
    tokenizer = load_tokenizer(target.model_dir)
    workdir = config.storage.run_workdir(run_id)
    frozen = load_frozen_tensors(target.model_dir)
    drafters = {"candidate": load_drafter(local_drafter_dir(store, store.key_for(train_uri), workdir),
                                          frozen["embed"].float())}
    if incumbent_dir is not None:
        drafters["incumbent"] = load_drafter(incumbent_dir, frozen["embed"].float())
    contract = drafters["candidate"][1]
    for name, (_, drafter_contract) in drafters.items():
        if drafter_contract["aux_layer_ids"] != contract["aux_layer_ids"]:
            raise BenchmarkFailed(f"{name} drafter reads aux layers {drafter_contract['aux_layer_ids']}, "
                                  f"the candidate {contract['aux_layer_ids']}")
    model = load_model(target.model_dir)
    prompts = heldout_prompts(store, prompts_uri, tokenizer, settings.num_prompts)
    methods = compare_methods(model, tokenizer, prompts, {n: d for n, (d, _) in drafters.items()},
                              contract["aux_layer_ids"], settings)
    evaluation = json.loads(read_listed(store, store.key_for(eval_uri), read_manifest(store, store.key_for(eval_uri)),
                                        "eval.json"))
    steps = settings.draft_steps
    tau_simulated = 1.0 + sum(evaluation["full_acc"][:steps])
    record = {
        "engine": "local", "run_id": run_id, "prompts": len(prompts), "max_new_tokens": settings.max_new_tokens,
        "draft_steps": steps, "methods": methods,
        "baseline_tok_s": methods["baseline"]["tok_s"], "drafter_tok_s": methods["candidate"]["tok_s"],
        "tau_measured": methods["candidate"]["tau_measured"], "tau_simulated": round(tau_simulated, 4),
        "speedup_vs_baseline": round(methods["candidate"]["tok_s"] / methods["baseline"]["tok_s"], 4),
        "speedup_vs_ngram": round(methods["candidate"]["tok_s"] / methods["ngram"]["tok_s"], 4),
        "decision": promotion_decision(methods, settings),
    }
    prefix = f"{layout.run_prefix(run_id)}/bench"
    info = store.put_bytes(f"{prefix}/bench.json", json.dumps(record, indent=2).encode())
    manifest = publish(store, prefix, "bench", [info], {"run_id": run_id, "summary": {
        k: record[k] for k in ("baseline_tok_s", "drafter_tok_s", "tau_measured", "tau_simulated",
                               "speedup_vs_baseline", "speedup_vs_ngram", "decision")}})
    log.info("benchmark: baseline %.1f tok/s, ngram %.1f, candidate %.1f (tau %.2f measured, %.2f simulated)",
             record["baseline_tok_s"], methods["ngram"]["tok_s"], record["drafter_tok_s"],
             record["tau_measured"], record["tau_simulated"])
    return StageResult(store.uri(prefix), manifest)
