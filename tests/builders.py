"""Small objects that tests of every tier build: drafters, targets, records, registry entries.

Pure constructors, no fixtures: a test module imports what it needs from here instead of from
another test module, so a module can move between tiers without taking its neighbours along.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from pipeline.benchmark_settings import SGLangBenchConfig
from pipeline.config import GateConfig, load_config
from pipeline.data.capture_shards import CaptureSample
from pipeline.drafter.arch import DrafterArch, MlaShape, architecture_norms
from pipeline.drafter.export import export_drafter
from pipeline.drafter.model import Eagle3Drafter
from pipeline.engines.tiny_target import KIMI_MAX_POSITION_EMBEDDINGS, KIMI_ROPE_PARAMETERS
from pipeline.ops.watch import ServedAcceptanceWatch
from pipeline.records import (
    BenchDecision,
    BenchMethods,
    BenchRecord,
    DraftSetting,
    EvalRecord,
    GateCheck,
    GateRecord,
    IncumbentSkipped,
    MeasuredCosts,
    MethodResult,
    PredictedVsMeasured,
    RatioInterval,
    SpeedModel,
)
from pipeline.storage import open_store
from tests.conftest import storage_config, tiny_config_dict

# the target layers a 6-layer tiny target's drafter reads
AUX = [1, 2, 3]
CONTRACT = {"aux_layer_ids": AUX, "hidden_size": 16}
SERVING = {"steps": 3, "topk": 1, "draft_tokens": 4}
# the target small_drafter fits: a 6-layer Llama, 16 wide, 50 tokens, 2,048 positions of plain RoPE
SMALL_TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_hidden_layers": 6,
    "intermediate_size": 32,
    "vocab_size": 50,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}


def _identity_vocab(model: Eagle3Drafter, vocab: int) -> Eagle3Drafter:
    model.set_vocab_mapping(torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    return model


def small_drafter(
    seed=0, vocab=50, hidden=16, aux_layer_ids=(1, 2, 3), architecture="eagle3"
) -> Eagle3Drafter:
    """A randomly initialised drafter for SMALL_TARGET, weights wide enough to predict something (its norm
    weights too, so that every norm an architecture adds changes what it computes)."""
    torch.manual_seed(seed)
    fc_norm, norm_output = architecture_norms(architecture)
    arch = DrafterArch(
        hidden_size=hidden,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=vocab,
        draft_vocab_size=vocab,
        aux_layer_ids=list(aux_layer_ids),
        architecture=architecture,
        fc_norm=fc_norm,
        norm_output=norm_output,
    )
    model = Eagle3Drafter(arch, torch.randn(vocab, hidden))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return _identity_vocab(model, vocab)


# MLA sizes of a DeepSeek-family target small_mla_drafter fits: v_head_dim differs from q/k's width (6 + 4)
SMALL_MLA = {
    "q_lora_rank": 12,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 6,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
}


def small_mla_drafter(seed=0, vocab=50, hidden=16, rope_scaling=None) -> Eagle3Drafter:
    """A randomly initialised eagle3-mla drafter (2 heads, SMALL_MLA sizes), weights wide enough to predict
    something; rope_scaling: the target's (e.g. Kimi's YaRN), None for plain RoPE."""
    torch.manual_seed(seed)
    arch = DrafterArch(
        hidden_size=hidden,
        num_heads=2,
        num_kv_heads=2,
        head_dim=SMALL_MLA["qk_nope_head_dim"] + SMALL_MLA["qk_rope_head_dim"],
        intermediate_size=32,
        vocab_size=vocab,
        draft_vocab_size=vocab,
        aux_layer_ids=[1, 2, 3],
        rope_theta=50000.0 if rope_scaling else 10000.0,
        rope_scaling=rope_scaling,
        max_position_embeddings=KIMI_MAX_POSITION_EMBEDDINGS if rope_scaling else 2048,
        architecture="eagle3-mla",
        mla=MlaShape(**SMALL_MLA),
    )
    model = Eagle3Drafter(arch, torch.randn(vocab, hidden))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return _identity_vocab(model, vocab)


def random_drafter(target_dir, seed=0) -> Eagle3Drafter:
    """An untrained drafter on a built tiny target's own embedding (from its model directory)."""
    from pipeline.engines.target import load_frozen_tensors

    frozen = load_frozen_tensors(target_dir)
    vocab, hidden = frozen["embed"].shape
    torch.manual_seed(seed)
    arch = DrafterArch.uniform(hidden, 2, 2, (vocab, vocab), AUX)
    return _identity_vocab(Eagle3Drafter(arch, frozen["embed"].float()).eval(), vocab)


