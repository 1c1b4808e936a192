"""A local stand-in for an SGLang server, backed by a transformers target, speaking SGLang's HTTP format.

Real SGLang 0.5.23 runs on this CPU for plain generation and capture only (tests/system/
test_sglang_real.py); its EAGLE3 and NGRAM serving and the MLA target do not (docs/BENCHMARKS.md, issue 56),
and it starts in about 30 s where this starts in a few. This server stands in for it wherever those are
needed (the benchmark, the serving pods, the rehearsal's Kimi-shaped target) and in the fast tiers, so the
SGLang client code paths run over real HTTP in tests and benchmarks. It implements what the pipeline
uses of SGLang 0.5.23 (reference/sglang-contract.md): POST /generate (input_ids, sampling_params,
return_hidden_states), GET /server_info (the server args, model path and revision included;
/get_server_info too, deprecated with a warning at each call, as 0.5.23 logs it), GET /health
and /health_generate as 0.5.23 answers them (a one-token generation through the scheduler, at least a
second; see HealthCheck), and with --enable-metrics GET /metrics (SGLang's request counters, in
Prometheus' text format). Started with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3
[--return-aux-hidden-state-layer-ids I J K] (its own shorthand: --aux-layer-ids I J K; SGLang 0.5.23's
refusals of these flags are modelled, aux_capture_refusal) it behaves as a capture server, capturing the
layers SGLang captures for those ids on the target's model family (pipeline.engines.layer_ids), as it
feeds an EAGLE3 draft the layers its config's ids name; with --speculative-algorithm NGRAM or EAGLE3 it
decodes with the reference speculative decoder and reports the spec_* meta_info fields. With
SGLANG_STANDIN_DEVICE_CLOCK set (its own setting, DeviceClock) a request takes a modelled GPU's time for
its forwards instead of whatever this shared CPU takes.

    python -m harness.sglang_standin --model-path DIR --port 30000 [--trust-remote-code]
        [--aux-layer-ids 1 3 4]
        [--speculative-algorithm EAGLE3 --speculative-draft-model-path D --speculative-num-steps 3 ...]
        [--synthetic-hidden-size 7168]   capture responses of that width from synthetic weights
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch

from harness.json_http import send_json, send_json_chunks
from harness.synthetic_states import SyntheticStates
from pipeline.decoding.sampling import Sampling
from pipeline.engines.layer_ids import captured_layer_outputs, model_family_of
from pipeline.sglang_ngram_rules import NgramLaunch, launch_from_args, refusals

if TYPE_CHECKING:
    from pipeline.drafter.model import Eagle3Drafter

VERSION = "0.5.23-standin"
# srt/entrypoints/http_server.py:853-860 of 0.5.23
GET_SERVER_INFO_DEPRECATED = (
    "Endpoint '/get_server_info' is deprecated and will be removed in a future version. "
    "Please use '/server_info' instead."
)
# SGLang 0.5.23's health settings (srt/environ.py:344, srt/entrypoints/http_server.py:218)
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
HEALTH_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
_ENV_TRUE, _ENV_FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")


def health_generation_enabled(environ: dict[str, str]) -> bool:
    """SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION as 0.5.23's EnvBool reads it (srt/environ.py:143-150,
    default true at :344); a value it does not know is refused (SGLang raises where it reads it)."""
    value = environ.get(HEALTH_GENERATION_ENV)
    if value is None:
        return True
    if value.strip().lower() in _ENV_TRUE:
        return True
    if value.strip().lower() in _ENV_FALSE:
        return False
    raise SystemExit(f"{HEALTH_GENERATION_ENV}={value!r} is not a boolean SGLang reads")


DEVICE_CLOCK_ENV = "SGLANG_STANDIN_DEVICE_CLOCK"


@dataclass(frozen=True)
class DeviceClock:
    """A modelled accelerator's time, for benchmarks whose verdict must not follow this machine's load
    (the stand-in's own setting, SGLANG_STANDIN_DEVICE_CLOCK="forward_ms=F,draft_ms=D"; unset, requests
    take what the CPU takes). A real SGLang server's decode speed is its GPU's: a target forward at the
    small batches benchmarked takes about the same time whatever it scores (memory-bound) and whatever
    else the host runs, so its tokens per second follow its forwards, hence its acceptance. Here a
    request takes at least F per target forward (prefill, decode step or verify) and D per draft step,
    counted from when it got its running slot: what the CPU computes is hidden inside that time while it
    is shorter, so timing depends on acceptance and not on the other processes of a shared machine.
    Requests overlap their modelled time, as requests batched on a GPU do."""

    forward_s: float
    draft_s: float
    now: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> DeviceClock | None:
        value = environ.get(DEVICE_CLOCK_ENV)
        if not value:
            return None
        fields: dict[str, float] = {}
        for part in value.split(","):
            key, sep, number = part.strip().partition("=")
            if not sep or key not in ("forward_ms", "draft_ms") or key in fields:
                raise SystemExit(
                    f"{DEVICE_CLOCK_ENV}={value!r}: expected forward_ms=F,draft_ms=D (each once)"
                )
            try:
                fields[key] = float(number)
            except ValueError:
                raise SystemExit(f"{DEVICE_CLOCK_ENV}={value!r}: {key} is not a number") from None
        if set(fields) != {"forward_ms", "draft_ms"} or fields["forward_ms"] <= 0 or fields["draft_ms"] < 0:
            raise SystemExit(f"{DEVICE_CLOCK_ENV}={value!r}: needs forward_ms > 0 and draft_ms >= 0")
        return cls(fields["forward_ms"] / 1000, fields["draft_ms"] / 1000)

    def seconds(self, target_forwards: int, draft_steps: int) -> float:
        return target_forwards * self.forward_s + draft_steps * self.draft_s

    def hold(self, started: float, target_forwards: int, draft_steps: int) -> None:
        """Return no sooner than the modelled time of these forwards after `started` (self.now's)."""
        left = started + self.seconds(target_forwards, draft_steps) - self.now()
        if left > 0:
            self.sleep(left)


class HealthCheck:
    """GET /health and /health_generate as SGLang 0.5.23 answers them (srt/entrypoints/http_server.py:
    721-799, one handler for both paths). /health_generate, and /health while health generation is on
    (the default), submit a one-token greedy generation of input [0] that no metric counts, then sleep a
    second at a time until the server has received output since the check began: 200, never before one
    second has passed; 503 once SGLANG_HEALTH_CHECK_TIMEOUT (20 s) has. With generation off, /health
    answers 200 at once."""

    def __init__(self, backend: StandinBackend, generation: bool, timeout_s: float):
        self.backend, self.generation, self.timeout_s = backend, generation, timeout_s

    @classmethod
    def from_environment(cls, backend: StandinBackend, environ: dict[str, str]) -> HealthCheck:
        return cls(backend, health_generation_enabled(environ), float(environ.get(HEALTH_TIMEOUT_ENV, 20)))

    def status(self, path: str) -> int:
        if path == "/health" and not self.generation:
            return 200
        began = time.time()
        request = {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        threading.Thread(
            target=self.backend.generate_one, args=(request, [0]), kwargs={"counted": False}, daemon=True
        ).start()
        while time.time() < began + self.timeout_s:
            time.sleep(1)
            if self.backend.last_received > began:
                return 200
        return 503


class Batcher:
    """Continuous-batching in miniature: plain generation requests that arrive together share one
    batched forward per step, so a client's concurrency pays off here as it does on a real server."""

    def __init__(self, engine, lock: threading.Lock, max_batch: int = 32, window_s: float = 0.01):
        self.engine, self.lock, self.max_batch, self.window_s = engine, lock, max_batch, window_s
        self.pending: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def generate(self, ids: list[int], params) -> Any:
        done = threading.Event()
        slot: dict[str, Any] = {}
        self.pending.put((ids, params, slot, done))
        done.wait()
        if "error" in slot:
            raise slot["error"]
        return slot["result"]

    def _take(self) -> list:
        batch = [self.pending.get()]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch and (left := deadline - time.monotonic()) > 0:
            try:
                batch.append(self.pending.get(timeout=left))
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            groups: dict[Any, list] = {}
            for item in batch:
                groups.setdefault(item[1], []).append(item)
            for params, items in groups.items():
                try:
                    with self.lock, torch.inference_mode():
                        results = self.engine.generate([ids for ids, *_ in items], params)
                    for (_, _, slot, _), result in zip(items, results, strict=True):
                        slot["result"] = result
                except Exception as err:  # handed back to each waiting request
                    for _, _, slot, _ in items:
                        slot["error"] = err
                for *_, done in items:
                    done.set()


class StandinBackend:
    def __init__(
        self,
        model_dir: Path,
        aux_layer_ids: list[int] | None,
        algorithm: str | None = None,
        draft_dir: Path | None = None,
        num_steps: int = 3,
        topk: int = 1,
        draft_tokens: int | None = None,
        trust_remote_code: bool = False,
        ngram_max_match: int = NgramLaunch().max_trie_depth - 1,
        synthetic_hidden_size: int | None = None,
        revision: str | None = None,
        enable_metrics: bool = False,
        max_running_requests: int | None = None,
        device_clock: DeviceClock | None = None,
    ):
        from pipeline.engines.hf import HFEngine

        self.device_clock = device_clock  # None: requests take what this CPU takes

        # what SGLang's scheduler runs at once: more requests wait for a slot (None: unbounded here)
        self.max_running_requests = max_running_requests
        self.running = threading.BoundedSemaphore(max_running_requests) if max_running_requests else None

        self.model_path, self.revision, self.enable_metrics = str(model_dir), revision, enable_metrics
        self.counters = RequestCounters()
        self.last_received = 0.0  # when the scheduler last finished a request (SGLang's last_receive_tstamp)

        if algorithm == "EAGLE3":  # refuse, before loading anything, a draft SGLang 0.5.23 would not serve
            from pipeline.engines.sglang_draft_checks import SpeculativeArgs, require_loadable_draft

            require_loadable_draft(
                model_dir,
                draft_dir,
                SpeculativeArgs(algorithm, num_steps, topk, draft_tokens),
                trust_remote_code=trust_remote_code,
            )
        self.engine = HFEngine(model_dir, trust_remote_code=trust_remote_code)
        self.model, self.tokenizer = self.engine.model, self.engine.tokenizer
        # capture requests answered from synthetic weights of this width (harness.synthetic_states)
        self.synthetic = (
            SyntheticStates(int(self.model.config.vocab_size), synthetic_hidden_size)
            if synthetic_hidden_size
            else None
        )
        self.family = model_family_of(model_dir)
        # --return-aux-hidden-state-layer-ids are read as SGLang reads them for this target's model family
        self.aux_layer_ids = aux_layer_ids
        self.aux_layer_outputs = (
            captured_layer_outputs("sglang", self.family, aux_layer_ids, self.engine.num_layers)
            if aux_layer_ids is not None
            else None
        )
        self.algorithm = algorithm
        self.num_steps, self.topk = num_steps, topk
        self.draft_tokens = draft_tokens or num_steps + 1
        if algorithm == "EAGLE3":  # the draft tokens SGLang 0.5.23 runs, adjusted as it adjusts them
            from pipeline.engines.sglang_draft_checks import SpeculativeArgs, effective_speculative_args

            architecture = (self.model.config.architectures or [""])[0]
            served = effective_speculative_args(
                SpeculativeArgs(algorithm, num_steps, topk, draft_tokens), architecture
            )
            self.draft_tokens = served.num_draft_tokens or self.draft_tokens
        # NGRAM drafts a chain continuing the latest match of a context suffix of up to this many tokens
        # (SGLang's trie matches up to max_trie_depth - 1; its BFS breadth has no counterpart here)
        self.ngram_max_match = ngram_max_match
        self.lock = threading.Lock()
        self.batcher = Batcher(self.engine, self.lock)
        self.accept_lengths: list[float] = []
        self.drafter: Eagle3Drafter | None = None
        if algorithm == "EAGLE3":
            from pipeline.drafter.export import load_drafter
            from pipeline.engines.target import load_frozen_tensors

            assert draft_dir is not None  # require_loadable_draft refused a missing draft above
            self.drafter, _ = load_drafter(draft_dir, load_frozen_tensors(model_dir)["embed"].float())
            # the layers SGLang feeds the draft: those its config's ids name on this target
            eagle = json.loads((draft_dir / "config.json").read_text()).get("eagle_config") or {}
            self.draft_layers = captured_layer_outputs(
                "sglang", self.family, eagle.get("eagle_aux_hidden_state_layer_ids"), self.engine.num_layers
            )

    def _prompt_forward(self, ids: list[int], output: list[int], hidden: bool, top_k: int) -> dict[str, Any]:
        """meta_info fields from one forward over prompt + output: hidden states (prompt block) and
        log-probs."""
        num_layers = self.engine.num_layers
        outputs = self.aux_layer_outputs
        wanted = [k + 1 for k in outputs] if outputs is not None else [num_layers]
        out = self.model(input_ids=torch.tensor([ids + output]), output_hidden_states=wanted, use_cache=False)
        meta: dict[str, Any] = {}
        if hidden:
            meta["hidden_states"] = [
                torch.cat([out.hidden_states[i][0, : len(ids)] for i in wanted], dim=-1).tolist()
            ]
        if top_k:
            values, indices = torch.log_softmax(out.logits[0].float(), -1).topk(top_k, -1)
            rows = [
                [[v, i, None] for v, i in zip(vs, ix, strict=True)]
                for vs, ix in zip(values.tolist(), indices.tolist(), strict=True)
            ]
            meta["input_top_logprobs"] = [None] + rows[: len(ids) - 1]
            meta["output_top_logprobs"] = rows[len(ids) - 1 : len(ids) - 1 + len(output)]
        return meta

    def _decode(
        self, ids: list[int], max_new_tokens: int, ignore_eos: bool, sampling: Sampling | None = None
    ) -> tuple[list[int], dict[str, Any], tuple[int, int]]:
        """Greedy, or sampled (`sampling`) with drafts verified by SGLang's target-only rule; the tokens,
        the spec_* meta_info fields, and the (target forwards, draft steps) it ran."""
        from pipeline.decoding import reference_decoder as decoder

        eos = None if ignore_eos else self.tokenizer.eos_token_id
        plain = decoder.TargetRunner(self.model, None)
        draws = (sampling, torch.Generator().manual_seed(int(torch.randint(2**62, ()))))
        if self.algorithm is None:
            tokens = decoder.greedy_decode(plain, ids, max_new_tokens, eos, *draws).tokens
            return tokens, {}, (len(tokens), 0)
        if self.algorithm == "NGRAM":
            ngram = decoder.NgramProposer(max_match=self.ngram_max_match)
            steps = self.draft_tokens - 1
            result = decoder.speculative_decode(plain, ngram, ids, max_new_tokens, eos, steps, *draws)
            draft_steps = 0  # a lookup in the tokens so far, no model
        elif self.drafter is None:  # only EAGLE3, which loads one, is served besides NGRAM
            raise ValueError(f"speculative algorithm {self.algorithm} has no draft model")
        else:
            target = decoder.TargetRunner(self.model, self.draft_layers)
            eagle = decoder.EagleProposer(self.drafter)
            if self.topk == 1:
                result = decoder.speculative_decode(
                    target, eagle, ids, max_new_tokens, eos, self.num_steps, *draws
                )
            else:
                tree = (self.num_steps, self.topk, self.draft_tokens)
                result = decoder.tree_speculative_decode(
                    target, eagle, ids, max_new_tokens, eos, *tree, *draws
                )
            draft_steps = result.verify_forwards * self.num_steps  # one draft forward per tree level
        verify = max(1, result.verify_forwards)
        accept_length = len(result.tokens) / verify
        self.accept_lengths.append(accept_length)
        return (
            result.tokens,
            {
                "spec_verify_ct": verify,
                "spec_accept_length": accept_length,
                "spec_num_correct_drafts": sum(k * n for k, n in enumerate(result.accepted_histogram)),
                "spec_num_proposed_drafts": verify * (self.draft_tokens - 1),
                "spec_correct_drafts_histogram": result.accepted_histogram,
            },
            (1 + result.verify_forwards, draft_steps),  # the prefill, then one forward per verify
        )

    def generate_one(self, request: dict[str, Any], ids: list[int], counted: bool = True) -> dict[str, Any]:
        """One request's response, once one of max_running_requests slots is free (as SGLang's scheduler
        queues the rest); `counted` false for the health check's (SGLang's log_metrics=False)."""
        if self.running is None:
            return self._generate(request, ids, counted)
        with self.running:
            return self._generate(request, ids, counted)

    def _generate(self, request: dict[str, Any], ids: list[int], counted: bool) -> dict[str, Any]:
        from pipeline.engines import SamplingParams

        started = time.perf_counter()
        sampling = request.get("sampling_params") or {}
        max_new = int(sampling.get("max_new_tokens", 128))
        top_k = int(request.get("top_logprobs_num") or 0) if request.get("return_logprob") else 0
        truncated = _truncated_sampling(sampling)
        plain = not (
            top_k
            or request.get("return_hidden_states")
            or self.algorithm
            or sampling.get("ignore_eos")
            or truncated
        )
        spec: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        if plain:
            params = SamplingParams(max_new, float(sampling.get("temperature", 1.0)))
            output = self.batcher.generate(ids, params).output_ids
            forwards = (len(output), 0)  # a batched forward per token, shared with the requests beside it
        else:
            with self.lock, torch.inference_mode():
                output, spec, forwards = self._decode(
                    ids, max_new, bool(sampling.get("ignore_eos")), truncated or _sampled(sampling)
                )
                if request.get("return_hidden_states") or top_k:
                    extra = self._prompt_forward(
                        ids, output, bool(request.get("return_hidden_states")), top_k
                    )
                    forwards = (forwards[0] + 1, forwards[1])
        if self.device_clock is not None:  # outside the lock: requests on a device overlap in time
            self.device_clock.hold(started, *forwards)
        if counted:
            self.counters.finished(len(ids), len(output), int(spec.get("spec_verify_ct", 0)))
        self.last_received = time.time()
        eos = self.tokenizer.eos_token_id
        stopped = bool(output) and output[-1] == eos
        finish = {"type": "stop", "matched": eos} if stopped else {"type": "length", "length": max_new}
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(output),
            "cached_tokens": 0,
            "e2e_latency": time.perf_counter() - started,
            **spec,
            **extra,
        }
        # like SGLang 0.5.23, output_ids run through the stop token
        return {
            "text": self.tokenizer.decode(output, skip_special_tokens=True),
            "output_ids": output,
            "meta_info": meta,
        }

    def server_info(self) -> dict[str, Any]:
        """The resolved server args SGLang reports, as this stand-in was started."""
        mean = sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None
        return {
            "version": VERSION,
            "model_path": self.model_path,
            "revision": self.revision,
            "internal_states": [{"avg_spec_accept_length": mean}],
            "speculative_algorithm": self.algorithm,
            "speculative_num_steps": self.num_steps,
            "speculative_eagle_topk": self.topk,
            "speculative_num_draft_tokens": self.draft_tokens,
            "max_running_requests": self.max_running_requests,
            "enable_return_hidden_states": True,
            "enable_return_aux_hidden_states": self.aux_layer_ids is not None,
            "return_aux_hidden_state_layer_ids": self.aux_layer_ids,
            # an aux server's resolved args, as 0.5.23 reports them: speculative_algorithm reset to None
            "aux_hidden_state_capture": "eagle3" if self.aux_layer_ids is not None else None,
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
        }


class RequestCounters:
    """What SGLang 0.5.23's TokenizerMetricsCollector.observe_one_finished_request counts for each finished
    request (python/sglang/srt/observability/metrics_collector.py): prompt and completion tokens, the
    request, and its verify passes (meta_info spec_verify_ct) when it was decoded speculatively."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prompt_tokens = self.generation_tokens = self.requests = self.verify_calls = 0

    def finished(self, prompt_tokens: int, generation_tokens: int, verify_calls: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self.requests += 1
            self.verify_calls += verify_calls

    def exposition(self, model_name: str) -> str:
        """The counters as SGLang's /metrics writes them: Prometheus' text format, SGLang's names and
        labels (model_name; is_streaming on the token and request counters). A labelled counter has no
        sample until it is first counted, as with prometheus_client."""
        with self.lock:
            counts = (self.prompt_tokens, self.generation_tokens, self.requests, self.verify_calls)
        streaming = f'{{model_name="{model_name}",is_streaming="false"}}'
        rows = [
            ("prompt_tokens_total", "Number of prefill tokens processed.", streaming, counts[0]),
            ("generation_tokens_total", "Number of generation tokens processed.", streaming, counts[1]),
            ("num_requests_total", "Number of requests processed.", streaming, counts[2]),
            (
                "spec_verify_calls_total",
                "Number of speculative decoding verification calls.",
                f'{{model_name="{model_name}"}}',
                counts[3],
            ),
        ]
        lines = []
        for name, help_text, labels, value in rows:
            lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} counter"]
            if value:
                lines.append(f"sglang:{name}{labels} {float(value)}")
        return "\n".join(lines) + "\n"


def make_handler(backend: StandinBackend, health_check: HealthCheck | None = None):
    health = health_check or HealthCheck.from_environment(backend, dict(os.environ))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, payload: Any) -> None:
            send_json(self, status, orjson.dumps(payload))

        def do_GET(self) -> None:
            if self.path in ("/health", "/health_generate"):
                status = health.status(self.path)
                self._send(status, {} if status == 200 else {"error": {"message": "health check failed"}})
            elif self.path == "/server_info":
                self._send(200, backend.server_info())
            elif self.path == "/get_server_info":  # as 0.5.23: served, with a warning at each call
                print(GET_SERVER_INFO_DEPRECATED, file=sys.stderr, flush=True)
                self._send(200, backend.server_info())
            elif self.path == "/metrics" and backend.enable_metrics:
                body = backend.counters.exposition(backend.model_path).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            if self.path != "/generate":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            try:
                request = orjson.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                ids = request.get("input_ids")
                if ids is None and "text" in request:
                    ids = backend.tokenizer(request["text"], add_special_tokens=False)["input_ids"]
                if backend.synthetic is not None and request.get("return_hidden_states"):
                    eos = int(backend.tokenizer.eos_token_id)
                    send_json_chunks(self, 200, backend.synthetic.response(request, ids, eos))
                    backend.last_received = time.time()
                elif ids and isinstance(ids[0], list):
                    self._send(200, [backend.generate_one(request, i) for i in ids])
                else:
                    self._send(200, backend.generate_one(request, ids))
            except (ValueError, TypeError, KeyError) as err:
                self._send(400, {"error": {"message": f"bad request: {err}"}})

    return Handler


def serve(backend: StandinBackend, port: int = 0) -> ThreadingHTTPServer:
    """Start serving on 127.0.0.1 in a background thread; returns the server (server_port, shutdown())."""
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(backend))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def listen_address(host: str) -> str:
    """Where a server asked to listen on `host` listens: the stand-in never leaves this machine's loopback.
    In a pod of the local cluster (harness.cluster) a wildcard host is the pod's own loopback address
    (DRAFTER_LOCAL_POD_IP, its network namespace there); anywhere else 127.0.0.1."""
    pod_ip = os.environ.get("DRAFTER_LOCAL_POD_IP", "")
    try:
        loopback = ipaddress.ip_address(pod_ip).is_loopback
    except ValueError:
        loopback = False
    return pod_ip if host in ("0.0.0.0", "::") and loopback else "127.0.0.1"


SPECULATIVE_MAX_RUNNING_REQUESTS = 48  # arg_groups/speculative_hook.py:1086-1095 (EAGLE), 1294-1303 (NGRAM)


def resolved_max_running_requests(given: int | None, algorithm: str | None) -> int | None:
    """--max-running-requests as SGLang 0.5.23 resolves it: as given; unset, 48 for a speculative server
    (with its warning), and for a plain one what its KV pool holds, which the stand-in does not bound."""
    if given is not None:
        if given < 1:
            raise SystemExit(f"--max-running-requests {given}: not a count of requests")
        return given
    if algorithm is None:
        return None
    print(
        "Max running requests is reset to 48 for speculative decoding. You can override this by explicitly "
        "setting --max-running-requests.",
        flush=True,
    )
    return SPECULATIVE_MAX_RUNNING_REQUESTS


def ngram_launch(argv: list[str]) -> NgramLaunch:
    """An NGRAM server's flags as SGLang 0.5.23 runs them; SystemExit naming every reason it would refuse
    them (pipeline.sglang_ngram_rules), before anything is loaded, as SGLang fails at startup."""
    launch = launch_from_args(argv)
    problems = refusals(launch)
    if problems:
        raise SystemExit("SGLang 0.5.23 would not start this NGRAM server:\n  - " + "\n  - ".join(problems))
    return launch


def _sampled(params: dict[str, Any]) -> Sampling | None:
    """A request's sampling: None when greedy (temperature 0), as SGLang treats it."""
    temperature = float(params.get("temperature", 1.0))
    if temperature <= 0:
        return None
    top_k = int(params.get("top_k", -1))
    return Sampling(temperature, float(params.get("top_p", 1.0)), top_k if top_k > 0 else 0)


def _truncated_sampling(params: dict[str, Any]) -> Sampling | None:
    """The request's sampling when it truncates the distribution (top_p < 1 or top_k > 0), which the plain
    batcher does not do."""
    sampling = _sampled(params)
    return sampling if sampling is not None and (sampling.top_p < 1 or sampling.top_k) else None


def aux_capture_refusal(
    enabled: bool, layer_ids: list[int] | None, algorithm: str | None, draft_path: str | None
) -> str | None:
    """Why SGLang 0.5.23 refuses these aux-capture flags at argument resolution, or None
    (srt/arg_groups/validation_hook.py:697-747, the real server run on this machine: docs/BENCHMARKS.md).
    0.5.23 also names DFLASH and DSPARK conventions; the stand-in captures EAGLE3's only."""
    if not enabled:
        if layer_ids is not None:
            return "--return-aux-hidden-state-layer-ids requires --enable-return-aux-hidden-states."
        return None
    if algorithm != "EAGLE3":
        return (
            "--enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3, DFLASH or DSPARK "
            f"to name the capture convention, got {algorithm!r}."
        )
    if draft_path is not None:
        return (
            "--enable-return-aux-hidden-states captures without a draft; drop --speculative-draft-model-path."
        )
    if layer_ids is not None:
        if not layer_ids:
            return "--return-aux-hidden-state-layer-ids must not be empty."
        if any(layer < 0 for layer in layer_ids):
            return f"--return-aux-hidden-state-layer-ids must be non-negative, got {layer_ids}."
        if len(set(layer_ids)) != len(layer_ids):
            return f"--return-aux-hidden-state-layer-ids must not repeat a layer, got {layer_ids}."
        if len(layer_ids) != 3:
            return f"the stand-in captures three layers (EAGLE3's), got {layer_ids}"
    return None


def main() -> None:
    """Accepts the SGLang launch flags the pipeline uses (others are ignored, as a stand-in should)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", "--model-dir", dest="model_path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the code the model directory ships (SGLang's flag of the same name)",
    )
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--aux-layer-ids",
        type=int,
        nargs=3,
        help="the stand-in's shorthand for a capture server of these SGLang ids (the three flags below)",
    )
    parser.add_argument(
        "--return-aux-hidden-state-layer-ids", dest="return_aux_layer_ids", type=int, nargs="+"
    )
    parser.add_argument("--revision", help="the model's revision (SGLang reports it in its server info)")
    parser.add_argument("--enable-metrics", action="store_true", help="serve /metrics, as SGLang does")
    parser.add_argument("--speculative-algorithm", choices=["NGRAM", "EAGLE3"])
    parser.add_argument("--speculative-draft-model-path")
    parser.add_argument("--speculative-num-steps", type=int, default=3)
    parser.add_argument("--speculative-eagle-topk", type=int, default=1)
    parser.add_argument("--speculative-num-draft-tokens", type=int)
    parser.add_argument(
        "--max-running-requests",
        type=int,
        help="requests run at once, the rest queued; unset with NGRAM or EAGLE3: 48, as in SGLang 0.5.23",
    )
    parser.add_argument(
        "--enable-return-aux-hidden-states",
        action="store_true",
        help="a capture server: with EAGLE3 and no draft path, SGLang 0.5.23 returns aux states",
    )
    parser.add_argument(
        "--synthetic-hidden-size",
        type=int,
        help="capture requests get synthetic states of this hidden size (harness.synthetic_states)",
    )
    args, _ = parser.parse_known_args()
    health_generation_enabled(dict(os.environ))  # a value SGLang cannot read stops it before loading
    clock = DeviceClock.from_environment(os.environ)
    if clock is not None:
        print(
            f"stand-in: modelled device clock, {clock.forward_s * 1000:g} ms a target forward, "
            f"{clock.draft_s * 1000:g} ms a draft step ({DEVICE_CLOCK_ENV})",
            flush=True,
        )
    algorithm = args.speculative_algorithm
    if args.aux_layer_ids is None:
        refusal = aux_capture_refusal(
            args.enable_return_aux_hidden_states,
            args.return_aux_layer_ids,
            algorithm,
            args.speculative_draft_model_path,
        )
        if refusal:
            raise SystemExit(refusal)  # as SGLang's argument resolution does, before loading anything
        args.aux_layer_ids = args.return_aux_layer_ids
    if args.enable_return_aux_hidden_states:
        # a capture server decodes nothing speculatively: EAGLE3 there only names the capture convention
        algorithm = None
        if args.aux_layer_ids is None:  # SGLang's default layers, outputs [1, N//2 - 1, N - 4]: the same
            # flag ids on every model family (a first id of 1 is shifted by models/deepseek_v2.py too)
            from pipeline.config import default_aux_layer_ids
            from pipeline.engines.target import text_config

            args.aux_layer_ids = default_aux_layer_ids(
                int(text_config(Path(args.model_path))["num_hidden_layers"])
            )
    ngram = ngram_launch(sys.argv[1:]) if algorithm == "NGRAM" else NgramLaunch()
    address = listen_address(args.host)
    if args.host != address:  # a manifest's --host 0.0.0.0
        print(f"stand-in: --host {args.host} asked; listening on {address} only", flush=True)
    from pipeline.engines.sglang_draft_checks import DraftModelRefused

    try:
        backend = StandinBackend(
            Path(args.model_path),
            args.aux_layer_ids,
            algorithm,
            Path(args.speculative_draft_model_path) if args.speculative_draft_model_path else None,
            args.speculative_num_steps,
            args.speculative_eagle_topk,
            ngram.draft_tokens if algorithm == "NGRAM" else args.speculative_num_draft_tokens,
            args.trust_remote_code,
            ngram_max_match=ngram.max_trie_depth - 1,
            synthetic_hidden_size=args.synthetic_hidden_size,
            revision=args.revision,
            enable_metrics=args.enable_metrics,
            max_running_requests=resolved_max_running_requests(args.max_running_requests, algorithm),
            device_clock=clock,
        )
    except DraftModelRefused as refused:  # as SGLang does: no server, every reason on stderr, exit status 1
        raise SystemExit(str(refused)) from None
    server = ThreadingHTTPServer((address, args.port), make_handler(backend))
    print(f"stand-in SGLang server on http://{address}:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
