"""The reference decoder's decodes as the benchmark runs and records them: a method is a callable from a
prompt to a DecodeResult; a method's passes over the prompts become its MethodResult."""

from __future__ import annotations

import torch

from pipeline.benchmark.figures import outputs_sha256
from pipeline.benchmark_settings import NgramLocalSetting
from pipeline.decoding.reference_decoder import (
    DecodeResult,
    EagleProposer,
    NgramProposer,
    TargetRunner,
    speculative_decode,
    tree_speculative_decode,
)
from pipeline.decoding.sampling import Sampling
from pipeline.records import MethodResult


def tok_s_of(results: list[DecodeResult]) -> float:
    return sum(len(r.tokens) for r in results) / sum(r.seconds for r in results)


def method_result(passes: list[list[DecodeResult]]) -> MethodResult:
    """One method's figures over its passes (rounds) through the prompts."""
    results = [result for one_pass in passes for result in one_pass]
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    summary = MethodResult(
        tokens=tokens,
        seconds=round(seconds, 4),
        tok_s=round(tokens / seconds, 2),
        round_tok_s=[round(tok_s_of(one_pass), 2) for one_pass in passes],
    )
    forwards = sum(r.verify_forwards for r in results)
    if forwards:
        summary.tau_measured = round(sum(r.cycle_tokens for r in results) / forwards, 4)
        histogram = [sum(h) for h in zip(*(r.accepted_histogram for r in results), strict=True)]
        summary.accepted_histogram = histogram
        summary.acceptance_per_position = [
            round(sum(histogram[i + 1 :]) / forwards, 4) for i in range(len(histogram) - 1)
        ]
    summary.outputs_sha256 = outputs_sha256(outputs_of(passes[0]))
    return summary


def outputs_of(one_pass: list[DecodeResult]) -> list[list[int]]:
    """Every sequence's output in a pass, in order (a batch's rows each count as one)."""
    return [row for result in one_pass for row in (result.rows or [result.tokens])]


def eagle_method(
    runner: TargetRunner,
    drafter,
    shape: tuple[int, int, int],
    max_new_tokens: int,
    eos: int | None,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
):
    """The drafter's chain or tree of `shape` (steps, topk, draft tokens), greedy or sampled (`sampling`,
    drawing from `generator`)."""
    steps, topk, draft_tokens = shape
    if topk == 1:
        return lambda p: speculative_decode(
            runner, EagleProposer(drafter), p, max_new_tokens, eos, steps, sampling, generator
        )
    return lambda p: tree_speculative_decode(
        runner,
        EagleProposer(drafter),
        p,
        max_new_tokens,
        eos,
        steps,
        topk,
        draft_tokens,
        sampling,
        generator,
    )


def ngram_method(runner: TargetRunner, setting: NgramLocalSetting, max_new_tokens: int, eos: int | None):
    """The reference decoder's n-gram (prompt-lookup) speculation with one setting."""
    return lambda p: speculative_decode(
        runner,
        NgramProposer(setting.max_match, setting.min_match),
        p,
        max_new_tokens,
        eos,
        setting.steps,
    )
