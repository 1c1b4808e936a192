"""SGLang as a benchmark engine (benchmark.engine "sglang", production): baseline, NGRAM, incumbent and
candidate EAGLE3 servers, one after the other on the same GPUs, each sent the same prompts. NGRAM runs once
per configured setting (benchmark.sglang.ngram_settings), so the candidate is compared with n-gram at its
best; with benchmark.sglang.candidates the drafter's flags are chosen first by timing one server per setting.

Each server is started with `benchmark.sglang.launch` + the method's flags, waited on through
/health, measured, and stopped (SIGTERM, then SIGKILL, by PID). Throughput is completion tokens over
wall time with `concurrency` requests in flight; acceptance is sum(completion_tokens) /
sum(spec_verify_ct) over all requests (SpecForge's definition, which counts the prefill token) with
the spec_correct_drafts_histogram summed. A server that does not start or fails a request fails the
stage with what it printed. The speedups pair the methods' rounds by index (the same prompts in the same
batches on every server), one server at a time: a drift of the machine between servers is not cancelled.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import records
from pipeline.benchmark.figures import (
    engine_bench,
    interval,
    ngram_sweep,
    paired_ratio,
    paired_speedups,
    required_tau,
    sampled_bench,
    setting_choice,
)
from pipeline.benchmark.job import BenchJob, BenchmarkFailed
from pipeline.benchmark_settings import NgramServerSetting, ServingSampling, SGLangBenchConfig
from pipeline.decoding.choice import Choice, Shape, choose, shape_label
from pipeline.decoding.speedup import predicted_tau
from pipeline.drafter.servable import sglang_flags
from pipeline.engine_requests import EngineError
from pipeline.engine_settings import SGLangClientConfig
from pipeline.records import BatchBench, BenchMethods, MeasuredAcceptance, MethodResult, TimedSetting
from pipeline.retrying import await_health
from pipeline.spread import Measurement, ratio_from_samples

log = logging.getLogger(__name__)


def measure(job: BenchJob) -> records.EngineBench:
    """SGLang servers started one method at a time. The drafters' setting is benchmark.sglang's, or, with
    benchmark.sglang.candidates, the one chosen by timing a server of each (time_settings and
    pipeline.decoding.choice). Each method's acceptance per domain too."""
    configured = job.settings.sglang
    if configured is None:
        raise BenchmarkFailed("benchmark.engine 'sglang' needs benchmark.sglang")
    bench, prompts, candidate_dir = job.settings, job.prompts, job.drafter_dirs["candidate"]
    serving = bench.serving_sampling
    settings, timed, choice = configured, {}, None
    if configured.candidates:
        timed = time_settings(configured, prompts, bench.max_new_tokens, candidate_dir)
        choice = choose(
            server_rounds(timed, bench.confidence), {shape_label(shape): shape for shape in timed}
        )
        settings = configured.serving(next(shape for shape in timed if shape_label(shape) == choice.chosen))
        log.info("benchmark (sglang): %s", choice.reason)
    measured = run_methods(
        settings,
        prompts,
        bench.max_new_tokens,
        job.drafter_dirs,
        serving,
        bench.measured_batch_sizes(),
        job.domains,
    )
    by_domain = {name: figures.pop("domains", {}) for name, figures in measured.greedy.items()}
    methods, ngram_sweep = sglang_methods(measured.greedy, settings.ngram_settings)
    speedups = paired_speedups(methods, bench.confidence)
    shape = settings.setting()
    tau = round(required_tau(job.evaluation, shape), 4)
    figures = engine_bench(job, "sglang", shape, tau, methods, speedups, ngram_sweep)
    figures.batch_size = settings.concurrency
    figures.max_running_requests = settings.max_running_requests
    fastest_ngram_server = next(s for s in settings.ngram_settings if s.label == ngram_sweep.best)
    figures.domain_acceptance = domain_acceptance(by_domain, ngram_method_name(fastest_ngram_server))
    figures.batches = [
        sglang_batch(level, level_figures, settings, fastest_ngram_server, bench.confidence)
        for level, level_figures in sorted(measured.at_concurrency.items())
    ]
    if serving is not None:
        results = {name: MethodResult.model_validate(sampled) for name, sampled in measured.sampled.items()}
        figures.sampled = sampled_bench(
            serving, results, paired_ratio(results["candidate"], results, bench.confidence)
        )
    if choice is not None:
        figures.timed_settings, figures.setting_choice = timed_server_settings(
            timed, choice, methods.baseline, job.evaluation, bench.confidence
        )
    return figures