def small_target(tmp_path: Path) -> Path:
    """The target's model directory (its config.json written atomically: racing promoters share it)."""
    directory = tmp_path / "target"
    directory.mkdir(exist_ok=True)
    partial = directory / f".config.json.{threading.get_ident()}"
    partial.write_text(json.dumps(SMALL_TARGET))
    os.replace(partial, directory / "config.json")
    return directory


def drafter_dir(tmp_path: Path, seed: int) -> Path:
    """An exported small drafter, as the train stage hands it to promote."""
    return export_drafter(
        small_drafter(seed), CONTRACT, tmp_path / f"drafter-{seed}", "float32", small_target(tmp_path)
    )


def kimi_like_target(directory: Path, **changes) -> Path:
    """A DeepSeek-V3-style (MLA) target config with Kimi's long-context RoPE, as the tiny Kimi target writes
    it (transformers 5: rope_parameters), small enough for a 16-wide drafter."""
    config = {
        "architectures": ["TinyKimiForCausalLM"],
        "model_type": "tiny_kimi",
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 32,
        "num_hidden_layers": 6,
        "kv_lora_rank": 8,
        "vocab_size": 50,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": KIMI_MAX_POSITION_EMBEDDINGS,
        "rope_parameters": dict(KIMI_ROPE_PARAMETERS),
        **changes,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def kimi_like_run_config(tmp_path: Path, **drafter):
    return load_config(
        data={
            "storage": {"root": str(tmp_path / "store")},
            "target": {"name": "kimi-like"},
            "drafter": {"draft_vocab_size": 50, **drafter},
        }
    )


def drafter_for(tmp_path: Path, target_dir: Path) -> Eagle3Drafter:
    """A drafter shaped by the pipeline's own sizing for `target_dir` (a kimi_like_target)."""
    from pipeline.training.worker import drafter_arch

    torch.manual_seed(0)
    arch = drafter_arch(kimi_like_run_config(tmp_path), target_dir, AUX, 50)
    model = Eagle3Drafter(arch, torch.randn(arch.vocab_size, arch.hidden_size))
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return _identity_vocab(model, 50)


def eval_record() -> EvalRecord:
    return EvalRecord(
        samples=12,
        ttt_steps=2,
        teacher="topk",
        counts=[[1.0, 2.0], [3.0, 4.0]],
        loss=[0.5, 0.7],
        acc=[0.8, 0.6],
        full_acc=[0.8, 0.5],
        cond_acc=[0.8, 0.625],
        tau_simulated=2.3,
        full_acc_at={"2": [0.9, 0.7], "4": [0.95, 0.8]},
        masked_tokens=[100, 90],
        chain_anchors=[100, 100],
        drafter="file:///store/runs/r1/train",
        dataset="file:///store/datasets/t/r1",
        incumbent=IncumbentSkipped(version="v0", skipped="different capture contract: vocab_size"),
    )


def production_drafter(
    store, target: str, revision: str | None, alias: str = "production", version: str = "v1"
) -> None:
    """A production drafter `version` trained for `revision` (its registry manifest's lineage)."""
    from pipeline import layout
    from pipeline.manifest import publish
    from pipeline.ops import registry

    lineage = {
        "dataset": "s3://b/datasets/d1",
        "contract": {"target": {"model_path": "m", "revision": revision}},
    }
    publish(store, layout.drafter_version_prefix(target, version), "drafter", [], {"lineage": lineage})
    current = registry.read_alias(store, target, alias)
    registry.move_alias(
        store, target, alias, version, "test", expected=current["version"] if current else None
    )


def response_ids(store, uri) -> list[str]:
    """The ids of every response a published responses dataset at `uri` lists, in order."""
    from pipeline.data.jsonl import decode_jsonl
    from pipeline.manifest import read_listed, read_manifest

    prefix = store.key_for(uri)
    manifest = read_manifest(store, prefix, kind="responses")
    return [
        r["id"]
        for shard in manifest["shards"]
        for r in decode_jsonl(read_listed(store, prefix, manifest, shard["name"]))
    ]


def capture_samples(hidden=8, k=4, last_hidden=True, topk=True) -> list[CaptureSample]:
    """Three captured samples (5, 1 and 9 tokens) with `hidden`-wide targets of three aux layers."""
    torch.manual_seed(0)
    samples = []
    for i, length in enumerate([5, 1, 9]):
        logprobs = torch.log_softmax(torch.randn(length, 50), -1).topk(k, -1)
        samples.append(
            CaptureSample(
                f"id{i}",
                torch.randint(0, 100, (length,)),
                torch.randint(0, 2, (length,)),
                torch.randn(length, 3 * hidden) * 3,
                torch.randn(length, hidden) if last_hidden else None,
                logprobs.indices if topk else None,
                logprobs.values if topk else None,
            )
        )
    return samples


def sglang_server_info(**changes) -> dict:
    """What a Kimi SGLang 0.5.23 server set up for capture answers on /server_info; a value "absent"
    drops its key."""
    info = {
        "version": "0.5.23",
        "enable_return_hidden_states": True,
        "enable_return_aux_hidden_states": True,
        "return_aux_hidden_state_layer_ids": [1, 29, 57],
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
    }
    info.update(changes)
    return {k: v for k, v in info.items() if v != "absent"}


def sglang_bench_settings(**changes) -> SGLangBenchConfig:
    """The benchmark settings of an 8-GPU Kimi deployment, with `changes` applied."""
    base = {
        "launch": ["python", "-m", "sglang.launch_server"],
        "model_path": "/models/Kimi-K2.5",
        "extra_args": ["--tp", "8", "--trust-remote-code"],
        "steps": 3,
        "topk": 1,
        "draft_tokens": 4,
        "max_running_requests": 8,
    }
    return SGLangBenchConfig(**{**base, **changes})


def acceptance_watch(**settings) -> ServedAcceptanceWatch:
    """A served-acceptance watch over one (unreachable unless scraped) metrics URL, with `settings`."""
    return ServedAcceptanceWatch.model_validate(
        {"metrics_urls": ["http://127.0.0.1:1/metrics"], "floor": 2.0, "window_s": 100, **settings}
        | {"min_verify_calls": settings.get("min_verify_calls", 10)}
    )


def gate_record(reasons: list[str] | None = None) -> GateRecord:
    return GateRecord(
        run_id="r1",
        thresholds=GateConfig(min_cond_acc=[0.3], min_tau_simulated=1.3),
        passed=True,
        checks=[GateCheck(check="cond_acc_0", value=0.8, threshold=0.3, passed=True)],
        reasons=reasons or ["cond_acc_0 = 0.8000 >= 0.3000"],
    )


def speculative(seconds: float, tok_s: float, tau: float, histogram: list[int]) -> MethodResult:
    """A speculative method's figures over 128 tokens in two rounds."""
    return MethodResult(
        tokens=128,
        seconds=seconds,
        tok_s=tok_s,
        round_tok_s=[tok_s - 1, tok_s + 1],
        tau_measured=tau,
        accepted_histogram=histogram,
    )


def bench_record(decision: BenchDecision | None = None) -> BenchRecord:
    """A reference-decoder benchmark's record: two draft steps, baseline and n-gram beside the candidate."""
    setting = DraftSetting(steps=2, topk=1, draft_tokens=3, tau=2.3, tok_s=50.0, speedup=1.6)
    headline = {"engine": "reference", "draft_steps": 2, "topk": 1, "draft_tokens": 3, "tau_simulated": 2.3}
    return BenchRecord(
        **headline,
        tau_measured=2.1,
        baseline_tok_s=30.0,
        drafter_tok_s=48.0,
        speedup_vs_baseline=1.6,
        speedup_vs_ngram=1.2,
        speedups={
            "baseline": RatioInterval(ratio=1.6, ci_low=1.5, ci_high=1.7, confidence=0.95, rounds=8),
            "ngram": RatioInterval(ratio=1.2, ci_low=1.1, ci_high=1.3, confidence=0.95, rounds=8),
        },
        run_id="r1",
        prompts=4,
        max_new_tokens=32,
        methods=BenchMethods(
            baseline=MethodResult(tokens=128, seconds=4.0, tok_s=30.0, round_tok_s=[29.0, 31.0]),
            ngram=speculative(3.2, 40.0, 1.3, [5, 2]),
            candidate=speculative(2.7, 48.0, 2.1, [3, 4, 5]),
        ),
        speed_model=SpeedModel(
            costs=MeasuredCosts(
                target_step=0.01, verify_chain={"3": 0.012}, verify_tree={}, draft={"1": 0.002}
            ),
            chosen=setting,
            calibration=[],
            predicted_vs_measured=PredictedVsMeasured(tau=(2.3, 2.1), speedup=(1.6, 1.6)),
            ranked=[setting],
        ),
        decision=decision
        or BenchDecision(promotable=True, reasons=["candidate/baseline speed 1.600 >= required 1.0"]),
    )


class TokenizerSpy:
    """The tiny target's tokenizer, noting the longest text it was asked to template or tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.longest = 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def apply_chat_template(self, messages, **options):
        self.longest = max(self.longest, sum(len(message["content"]) for message in messages))
        return self.tokenizer.apply_chat_template(messages, **options)

    def __call__(self, texts, **options):
        self.longest = max(self.longest, *(len(text) for text in texts))
        return self.tokenizer(texts, **options)


def one_source_prompts_config(tmp_path: Path, source: dict) -> tuple:
    """A tiny test config whose prompts come from `source` alone (8 samples, none held out), and its store."""
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["prompts"] = {"sources": [source], "eval_fraction": 0.0, "num_samples": 8}
    config = load_config(data=data)
    return config, open_store(config.storage)


def failure(kind: str) -> BaseException:
    """One failure of each kind the exit-code table (pipeline.failures) names, by a name of FAILURE_KINDS:
    built here so that a test and a pod script it starts raise the same."""
    from pipeline.benchmark.job import BenchmarkFailed
    from pipeline.config import ConfigError
    from pipeline.data.capture_contract import ContractMismatch
    from pipeline.ids import InvalidIdError
    from pipeline.ops.kube_api import KubernetesApiError
    from pipeline.promotion import BenchmarkInconclusive, GateFailed, PromotionRefused
    from pipeline.records import BenchDecision, RecordError
    from pipeline.storage import StorageError
    from pipeline.training.checkpoint_digests import CheckpointRefused

    unsure = BenchDecision(
        promotable=False,
        reasons=["candidate/baseline 1.2 (0.5-3.0)"],
        verdict="inconclusive",
        next_step="rerun",
    )
    made = {
        "gate rejected": lambda: GateFailed(
            "gate failed for run r1:\n  cond_acc_0 = 0.1 < 0.3", ["cond_acc_0"]
        ),
        "refused: slower": lambda: PromotionRefused("refused: slower: candidate/baseline 0.8", "slower"),
        "refused: acceptance": lambda: PromotionRefused("refused: acceptance differs", "mismatch"),
        "inconclusive": lambda: BenchmarkInconclusive(unsure),
        "config": lambda: ConfigError("benchmark.engine 'x' is none of reference, vllm, sglang"),
        "contract": lambda: ContractMismatch("aux layer ids [1, 2] != [1, 3]"),
        "id": lambda: InvalidIdError("run id '../x' is not an id"),
        "parity": lambda: _parity_failed(),
        "target": lambda: _target_error(),
        "checkpoint": lambda: CheckpointRefused("checkpoint tag t1 does not match its digests"),
        "kubernetes refused": lambda: KubernetesApiError("pods is forbidden", status=403),
        "malformed record": lambda: RecordError("EvalRecord at file:///e.json: field cond_acc missing"),
        "storage": lambda: StorageError("s3 endpoint unreachable"),
        "kubernetes unreachable": lambda: KubernetesApiError("connection refused"),
        "benchmark failed": lambda: BenchmarkFailed("vLLM's outputs differ from greedy decoding"),
    }
    return made[kind]()


def _parity_failed() -> BaseException:
    from pipeline.engines.parity import ParityFailed

    return ParityFailed("the engine's aux states differ from the reference forward by 0.3")


def _target_error() -> BaseException:
    from pipeline.engines.target import TargetError

    return TargetError("target model /models/x has no config.json")


# every kind `failure` builds, and the exit code the README's table gives it
FAILURE_KINDS = {
    "gate rejected": 3,
    "refused: slower": 3,
    "refused: acceptance": 3,
    "inconclusive": 4,
    "config": 2,
    "contract": 2,
    "id": 2,
    "parity": 2,
    "target": 2,
    "checkpoint": 2,
    "kubernetes refused": 2,
    "malformed record": 2,
    "storage": 1,
    "kubernetes unreachable": 1,
    "benchmark failed": 1,
}
