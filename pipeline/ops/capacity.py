"""Capacity plan for a data + training run: storage per capture encoding, GPU-hours and wall time of
generation, capture and training for given replica counts, and the S3 bill.

Rates come from the config's `plan` section (stated assumptions) or are measured from a finished
pilot run (`measured_rates`): token counts per conversation from its dataset, generation and capture
throughput from the timing every shard marker records, training throughput from the trainer's result.
Bytes per token are measured by writing a synthetic shard of the target's shape with the real writer.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import PlanAssumptions, RunConfig
from pipeline.drafter.mla import MLA_KEYS, mla_shape_of_target
from pipeline.drafter.sizes import ARCHITECTURES, DraftShape, architecture_costs
from pipeline.engines import engine_servers

TB = 1e12
GB = 1e9
ENCODINGS = [("fp8", ("topk",)), ("fp8", ("last_hidden",)), ("bf16", ("topk",)), ("bf16", ("last_hidden",))]


class PlanError(ValueError):
    pass


@dataclass
class TargetShape:
    hidden_size: int
    vocab_size: int
    gpus_per_server: int


def target_shape(config: RunConfig) -> TargetShape:
    """The target's dimensions from the config (a tiny target's recipe, else the declared sizes)."""
    target = config.target
    if target.source == "tiny" and target.tiny is not None:
        return TargetShape(target.tiny.hidden_size, target.tiny.vocab_size, target.tensor_parallel)
    hidden_size, vocab_size = target.hidden_size, target.vocab_size
    if (hidden_size is None or vocab_size is None) and target.model_path:
        if (Path(target.model_path) / "config.json").is_file():  # the model directory at hand
            from pipeline.engines.target import text_config

            declared = text_config(Path(target.model_path))
            hidden_size = hidden_size or declared.get("hidden_size")
            vocab_size = vocab_size or declared.get("vocab_size")
    if hidden_size is None or vocab_size is None:
        raise PlanError(
            "planning needs target.hidden_size and target.vocab_size in the config (or target.model_path "
            "holding its config.json)"
        )
    return TargetShape(int(hidden_size), int(vocab_size), target.tensor_parallel)


def _target_attention(config: RunConfig) -> dict[str, Any]:
    """What the plan knows of the target's attention and MLP: its config.json where the model directory is
    at hand, else the tiny recipe, else the sizes the config declares (target.mla)."""
    target = config.target
    if target.source == "tiny" and target.tiny is not None:
        tiny = target.tiny
        known: dict[str, Any] = {
            "num_attention_heads": tiny.num_heads,
            "intermediate_size": tiny.intermediate_size,
        }
        if tiny.deepseek_v3 is not None:
            known.update({key: getattr(tiny.deepseek_v3, key) for key in MLA_KEYS})
        return known
    if target.model_path and (Path(target.model_path) / "config.json").is_file():
        from pipeline.engines.target import text_config

        return text_config(Path(target.model_path))
    return target.mla.model_dump() if target.mla is not None else {}


def draft_shape(config: RunConfig) -> DraftShape:
    """The drafter's sizes as training would build them (pipeline.training.worker.drafter_arch): drafter.*
    settings first, else the target's own."""
    shape, settings = target_shape(config), config.drafter
    known = _target_attention(config)
    heads = settings.num_heads or known.get("num_attention_heads")
    intermediate = settings.intermediate_size or known.get("intermediate_size")
    if heads is None or intermediate is None:
        missing = "drafter.num_heads" if heads is None else "drafter.intermediate_size"
        raise PlanError(
            f"planning the drafter's training needs {missing} (or the target's config.json at "
            "target.model_path)"
        )
    mla = None
    if all(known.get(key) for key in MLA_KEYS):  # q_lora_rank null too: no MLA drafter (SGLang refuses it)
        mla = mla_shape_of_target(known, "the target's config")
    return DraftShape(
        hidden_size=shape.hidden_size,
        num_heads=int(heads),
        num_kv_heads=int(settings.num_kv_heads or known.get("num_key_value_heads") or heads),
        head_dim=int(settings.head_dim or known.get("head_dim") or shape.hidden_size // int(heads)),
        intermediate_size=int(intermediate),
        draft_vocab_size=settings.draft_vocab_size,
        mla=mla,
    )


def architectures(config: RunConfig, assumptions: PlanAssumptions, context_tokens: float) -> dict[str, Any]:
    """Each draft architecture at the target's width: parameters, exported bytes, training FLOPs per token
    and the tok/s one GPU trains at the stated rate (train_gpu_peak_flop_s x train_mfu)."""
    shape = draft_shape(config)
    gpu_flop_s = assumptions.train_gpu_peak_flop_s * assumptions.train_mfu
    width = 2 if config.drafter.export_dtype == "bfloat16" else 4
    costs = architecture_costs(shape, config.train.ttt_steps, context_tokens, width, gpu_flop_s)
    chosen = config.drafter.architecture
    if costs[chosen]["train_tok_s_per_gpu"] is None:
        raise PlanError(
            f"drafter.architecture {chosen} needs a DeepSeek-family target's MLA sizes: the target's "
            "config.json or target.mla"
        )
    return {
        "chosen": chosen,
        "costs": costs,
        "gpu_flop_s": gpu_flop_s,
        "ttt_steps": config.train.ttt_steps,
        "context_tokens": round(context_tokens, 1),
        "export_dtype": config.drafter.export_dtype,
        "hidden_size": shape.hidden_size,
        "draft_vocab_size": shape.draft_vocab_size,
    }


@functools.lru_cache(maxsize=64)
def shard_bytes_per_token(
    hidden_size: int, encoding: str, teacher: tuple[str, ...], topk: int, sample_tokens: int = 256
) -> float:
    """Bytes one captured token costs in a shard: two synthetic samples of different lengths written
    by the real shard writer; the slope is the per-token cost (per-sample headers cancel out)."""
    import torch

    from pipeline.data.capture_shards import CaptureSample
    from pipeline.data.shard_writer import write_shard

    def size(tokens: int) -> int:
        generator = torch.Generator().manual_seed(tokens)
        logprobs = torch.log_softmax(torch.randn(tokens, 4 * topk, generator=generator), -1).topk(topk, -1)
        sample = CaptureSample(
            "plan",
            torch.randint(0, 1000, (tokens,), generator=generator),
            torch.ones(tokens, dtype=torch.uint8),
            torch.randn(tokens, 3 * hidden_size, generator=generator),
            torch.randn(tokens, hidden_size, generator=generator) if "last_hidden" in teacher else None,
            logprobs.indices if "topk" in teacher else None,
            logprobs.values if "topk" in teacher else None,
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "plan.safetensors"
            write_shard([sample], path, encoding)
            return path.stat().st_size

    short = max(8, sample_tokens // 4)
    return (size(sample_tokens) - size(short)) / (sample_tokens - short)


def measured_rates(config: RunConfig, run_id: str) -> dict[str, Any]:
    """Per-conversation tokens and throughputs of a finished pilot run (its train stage and the dataset
    it trained on), as PlanAssumptions fields plus where each came from."""
    from pipeline import layout
    from pipeline.manifest import read_listed, read_manifest
    from pipeline.records import read_dataset
    from pipeline.stages.capture import finished_marker, marker_parts
    from pipeline.stages.generate import finished_shard
    from pipeline.storage import open_store

    store = open_store(config.storage)
    train_prefix = layout.run_stage_prefix(run_id, "train")
    train = read_manifest(store, train_prefix, kind="train")
    dataset = read_dataset(store, train["dataset"])
    capture_prefix = store.key_for(dataset.captures[0])
    capture = read_manifest(store, capture_prefix, kind="capture")
    responses_prefix = store.key_for(capture["responses"])
    responses = read_manifest(store, responses_prefix, kind="responses")
    totals = dataset.totals["train"]
    if not totals.samples:
        raise PlanError(f"run {run_id}'s dataset has no training samples to measure")
    rates: dict[str, Any] = {
        "prompt_tokens_mean": (totals.tokens - totals.assistant_tokens) / totals.samples,
        "response_tokens_mean": totals.assistant_tokens / totals.samples,
    }
    generate_rates, capture_rates = [], []
    for shard in responses["shards"]:
        marker = finished_marker(store, capture_prefix, shard, capture["contract"]) or {}
        parts = [part["shard"] for part in marker_parts(marker)] if marker else []
        tokens, assistant_tokens = (
            sum(part[key] for part in parts) for key in ("tokens", "assistant_tokens")
        )
        generated = finished_shard(store, responses_prefix, shard["name"]) or {}
        timing = generated.get("timing")
        if parts and timing and timing["seconds"] > 0 and not generated["counts"].get("skipped"):
            generate_rates.append(assistant_tokens / timing["seconds"] / timing["servers"])
        timing = marker.get("timing")
        if parts and timing and timing["seconds"] > 0:
            capture_rates.append(tokens / timing["seconds"] / timing["servers"])
    if generate_rates:
        rates["generate_tok_s_per_server"] = statistics.median(generate_rates)
    if capture_rates:
        rates["capture_tok_s_per_server"] = statistics.median(capture_rates)
    result = json.loads(read_listed(store, train_prefix, train, "train_result.json"))
    steps, seconds = result.get("steps_this_attempt"), result.get("seconds_this_attempt")
    if steps and seconds and result.get("steps_per_epoch"):
        epochs = steps / result["steps_per_epoch"]
        rates["train_tok_s_per_gpu"] = totals.tokens * epochs / seconds / result["world_size"]
    return {
        "rates": rates,
        "source": {
            "run_id": run_id,
            "dataset": train["dataset"],
            "capture_engine": capture["contract"]["engine"]["name"],
            "generate_shards_timed": len(generate_rates),
            "capture_shards_timed": len(capture_rates),
        },
    }


def plan(
    config: RunConfig,
    samples: int,
    generate_servers: int | None = None,
    capture_servers: int | None = None,
    train_nodes: int | None = None,
    measured: dict[str, Any] | None = None,
    transport: dict[str, Any] | None = None,
    compare: bool = True,
) -> dict[str, Any]:
    """The capacity plan as a dict (numbers rounded for reading).

    measured: measured_rates() of a pilot run; transport: transport_rates() of a benchmark's figures.
    Both replace the config's assumptions where they measured something."""
    if samples < 1:
        raise PlanError("--samples must be at least 1")
    shape = target_shape(config)
    measured = _same_capture_path(measured, config)
    measured_rates_ = {**(measured or {}).get("rates", {}), **(transport or {}).get("rates", {})}
    assumptions = config.plan.model_copy(update=measured_rates_)
    servers = {
        "generate": generate_servers or engine_servers(config.generate),
        "capture": capture_servers or engine_servers(config.capture),
    }
    nodes = train_nodes or (config.train.nodes if config.train.nodes > 1 else assumptions.train_nodes)
    train_gpus = nodes * config.train.nproc

    response_tokens = min(
        assumptions.response_tokens(), config.generate.max_new_tokens * assumptions.assistant_turns
    )
    tokens_per_sample = min(assumptions.prompt_tokens_mean + response_tokens, config.capture.max_length)
    captured_tokens = samples * tokens_per_sample
    train_tokens = captured_tokens * (1 - config.prompts.eval_fraction)
    generated_tokens = samples * response_tokens

    storage = _storage(config, shape, captured_tokens, assumptions)
    stored_bytes_per_token = storage["encodings"][storage["chosen"]]["bytes_per_token"]
    workers = config.capture.sglang.concurrency if config.capture.sglang else assumptions.capture_client_cores
    paths = capture_paths(assumptions, servers["capture"], stored_bytes_per_token, workers)
    for path in paths.values():  # the capture stage's cost on each path, with the plan's servers
        wall_hours = captured_tokens / (path["tok_s_per_server"] * servers["capture"]) / 3600
        path["wall_hours"] = round(wall_hours, 1)
        path["gpu_hours"] = round(wall_hours * servers["capture"] * shape.gpus_per_server, 1)
    capture_path = paths["http"] if config.capture.engine == "sglang" else paths["in_process"]
    capture_rate, capture_bound = capture_path["tok_s_per_server"], capture_path["bottleneck"]
    if assumptions.capture_tok_s_per_server is not None:  # an end-to-end rate, measured or set
        capture_rate = assumptions.capture_tok_s_per_server
        capture_bound = f"its end-to-end rate ({_source('capture_tok_s_per_server', measured, transport)})"
    drafts = architectures(config, assumptions, tokens_per_sample)
    train_rate = assumptions.train_tok_s_per_gpu  # a pilot run's, or the config's
    if train_rate is None:  # neither: the architecture's FLOPs at the stated GPU rate
        train_rate = float(drafts["costs"][drafts["chosen"]]["train_tok_s_per_gpu"])
        assumptions = assumptions.model_copy(update={"train_tok_s_per_gpu": train_rate})
    train_bound = _train_bottleneck(assumptions, train_rate * train_gpus, nodes, stored_bytes_per_token)
    stages = {
        "generate": _gpu_stage(
            generated_tokens,
            assumptions.generate_tok_s_per_server * servers["generate"],
            servers["generate"] * shape.gpus_per_server,
            f"{servers['generate']} SGLang servers",
            "GPU (decoding)",
        ),
        "capture": _gpu_stage(
            captured_tokens,
            capture_rate * servers["capture"],
            servers["capture"] * shape.gpus_per_server,
            f"{servers['capture']} SGLang servers, {capture_path['name']}",
            capture_bound,
        ),
        "train": _gpu_stage(
            train_tokens * config.train.epochs,
            train_bound["tok_s"],
            train_gpus,
            f"{nodes} node(s) x {config.train.nproc} GPUs, {config.train.epochs} epochs",
            train_bound["bottleneck"],
        ),
    }
    gpu_hours = sum(stage["gpu_hours"] for stage in stages.values())
    fleets = _fleets(stages, servers, shape.gpus_per_server, assumptions)
    chosen = storage["encodings"][storage["chosen"]]
    s3 = _s3_cost(chosen["bytes"], storage["text_bytes"], config, assumptions, samples)
    rate_keys = ("generate_tok_s_per_server", "capture_tok_s_per_server", "train_tok_s_per_gpu")
    return {
        "target": config.target.name,
        "samples": samples,
        "tokens": {
            "prompt_mean": round(assumptions.prompt_tokens_mean, 1),
            "response_mean": round(response_tokens, 1),
            "per_sample": round(tokens_per_sample, 1),
            "captured": round(captured_tokens),
            "generated": round(generated_tokens),
            "trained_per_epoch": round(train_tokens),
        },
        "rates": {
            "generate_tok_s_per_server": round(assumptions.generate_tok_s_per_server, 2),
            "capture_tok_s_per_server": round(capture_rate, 2),
            "train_tok_s_per_gpu": round(train_rate, 2),
        },
        "rates_source": {
            key: _source(key, measured, transport, config)
            for key in ("prompt_tokens_mean", "response_tokens_mean", *rate_keys, *TRANSPORT_KEYS)
        },
        "measured_from": (measured or {}).get("source"),
        "transport_from": (transport or {}).get("source"),
        "capture_paths": paths,
        "servers": servers,
        "train_nodes": nodes,
        "storage": storage,
        "stages": stages,
        "fleets": fleets,
        "total": {
            "gpu_hours": round(gpu_hours, 1),
            "gpu_usd": round(gpu_hours * assumptions.gpu_hour_usd),
            "wall_hours": round(sum(stage["wall_hours"] for stage in stages.values()), 1),
            "s3_usd": s3,
            "usd": round(gpu_hours * assumptions.gpu_hour_usd + s3["total_usd"]),
        },
        "architectures": drafts,
        "assumptions": assumptions.model_dump(),
        "torchspec": (
            _torchspec_line(config, servers, train_nodes, measured, transport) if compare else None
        ),
    }


def _torchspec_line(
    config: RunConfig,
    servers: dict[str, int],
    train_nodes: int | None,
    measured: dict[str, Any] | None,
    transport: dict[str, Any] | None,
) -> dict[str, Any]:
    """This plan at TorchSpec's published Kimi-K2.5 scale (600K samples), beside their figures."""
    same = plan(
        config,
        TORCHSPEC_KIMI["samples"],
        servers["generate"],
        servers["capture"],
        train_nodes,
        measured,
        transport,
        compare=False,
    )
    return {
        "published": TORCHSPEC_KIMI,
        "this_plan": {
            "tokens": same["tokens"]["captured"],
            "gpu_hours": same["total"]["gpu_hours"],
            "train_gpu_hours": same["stages"]["train"]["gpu_hours"],
            "train_tok_s_per_gpu": same["rates"]["train_tok_s_per_gpu"],
        },
    }


def _same_capture_path(measured: dict[str, Any] | None, config: RunConfig) -> dict[str, Any] | None:
    """A pilot's rates without its capture rate when the pilot captured another way than this config does
    (HTTP JSON and in-process capture differ by an order of magnitude)."""
    if measured is None:
        return None
    engine = str(measured.get("source", {}).get("capture_engine", config.capture.engine))
    if engine.split("-")[0] == config.capture.engine or "capture_tok_s_per_server" not in measured["rates"]:
        return measured
    rates = {k: v for k, v in measured["rates"].items() if k != "capture_tok_s_per_server"}
    return {**measured, "rates": rates, "source": {**measured["source"], "capture_rate_not_used": engine}}


def _source(
    key: str,
    measured: dict[str, Any] | None,
    transport: dict[str, Any] | None,
    config: RunConfig | None = None,
) -> str:
    if key in (measured or {}).get("rates", {}):
        return "measured"
    if key in (transport or {}).get("rates", {}):
        return "benchmarked"
    if (
        key == "capture_tok_s_per_server"
        and config is not None
        and config.plan.capture_tok_s_per_server is None
    ):
        return "modelled"
    if key == "train_tok_s_per_gpu" and config is not None and config.plan.train_tok_s_per_gpu is None:
        return "FLOPs per token at the stated GPU rate"
    return "configured"


# TorchSpec's published Kimi-K2.5 EAGLE-3 drafter, the public anchor for what a run of this size costs
TORCHSPEC_KIMI: dict[str, int] = {"samples": 600_000, "tokens": 6_000_000_000, "h200_gpu_hours": 1500}
TRANSPORT_KEYS = (
    "transport_tok_s_per_server",
    "client_parse_tok_s_per_core",
    "shard_encode_tok_s_per_core",
)


def transport_rates(figures: dict[str, Any], config: RunConfig, source: str) -> dict[str, Any]:
    """bench_capture_transport.py's figures (its --json file) as PlanAssumptions fields; refused when
    they were measured at a width other than the target's aux width (3 x hidden)."""
    width = 3 * target_shape(config).hidden_size
    missing = [
        k for k in ("width", "capture_tok_s_ceiling_per_server", "client_tok_s_per_core") if k not in figures
    ]
    if missing:
        raise PlanError(f"{source} is not bench_capture_transport.py's --json output: no {missing}")
    if int(figures["width"]) != width:
        raise PlanError(
            f"{source} measured a width of {figures['width']} floats per token; {config.target.name}'s aux "
            f"states are {width} wide: rerun the benchmark with --width {width}"
        )
    rates = {
        "transport_tok_s_per_server": float(figures["capture_tok_s_ceiling_per_server"]),
        "client_parse_tok_s_per_core": float(figures["client_tok_s_per_core"]),
    }
    if "shard_encode_tok_s_per_core" in figures:
        rates["shard_encode_tok_s_per_core"] = float(figures["shard_encode_tok_s_per_core"])
    return {"rates": rates, "source": {"file": source, "width": width}}


def capture_paths(
    assumptions: PlanAssumptions, servers: int, stored_bytes_per_token: float, worker_processes: int
) -> dict[str, Any]:
    """Both ways to capture, per server: over SGLang's HTTP JSON (capture.engine sglang) and in-process
    (the engine on the capture node writes shards itself). Each names what binds it and the fleet that
    keeps the servers, not the clients, the limit."""
    return {
        "http": _http_path(assumptions, servers, stored_bytes_per_token, worker_processes),
        "in_process": _in_process_path(assumptions, stored_bytes_per_token),
    }


def _per_core(*rates: float) -> float:
    """Tokens/s one core does when each token takes every one of these steps in turn."""
    return 1 / sum(1 / rate for rate in rates)


def _http_path(
    assumptions: PlanAssumptions, servers: int, stored_bytes_per_token: float, worker_processes: int
) -> dict[str, Any]:
    """A capture client (one capture task's pod) parses responses in `worker_processes` processes, at most
    one per core, and encodes shards beside them; clients are sized so neither binds unless set."""
    a = assumptions
    per_server = min(a.capture_gpu_tok_s_per_server, a.transport_tok_s_per_server)
    parse = a.client_parse_tok_s_per_core * min(a.capture_client_cores, worker_processes)
    encode = a.shard_encode_tok_s_per_core * a.capture_client_cores
    per_client = min(parse, encode)
    s3_per_client = a.s3_write_mb_s * 1e6 / stored_bytes_per_token
    needed_clients = max(
        math.ceil(servers * per_server / per_client), math.ceil(servers * per_server / s3_per_client)
    )
    clients = a.capture_clients or needed_clients
    limits = {
        "GPU": a.capture_gpu_tok_s_per_server,
        "transport": a.transport_tok_s_per_server,
        "client parse": clients * per_client / servers,
        "S3 bandwidth": clients * s3_per_client / servers,
    }
    return {
        **_bound_by("HTTP JSON", limits, a.capture_gpu_tok_s_per_server),
        "client_tok_s": round(per_client, 1),
        "client_worker_processes": min(a.capture_client_cores, worker_processes),
        "clients": clients,
        "clients_needed": needed_clients,
    }


def _in_process_path(assumptions: PlanAssumptions, stored_bytes_per_token: float) -> dict[str, Any]:
    a = assumptions
    limits = {
        "GPU": a.capture_gpu_tok_s_per_server,
        "shard encoding": a.capture_node_spare_cores * a.shard_encode_tok_s_per_core,
        "S3 bandwidth": a.s3_write_mb_s * 1e6 / stored_bytes_per_token,
    }
    return {
        **_bound_by("in-process", limits, a.capture_gpu_tok_s_per_server),
        "encode_cores_for_gpu_rate": math.ceil(
            a.capture_gpu_tok_s_per_server / a.shard_encode_tok_s_per_core
        ),
    }


def _bound_by(name: str, limits: dict[str, float], gpu_rate: float) -> dict[str, Any]:
    """A capture path's rate per server: the lowest of its limits, named, and how busy that keeps the GPUs."""
    bottleneck = min(limits, key=limits.__getitem__)
    return {
        "name": name,
        "tok_s_per_server": round(limits[bottleneck], 1),
        "bottleneck": bottleneck,
        "limits_tok_s_per_server": {k: round(v, 1) for k, v in limits.items()},
        "gpu_bound": bottleneck == "GPU",
        "gpu_utilization": round(limits[bottleneck] / gpu_rate, 4),
    }


def _train_bottleneck(
    assumptions: PlanAssumptions, gpus_tok_s: float, nodes: int, stored_bytes_per_token: float
) -> dict[str, Any]:
    """Training's rate: its GPUs' (gpus_tok_s), unless reading the captures from S3 is slower."""
    limits = {
        "training": gpus_tok_s,
        "S3 bandwidth": nodes * assumptions.s3_read_mb_s_per_node * 1e6 / stored_bytes_per_token,
    }
    bottleneck = min(limits, key=lambda name: limits[name])
    return {"tok_s": limits[bottleneck], "bottleneck": bottleneck}


WEEK_HOURS = 7 * 24


def _fleets(
    stages: dict[str, Any], servers: dict[str, int], gpus_per_server: int, assumptions: PlanAssumptions
) -> dict[str, Any]:
    """The SGLang fleets exist only around their stage (pipeline.ops.fleets): each is up for its stage's wall
    time plus the servers' load time. Kept up around the clock instead, they would hold their GPUs idle
    between runs: `idle_gpu_hours_per_week` is that cost, which scaling to 0 avoids."""
    load_hours = assumptions.server_load_minutes / 60
    rows = {}
    for name in ("generate", "capture"):
        gpus = servers[name] * gpus_per_server
        rows[name] = {
            "gpus": gpus,
            "up_hours": round(stages[name]["wall_hours"] + load_hours, 1),
            "load_gpu_hours": round(load_hours * gpus, 1),
        }
    gpus = sum(row["gpus"] for row in rows.values())
    up_gpu_hours = sum(row["gpus"] * row["up_hours"] for row in rows.values())
    return {
        "servers": rows,
        "load_gpu_hours": round(sum(row["load_gpu_hours"] for row in rows.values()), 1),
        "always_on_gpus": gpus,
        "always_on_gpu_hours_per_week": gpus * WEEK_HOURS,
        "always_on_usd_per_week": round(gpus * WEEK_HOURS * assumptions.gpu_hour_usd),
        "idle_gpu_hours_per_week": round(max(gpus * WEEK_HOURS - up_gpu_hours, 0.0), 1),
    }


def _gpu_stage(
    tokens: float, tokens_per_second: float, gpus: int, layout: str, bottleneck: str
) -> dict[str, Any]:
    wall_hours = tokens / tokens_per_second / 3600
    return {
        "tokens": round(tokens),
        "tok_s": round(tokens_per_second, 1),
        "gpus": gpus,
        "layout": layout,
        "bottleneck": bottleneck,
        "wall_hours": round(wall_hours, 2),
        "gpu_hours": round(wall_hours * gpus, 1),
    }


def _encoding_name(encoding: str, teacher) -> str:
    return f"{encoding}+{'+'.join(teacher)}"


def _storage(
    config: RunConfig, shape: TargetShape, captured_tokens: float, assumptions: PlanAssumptions
) -> dict:
    topk = config.capture.teacher_topk
    encodings = {}
    for encoding, teacher in ENCODINGS + [(config.capture.encoding, tuple(config.capture.teacher))]:
        name = _encoding_name(encoding, teacher)
        if name in encodings:
            continue
        per_token = shard_bytes_per_token(shape.hidden_size, encoding, teacher, topk)
        total = per_token * captured_tokens
        encodings[name] = {
            "bytes_per_token": round(per_token, 1),
            "bytes": round(total),
            "tb": round(total / TB, 2),
            "usd_per_month": round(total / GB * assumptions.s3_gb_month_usd),
        }
    plain = (3 + 1) * shape.hidden_size * 2  # 3 aux + the last hidden state in bf16, what other tools store
    text_bytes = captured_tokens * assumptions.text_bytes_per_token * 2  # prompts + responses JSONL
    return {
        "encodings": encodings,
        "chosen": _encoding_name(config.capture.encoding, config.capture.teacher),
        "plain_bf16_bytes_per_token": plain,
        "plain_bf16_tb": round(plain * captured_tokens / TB, 2),
        "text_bytes": round(text_bytes),
        "text_gb": round(text_bytes / GB, 1),
    }


def _s3_cost(
    capture_bytes: float, text_bytes: float, config: RunConfig, assumptions: PlanAssumptions, samples: int
) -> dict[str, Any]:
    part = config.storage.multipart_threshold_mb * 2**20
    shards = -(-samples // config.prompts.shard_size)
    puts = shards * (3 + max(1, capture_bytes / shards / part)) + 4 * shards  # text, capture parts, markers
    # training reads every capture shard once per epoch per node when the shard cache cannot hold it all
    gets = config.train.epochs * max(1, capture_bytes / part)
    storage_usd = (
        (capture_bytes + text_bytes) / GB * assumptions.s3_gb_month_usd * assumptions.retention_months
    )
    requests_usd = (
        puts / 1000 * assumptions.s3_put_per_1000_usd + gets / 1000 * assumptions.s3_get_per_1000_usd
    )
    return {
        "storage_usd": round(storage_usd),
        "requests_usd": round(requests_usd, 2),
        "put_requests": round(puts),
        "get_requests": round(gets),
        "total_usd": round(storage_usd + requests_usd),
    }


def _fleet_line(fleets: dict[str, Any], gpu_hour_usd: float) -> str:
    up = ", ".join(
        f"{name} {row['gpus']} GPUs up {row['up_hours']:,} h" for name, row in fleets["servers"].items()
    )
    return (
        f"SGLang fleets, scaled to 0 between runs: {up}, loading included ({fleets['load_gpu_hours']:,} "
        f"GPU-hours, not in the total); left up around the clock they would hold "
        f"{fleets['always_on_gpus']} GPUs: {fleets['always_on_gpu_hours_per_week']:,} GPU-hours "
        f"(${fleets['always_on_usd_per_week']:,}) a week, {fleets['idle_gpu_hours_per_week']:,} of them idle "
        "in a week with one such run"
    )


def _limits_text(path: dict[str, Any]) -> str:
    return ", ".join(f"{name} {rate:,.0f}" for name, rate in path["limits_tok_s_per_server"].items())


def _capture_path_lines(paths: dict[str, Any]) -> list[str]:
    http, local = paths["http"], paths["in_process"]
    configured = "" if http["clients"] == http["clients_needed"] else f" (configured: {http['clients']})"
    gpu_bound = (
        "yes"
        if http["gpu_bound"]
        else "no fleet of clients makes it so; each server's own JSON path caps it (the in-process "
        "engine below does not)"
    )
    return [
        "capture paths, tok/s per server (what binds each):",
        f"  HTTP JSON (capture.engine sglang): {http['tok_s_per_server']:,.0f}, bound by "
        f"{http['bottleneck']} ({_limits_text(http)}); GPUs busy {http['gpu_utilization']:.1%}; "
        f"this capture {http['wall_hours']:,} h wall, {http['gpu_hours']:,} GPU-hours",
        f"    clients: a capture task pod parses and encodes {http['client_tok_s']:,.0f} tok/s "
        f"({http['client_worker_processes']} worker processes): {http['clients_needed']} pod(s) keep up"
        f"{configured}",
        f"    GPU-bound: {gpu_bound}",
        f"  in-process (capture.engine inprocess): {local['tok_s_per_server']:,.0f}, bound by "
        f"{local['bottleneck']} ({_limits_text(local)}); GPUs busy {local['gpu_utilization']:.1%}; "
        f"this capture {local['wall_hours']:,} h wall, {local['gpu_hours']:,} GPU-hours",
        f"    {local['encode_cores_for_gpu_rate']} cores per server encode at the GPUs' rate; capture.engine "
        "inprocess, run on SGLang itself only on a CPU, one rank (docs/CAPACITY.md)",
    ]


def _torchspec_text(comparison: dict[str, Any]) -> str:
    published, ours = comparison["published"], comparison["this_plan"]
    return (
        f"beside TorchSpec's published Kimi-K2.5 drafter: {published['samples']:,} samples, "
        f"{published['tokens'] / 1e9:.1f}B tokens, {published['h200_gpu_hours']:,} H200 GPU-hours for the "
        f"whole job ({published['tokens'] / published['h200_gpu_hours'] / 3600:,.0f} tokens per GPU-second); "
        f"this plan at {published['samples']:,} "
        f"samples: {ours['tokens'] / 1e9:.1f}B tokens, {ours['gpu_hours']:,} GPU-hours "
        f"({ours['train_gpu_hours']:,} of them training at {ours['train_tok_s_per_gpu']:,} tok/s per GPU)"
    )


def format_plan(report: dict[str, Any]) -> str:
    """The plan as a readable text table."""
    lines = [
        f"capacity plan: {report['target']}, {report['samples']:,} conversations",
        f"tokens per conversation: prompt {report['tokens']['prompt_mean']:,} + response "
        f"{report['tokens']['response_mean']:,} -> {report['tokens']['per_sample']:,} captured; "
        f"{report['tokens']['captured']:,} captured in all",
        "",
        "storage (captures, per encoding):",
        f"  {'encoding':<24}{'bytes/token':>12}{'TB':>10}{'$/month':>10}",
    ]
    for name, row in report["storage"]["encodings"].items():
        mark = "  <- config" if name == report["storage"]["chosen"] else ""
        lines.append(
            f"  {name:<24}{row['bytes_per_token']:>12,.0f}{row['tb']:>10,.2f}"
            f"{row['usd_per_month']:>10,}{mark}"
        )
    lines.append(
        f"  {'plain bf16 (3 aux+last)':<24}{report['storage']['plain_bf16_bytes_per_token']:>12,}"
        f"{report['storage']['plain_bf16_tb']:>10,.2f}"
    )
    lines += [
        f"  prompts + responses JSONL: {report['storage']['text_gb']:,} GB",
        "",
        "compute:",
        f"  {'stage':<10}{'tokens':>16}{'tok/s':>12}{'GPUs':>6}{'wall h':>9}{'GPU h':>10}  layout",
    ]
    for name, stage in report["stages"].items():
        lines.append(
            f"  {name:<10}{stage['tokens']:>16,}{stage['tok_s']:>12,.0f}{stage['gpus']:>6}"
            f"{stage['wall_hours']:>9,.1f}{stage['gpu_hours']:>10,.1f}  {stage['layout']}; bound by "
            f"{stage['bottleneck']}"
        )
    total, s3 = report["total"], report["total"]["s3_usd"]
    lines += ["", *_architecture_lines(report["architectures"], report["assumptions"])]
    lines += [
        "",
        f"total: {total['gpu_hours']:,} GPU-hours (${total['gpu_usd']:,}), {total['wall_hours']:,} h wall "
        f"if the stages run one after another",
        f"S3: ${s3['storage_usd']:,} storage for {report['assumptions']['retention_months']:g} month(s) + "
        f"${s3['requests_usd']:,} requests "
        f"({s3['put_requests']:,} PUT, {s3['get_requests']:,} GET); all in: ${total['usd']:,}",
        _fleet_line(report["fleets"], report["assumptions"]["gpu_hour_usd"]),
        "",
        *_capture_path_lines(report["capture_paths"]),
        "",
        "rates: "
        + ", ".join(f"{k} {v:,} ({report['rates_source'][k]})" for k, v in report["rates"].items())
        + "; "
        + ", ".join(
            f"{k} {report['assumptions'][k]:,.1f} ({report['rates_source'][k]})" for k in TRANSPORT_KEYS
        ),
    ]
    if report["measured_from"]:
        lines.append(
            f"measured from run {report['measured_from']['run_id']} ({report['measured_from']['dataset']})"
        )
    if report["transport_from"]:
        lines.append(f"transport benchmarked in {report['transport_from']['file']}")
    if report.get("torchspec"):
        lines.append(_torchspec_text(report["torchspec"]))
    return "\n".join(lines)


def _architecture_lines(drafts: dict[str, Any], assumptions: dict[str, Any]) -> list[str]:
    lines = [
        f"draft architectures at the target's width (hidden {drafts['hidden_size']:,}, draft vocabulary "
        f"{drafts['draft_vocab_size']:,}, {drafts['ttt_steps']} TTT steps, "
        f"{drafts['context_tokens']:,.0f}-token sequences), trained at {drafts['gpu_flop_s'] / 1e12:,.0f} "
        f"TFLOP/s per GPU (a {assumptions['train_gpu_peak_flop_s'] / 1e12:,.0f} TFLOP/s peak x "
        f"{assumptions['train_mfu']:g}, stated):",
        f"  {'architecture':<14}{'parameters':>14}{'GB (' + drafts['export_dtype'] + ')':>16}"
        f"{'train GFLOP/token':>19}{'tok/s per GPU':>15}",
    ]
    for name in ARCHITECTURES:
        cost = drafts["costs"][name]
        mark = "  <- drafter.architecture" if name == drafts["chosen"] else ""
        if cost["parameters"] is None:
            lines.append(f"  {name:<14}  not for this target: it has no MLA sizes")
            continue
        lines.append(
            f"  {name:<14}{cost['parameters']:>14,}{cost['bytes'] / GB:>16,.3g}"
            f"{cost['train_flops_per_token'] / 1e9:>19,.3g}{cost['train_tok_s_per_gpu']:>15,.0f}{mark}"
        )
    return lines