class SGLangBenchmarkFailed(BenchmarkFailed):
    pass


NGRAM_PREFIX = "ngram:"


def ngram_method_name(setting: NgramServerSetting) -> str:
    """How run_methods names the NGRAM server of one setting."""
    return f"{NGRAM_PREFIX}{setting.label}"


def launch_command(
    settings: SGLangBenchConfig,
    method: str,
    drafter_dir: Path | None = None,
    ngram: NgramServerSetting | None = None,
) -> list[str]:
    """The server command of one method; "ngram" needs its setting."""
    command = [
        *settings.launch,
        "--model-path",
        settings.model_path,
        "--host",
        settings.host,
        "--port",
        str(settings.port),
        *settings.extra_args,
        *settings.load_args(),
    ]
    if method == "ngram":
        if ngram is None:
            raise SGLangBenchmarkFailed("the ngram server needs one of benchmark.sglang.ngram_settings")
        return command + ngram.launch_args()
    if method in ("candidate", "incumbent"):
        if drafter_dir is None:
            raise SGLangBenchmarkFailed(f"the {method} server needs a drafter directory")
        return command + sglang_flags(str(drafter_dir), settings.steps, settings.topk, settings.draft_tokens)
    return command


@contextmanager
def running_server(command: list[str], settings: SGLangBenchConfig) -> Iterator[str]:
    """A server process for the duration of the block; its base URL, once /health answers."""
    url = f"http://{settings.host}:{settings.port}"
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)

        def exited() -> None:
            if process.poll() is not None:
                output.seek(0)
                tail = output.read()[-2000:].decode(errors="replace")
                raise SGLangBenchmarkFailed(
                    f"the server exited with code {process.returncode} before it was "
                    f"ready: {' '.join(command)}\n{tail}"
                )

        try:
            if not await_health(url, settings.startup_timeout_s, exited, poll_s=0.5):
                raise SGLangBenchmarkFailed(
                    f"the server did not become healthy in {settings.startup_timeout_s}s"
                )
            yield url
        finally:
            _stop(process)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def summarize_responses(responses: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Throughput and speculative acceptance from /generate responses (SGLang 0.5.23 meta_info)."""
    summary = acceptance_of(responses)
    summary.pop("acceptance_per_position", None)
    return {**summary, "seconds": round(seconds, 4), "tok_s": round(summary["tokens"] / seconds, 2)}


def acceptance_of(responses: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests, completion tokens and, for a speculative server, acceptance from responses' meta_info:
    tau (tokens over verify steps), the correct-drafts histogram summed, and from it the per-position
    acceptance (the share of verify steps that accepted more than i drafts)."""
    metas = [r["meta_info"] for r in responses]
    tokens = sum(int(m["completion_tokens"]) for m in metas)
    summary: dict[str, Any] = {"requests": len(metas), "tokens": tokens}
    verify = sum(int(m.get("spec_verify_ct", 0)) for m in metas)
    if not verify:
        return summary
    summary["tau_measured"] = round(tokens / verify, 4)
    histograms = [m["spec_correct_drafts_histogram"] for m in metas if m.get("spec_correct_drafts_histogram")]
    if histograms:
        width = max(len(h) for h in histograms)
        summed = [sum(h[i] for h in histograms if i < len(h)) for i in range(width)]
        summary["accepted_histogram"] = summed
        steps = sum(summed)
        summary["acceptance_per_position"] = (
            [] if not steps else [round(sum(summed[i + 1 :]) / steps, 4) for i in range(width - 1)]
        )
    return summary


def per_domain(responses: list[dict[str, Any]], domains: list[str]) -> dict[str, dict[str, Any]]:
    """acceptance_of each domain's responses (`domains`: each response's, in order)."""
    return {
        domain: acceptance_of([r for r, d in zip(responses, domains, strict=True) if d == domain])
        for domain in sorted(set(domains))
    }


def batches(items: list[Any], rounds: int) -> list[list[Any]]:
    """`items` in `rounds` consecutive batches of (nearly) equal size, none empty."""
    rounds = min(rounds, len(items))
    size, extra = divmod(len(items), rounds)
    bounds = [i * size + min(i, extra) for i in range(rounds + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(rounds)]


def sampling_params(max_new_tokens: int, serving: ServingSampling | None) -> dict[str, Any]:
    """/generate's sampling_params: greedy, or the serving temperature/top_p/top_k (SGLang's top_k -1:
    every token)."""
    if serving is None:
        return {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": serving.temperature,
        "top_p": serving.top_p,
        "top_k": serving.top_k or -1,
    }


def measure_server(
    url: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    concurrency: int,
    rounds: int,
    serving: ServingSampling | None = None,
    domains: list[str] | None = None,
) -> dict[str, Any]:
    """The prompts sent in `rounds` batches after a warm-up request, greedy or sampled at `serving`; each
    batch's tokens/s is one sample of the speed (`round_tok_s`), paired across methods by batch. With
    `domains` (each prompt's), also the acceptance per domain (`domains`: acceptance_of each one's
    responses; speed is not split, the rounds mixing domains)."""
    from pipeline.sglang_transport import SGLangClient

    client = SGLangClient(SGLangClientConfig(urls=[url], concurrency=concurrency, retries=0, timeout_s=900))
    params = sampling_params(max_new_tokens, serving)
    payloads = [{"input_ids": p, "sampling_params": params} for p in prompts]
    responses, round_tok_s, seconds = [], [], 0.0
    try:
        client.map("/generate", payloads[:1])  # warm-up
        for batch in batches(payloads, rounds):
            started = time.perf_counter()
            answered = client.map("/generate", batch)
            elapsed = time.perf_counter() - started
            tokens = sum(int(r["meta_info"]["completion_tokens"]) for r in answered)
            responses += answered
            round_tok_s.append(round(tokens / elapsed, 2))
            seconds += elapsed
    except EngineError as err:
        raise SGLangBenchmarkFailed(f"benchmark request to {url} failed: {err}") from err
    summary = {**summarize_responses(responses, seconds), "round_tok_s": round_tok_s}
    if domains is not None:
        summary["domains"] = per_domain(responses, domains)
    return summary


@dataclass
class ServerFigures:
    """What run_methods measured, per method name: greedy at the configured concurrency, sampled at the
    serving temperature (baseline and drafters), and greedy at every other concurrency level."""

    greedy: dict[str, Any]
    sampled: dict[str, Any] = field(default_factory=dict)
    at_concurrency: dict[int, dict[str, Any]] = field(default_factory=dict)


def rounds_at(settings: SGLangBenchConfig, prompts: int, concurrency: int) -> int:
    """Rounds at a concurrency level: as configured, fewer when that would leave fewer prompts per round
    than requests in flight (2 at least: one tokens/s sample each, paired across methods)."""
    if prompts < 2 * concurrency:
        log.warning(
            "benchmark: %d prompts cannot keep %d requests in flight for 2 rounds; the level measures less",
            prompts,
            concurrency,
        )
    return max(2, min(settings.rounds, prompts // concurrency))


def time_settings(
    settings: SGLangBenchConfig, prompts: list[list[int]], max_new_tokens: int, drafter_dir: Path
) -> dict[tuple[int, int, int], dict[str, Any]]:
    """The candidate drafter served at every setting of benchmark.sglang.candidates, one server after
    another, each measured greedy on the benchmark prompts at the headline concurrency in the same rounds
    (`measure_server`: each round's tokens/s, paired across settings by round), as run_methods measures
    methods."""
    figures = {}
    for shape in settings.candidate_settings():
        command = launch_command(settings.serving(shape), "candidate", drafter_dir)
        log.info("benchmark candidate setting %s: %s", shape, " ".join(command))
        with running_server(command, settings) as url:
            require_served_setting(url, shape)
            require_served_load(url, settings.max_running_requests)
            figures[shape] = measure_server(
                url, prompts, max_new_tokens, settings.concurrency, settings.rounds
            )
    return figures


SETTING_ARGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def require_served_setting(url: str, shape: tuple[int, int, int]) -> None:
    """SGLangBenchmarkFailed unless the server's /server_info (its resolved server args) reports the
    (steps, topk, draft tokens) it was launched with: SGLang adjusts some silently (topk 1 forces draft
    tokens = steps + 1, arg_groups/speculative_hook.py:1255-1266), and a setting it did not serve must not
    be chosen under its name."""
    served = tuple(server_info(url).get(key) for key in SETTING_ARGS)
    if served != shape:
        raise SGLangBenchmarkFailed(
            f"the server launched with (steps, topk, draft tokens) {shape} serves {served} "
            f"(/server_info {', '.join(SETTING_ARGS)})"
        )


def require_served_load(url: str, max_running_requests: int | None) -> None:
    """SGLangBenchmarkFailed unless the server runs as many requests at once as it was launched with
    (/server_info max_running_requests): SGLang sets an unset one to 48 for EAGLE
    (arg_groups/speculative_hook.py:1086-1095), and every method must serve the same load."""
    if max_running_requests is None:
        return
    running = server_info(url).get("max_running_requests")
    if running != max_running_requests:
        raise SGLangBenchmarkFailed(
            f"the server launched with --max-running-requests {max_running_requests} runs {running} "
            "requests at once (/server_info max_running_requests)"
        )


def server_info(url: str) -> dict[str, Any]:
    """A server's /server_info; SGLangBenchmarkFailed, with the reason, when it cannot be read."""
    from pipeline.sglang_transport import SGLangClient

    client = SGLangClient(SGLangClientConfig(urls=[url], retries=0, timeout_s=60))
    try:
        return client.get_from(url, "/server_info")
    except Exception as err:  # any failure to read it is fatal here, with its reason
        raise SGLangBenchmarkFailed(f"{url}/server_info failed: {err}") from err


def run_methods(
    settings: SGLangBenchConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    drafters: dict[str, Path],
    serving: ServingSampling | None = None,
    concurrency_levels: list[int] | None = None,
    domains: list[str] | None = None,
) -> ServerFigures:
    """Every method on the same prompts, one server at a time: the baseline, one NGRAM server per n-gram
    setting (named by ngram_method_name), then each drafter; greedy at benchmark.sglang.concurrency (with
    each domain's acceptance, given `domains`: each prompt's), and
    while each server is up: greedy at every other of `concurrency_levels` (that many requests in flight),
    and (with `serving`) the baseline and the drafters sampled at the serving temperature."""
    commands = {"baseline": launch_command(settings, "baseline")}
    for setting in settings.ngram_settings:
        commands[ngram_method_name(setting)] = launch_command(settings, "ngram", ngram=setting)
    for name, drafter_dir in drafters.items():
        commands[name] = launch_command(settings, name, drafter_dir)
    levels = [level for level in concurrency_levels or [] if level != settings.concurrency]
    figures = ServerFigures(greedy={}, at_concurrency={level: {} for level in levels})
    for method, command in commands.items():
        log.info("benchmark %s: %s", method, " ".join(command))
        with running_server(command, settings) as url:
            require_served_load(url, settings.max_running_requests)
            figures.greedy[method] = measure_server(
                url, prompts, max_new_tokens, settings.concurrency, settings.rounds, domains=domains
            )
            for level in levels:
                rounds = rounds_at(settings, len(prompts), level)
                figures.at_concurrency[level][method] = measure_server(
                    url, prompts, max_new_tokens, level, rounds
                )
            if serving is not None and (method == "baseline" or method in drafters):
                figures.sampled[method] = measure_server(
                    url, prompts, max_new_tokens, settings.concurrency, settings.rounds, serving
                )
    return figures


def server_rounds(timed: dict[Shape, dict], confidence: float) -> Measurement:
    """The SGLang setting servers' per-round tokens/s as one measurement (rounds paired by index: the same
    prompts in the same batches on every server)."""
    samples = {shape_label(shape): tuple(figures["round_tok_s"]) for shape, figures in timed.items()}
    rounds = min(len(values) for values in samples.values())
    return Measurement(
        {name: values[:rounds] for name, values in samples.items()},
        rounds,
        "max_rounds",
        confidence,
        sum(figures["seconds"] for figures in timed.values()),
    )


def timed_server_settings(
    timed: dict[Shape, dict],
    choice: Choice,
    baseline: MethodResult,
    evaluation: records.EvalRecord,
    confidence: float,
) -> tuple[list[TimedSetting], records.SettingChoice]:
    """The record of the timed SGLang settings: each one's figures and speed over the baseline server's
    (paired by round) and over the fastest setting's, and the choice."""
    entries = []
    for shape, figures in timed.items():
        name = shape_label(shape)
        result = MethodResult.model_validate(figures)
        entries.append(
            TimedSetting(
                steps=shape[0],
                topk=shape[1],
                draft_tokens=shape[2],
                tau_predicted=predicted_tau(evaluation, *shape),
                tau_measured=result.tau_measured,
                tok_s=result.tok_s,
                round_tok_s=result.round_tok_s,
                speedup=interval(ratio_from_samples(result.round_tok_s, baseline.round_tok_s, confidence)),
                vs_fastest=interval(choice.vs_fastest[name]) if name in choice.vs_fastest else None,
            )
        )
    measured = server_rounds(timed, confidence)
    prompts = sum(int(f["requests"]) for f in timed.values()) // len(timed)
    return entries, setting_choice(choice, prompts, measured)


def domain_acceptance(
    by_domain: dict[str, dict[str, dict]], fastest_ngram: str
) -> dict[str, dict[str, MeasuredAcceptance]]:
    """Each server's per-domain acceptance (`by_domain`: server name -> domain -> figures) as domain ->
    method; n-gram is its fastest setting's server, the other n-gram servers are left out."""
    names = {
        name: ("ngram" if name == fastest_ngram else name)
        for name in by_domain
        if name == fastest_ngram or not name.startswith(NGRAM_PREFIX)
    }
    domains = sorted({domain for figures in by_domain.values() for domain in figures})
    return {
        domain: {
            method: MeasuredAcceptance.model_validate(by_domain[name][domain])
            for name, method in names.items()
            if domain in by_domain[name]
        }
        for domain in domains
    }


def sglang_batch(
    level: int,
    figures: dict[str, dict],
    settings: SGLangBenchConfig,
    ngram: NgramServerSetting,
    confidence: float,
) -> BatchBench:
    """The SGLang servers' figures with `level` requests in flight; n-gram is the setting fastest at the
    headline concurrency."""
    ngram_names = {ngram_method_name(setting) for setting in settings.ngram_settings}
    plain = {name: result for name, result in figures.items() if name not in ngram_names}
    methods = BenchMethods.model_validate({**plain, "ngram": figures[ngram_method_name(ngram)]})
    return BatchBench(
        batch_size=level,
        draft_steps=settings.steps,
        topk=settings.topk,
        draft_tokens=settings.draft_tokens,
        speedups=paired_speedups(methods, confidence),
        tau_measured=methods.candidate.tau_measured,
        methods=methods,
    )


def sglang_methods(
    measured: dict[str, dict], ngram_settings: list[NgramServerSetting]
) -> tuple[BenchMethods, records.NgramSweep]:
    """run_methods' figures as the record keeps them: n-gram's servers (one per setting, named
    ngram_method_name) as the sweep, and the fastest as the n-gram method."""
    results = {s.label: MethodResult.model_validate(measured[ngram_method_name(s)]) for s in ngram_settings}
    sweep = ngram_sweep(ngram_settings, results, "every benchmark prompt, one server per setting")
    ngram_names = {ngram_method_name(setting) for setting in ngram_settings}
    plain = {name: figures for name, figures in measured.items() if name not in ngram_names}
    best = next(entry.result for entry in sweep.settings if entry.setting == sweep.best)
    return BenchMethods.model_validate({**plain, "ngram": best}), sweep
