"""Typed run configuration: one YAML file plus dotted overrides, validated at the boundary.

Every section rejects unknown keys, so a typo in a config is an error, never a silently ignored
setting.
"""

from __future__ import annotations

import copy
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.benchmark_settings import BenchmarkConfig
from pipeline.config_base import ConfigError, Strict
from pipeline.credentials import refuse_credentials, without_credentials
from pipeline.data.capture_contract import TeacherKind
from pipeline.engine_settings import SGLangClientConfig, VllmEngineConfig, VllmServerClientConfig
from pipeline.ids import validate_id
from pipeline.storage import S3_CREDENTIALS, StorageConfig
from pipeline.yaml_files import parse_yaml, read_yaml_file


class TinyDeepseekV3Shape(Strict):
    """MLA and MoE sizes of a DeepSeek-V3-architecture tiny target (Kimi-K2.5's text backbone)."""

    q_lora_rank: PositiveInt = Field(32, description="MLA: rank of the compressed query")
    kv_lora_rank: PositiveInt = Field(16, description="MLA: rank of the compressed key/value")
    qk_nope_head_dim: PositiveInt = Field(
        8, description="MLA: per-head query/key dims without rotary embedding"
    )
    qk_rope_head_dim: int = Field(8, ge=2, multiple_of=2, description="MLA: per-head rotary dims")
    v_head_dim: PositiveInt = 16
    n_routed_experts: int = Field(4, ge=2)
    n_shared_experts: PositiveInt = 1
    num_experts_per_tok: PositiveInt = Field(2, description="routed experts per token")
    moe_intermediate_size: int = Field(64, ge=8, description="MLP width of each expert")
    first_k_dense_replace: int = Field(
        1, ge=0, description="leading layers with a dense MLP instead of experts"
    )

    @model_validator(mode="after")
    def _experts_fit(self) -> TinyDeepseekV3Shape:
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts "
                f"{self.n_routed_experts}"
            )
        return self


class TinyTargetRecipe(Strict):
    """How the embedded tiny target is built; its hash names the cached build."""

    architecture: Literal["llama", "deepseek_v3"] = Field(
        "llama",
        description="deepseek_v3: MLA + MoE shipped like Kimi-K2.5, with its own model and tiktoken "
        "tokenizer code (needs target.trust_remote_code)",
    )
    num_layers: int = Field(8, ge=2)
    hidden_size: int = Field(128, ge=16)
    num_heads: PositiveInt = 4
    intermediate_size: int = Field(384, ge=16, description="MLP width (deepseek_v3: of the dense layers)")
    vocab_size: int = Field(2048, ge=300)
    seq_len: int = Field(192, ge=32)
    batch_size: PositiveInt = 32
    train_steps: PositiveInt = 1200
    learning_rate: float = 3e-3
    seed: int = 0
    max_corpus_modules: int | None = Field(None, description="cap for quick test builds")
    deepseek_v3: TinyDeepseekV3Shape | None = Field(
        None, description="architecture deepseek_v3 only; defaults when left out"
    )

    @model_validator(mode="after")
    def _shape_of_the_architecture(self) -> TinyTargetRecipe:
        if self.architecture == "llama" and self.deepseek_v3 is not None:
            raise ValueError("target.tiny.deepseek_v3 is set but target.tiny.architecture is 'llama'")
        if self.architecture == "deepseek_v3" and self.deepseek_v3 is None:
            self.deepseek_v3 = TinyDeepseekV3Shape()
        if self.deepseek_v3 is not None and self.deepseek_v3.first_k_dense_replace >= self.num_layers:
            raise ValueError("target.tiny.deepseek_v3.first_k_dense_replace leaves no MoE layer")
        return self


class TargetMlaShape(Strict):
    """The MLA sizes of a DeepSeek-family target's attention, as its config.json names them."""

    q_lora_rank: PositiveInt
    kv_lora_rank: PositiveInt
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    v_head_dim: PositiveInt
    num_attention_heads: PositiveInt


class TargetConfig(Strict):
    name: str = Field(description="target id used in storage paths, e.g. kimi-k2.5")
    source: Literal["tiny", "hf"] = "tiny"
    model_path: str | None = Field(None, description="local HF directory (source: hf)")
    revision: str | None = None
    tiny: TinyTargetRecipe | None = None
    trust_remote_code: bool = Field(
        False,
        description="run the Python code the model directory ships (auto_map in config.json or "
        "tokenizer_config.json), as Kimi-K2.5 needs; transformers' trust_remote_code, "
        "SGLang's --trust-remote-code",
    )
    num_layers: int | None = Field(None, description="expected; checked against the model config")
    hidden_size: int | None = None
    vocab_size: int | None = None
    mla: TargetMlaShape | None = Field(
        None,
        description="a DeepSeek-family target's MLA sizes, declared for `drafter plan` like hidden_size (its "
        "config.json's are used where the model directory is at hand)",
    )
    tensor_parallel: PositiveInt = 1

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        return validate_id(name, "target.name")

    @model_validator(mode="after")
    def _source_has_what_it_needs(self) -> TargetConfig:
        if self.source == "tiny" and self.tiny is None:
            self.tiny = TinyTargetRecipe()
        if self.source == "hf" and not self.model_path:
            raise ValueError("target.source 'hf' needs target.model_path")
        tiny = self.tiny if self.source == "tiny" else None
        if tiny is not None and tiny.architecture == "deepseek_v3" and not self.trust_remote_code:
            raise ValueError(
                "target.tiny.architecture 'deepseek_v3' ships its own code, like Kimi-K2.5: "
                "set target.trust_remote_code: true"
            )
        return self


# the domain of a conversation whose source and record name none
DEFAULT_DOMAIN = "general"


class PromptSource(Strict):
    kind: Literal["demo", "jsonl", "json", "parquet", "arrow"] = "demo"
    path: str | None = Field(
        None, description="a file, a directory, a glob, s3://bucket/key or s3://bucket/prefix/"
    )
    weight: float = Field(1.0, gt=0)
    domain: str = Field(
        DEFAULT_DOMAIN,
        description="the domain its conversations are evaluated under (chat, code, math, tools...); a "
        "record's own `domain` field takes precedence",
    )
    split: Literal["auto", "eval"] = Field(
        "auto",
        description="auto: prompts.eval_fraction of it held out; eval: all of it held out, never trained on "
        "(a standard evaluation set). An eval source is read whole (up to max_samples), apart from "
        "prompts.num_samples and the weights, which share out the rest",
    )
    format: Literal["conversation", "mt_bench", "gsm8k", "humaneval", "math500", "bfcl"] = Field(
        "conversation",
        description="conversation: ShareGPT or OpenAI messages; otherwise the standard set whose published "
        "file this is (pipeline/data/standard_sets.py: MT-Bench's question.jsonl, GSM8K's test.jsonl, "
        "HumanEval.jsonl.gz, MATH-500's test.jsonl, BFCL's BFCL_v*_*.json)",
    )
    max_samples: PositiveInt | None = Field(
        None, description="conversations kept from this source at most (None: as many as it gives)"
    )

    @field_validator("domain")
    @classmethod
    def _domain_is_an_id(cls, domain: str) -> str:
        return validate_id(domain, "prompts.sources[].domain")

    @field_validator("path")
    @classmethod
    def _path_without_credentials(cls, path: str | None) -> str | None:
        return path if path is None else refuse_credentials(path, "prompts.sources[].path", S3_CREDENTIALS)

    @model_validator(mode="after")
    def _path_for_files(self) -> PromptSource:
        if self.kind != "demo" and not self.path:
            raise ValueError(f"prompt source of kind {self.kind!r} needs a path")
        return self


class PromptsConfig(Strict):
    sources: list[PromptSource] = Field(default_factory=lambda: [PromptSource()])
    num_samples: PositiveInt = Field(
        600,
        description="conversations kept after filtering, from the sources with split auto "
        "(the eval ones' come on top)",
    )
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    shard_size: PositiveInt = Field(256, description="conversations per shard")
    min_prompt_tokens: PositiveInt = 4
    max_prompt_tokens: PositiveInt = 256
    near_dedup: bool = Field(
        True,
        description="drop prompts whose text nearly duplicates an earlier one "
        "(MinHash LSH, Jaccard ~0.8 on word 5-grams)",
    )
    max_bad_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="share of the records read that may be lines that are not JSON; "
        "up to it they are skipped and counted (rejected.malformed_json), "
        "past it the stage fails naming file:line",
    )
    seed: int = 0


class GenerateConfig(Strict):
    engine: Literal["hf", "sglang", "vllm"] = "hf"
    max_new_tokens: PositiveInt = 128
    temperature: float = Field(0.0, ge=0.0)
    batch_size: PositiveInt = 32
    checkpoint_every: PositiveInt = Field(128, description="conversations per resumable part of a shard")
    teacher_topk: int | None = Field(
        None,
        ge=1,
        le=128,
        description="also keep the top-k log-probs behind every generated token of the final turn",
    )
    sglang: SGLangClientConfig | None = None
    vllm: VllmEngineConfig | None = Field(
        None, description="engine vllm, in-process: a worker in vLLM's virtualenv (default settings if unset)"
    )
    vllm_server: VllmServerClientConfig | None = Field(
        None, description="engine vllm, in production: vLLM's OpenAI-compatible servers, not a local worker"
    )

    @model_validator(mode="after")
    def _engine_settings(self) -> GenerateConfig:
        if self.engine == "sglang" and self.sglang is None:
            raise ValueError("generate.engine 'sglang' needs generate.sglang.urls")
        if self.vllm is not None and self.vllm_server is not None:
            raise ValueError(
                "generate.vllm (a local vLLM worker) and generate.vllm_server (vLLM servers over HTTP) "
                "exclude each other: set one"
            )
        return self


class ParityConfig(Strict):
    """Before capturing, compare the engine with an independent reference forward on a few samples."""

    samples: int = Field(4, ge=0, description="0 disables the comparison (server settings are still checked)")
    reference: Literal["hf"] = Field("hf", description="transformers forward with layer hooks")
    tolerance: float = Field(1e-3, gt=0, description="max |engine - reference| / max |reference| per layer")


def _topk_teacher() -> list[TeacherKind]:
    return ["topk"]


class InProcessCaptureConfig(Strict):
    """capture.engine inprocess: the target runs in the capture job's own processes and its hidden states go
    from the forward into shards as tensors (pipeline.engines.inprocess)."""

    runner: Literal["sglang", "local"] = Field(
        "sglang",
        description="sglang: SGLang's ModelRunner, one process per tensor-parallel rank on a capture node "
        "(needs SGLang 0.5.23 and GPUs); local: a transformers forward (the tiny target, tests)",
    )
    tp_size: PositiveInt = Field(8, description="tensor-parallel ranks: processes of the capture job")
    mem_fraction_static: float = Field(
        0.8, gt=0, lt=1, description="sglang runner: GPU memory for weights and KV cache (SGLang's flag)"
    )
    max_prefill_tokens: PositiveInt = Field(
        65536, description="sglang runner: tokens of one prefill forward; a longer batch is split"
    )

    @model_validator(mode="after")
    def _local_runs_untensored(self) -> InProcessCaptureConfig:
        if self.runner == "local" and self.tp_size > 2:
            raise ValueError("the local runner holds the whole target in every rank: use tp_size 1 or 2")
        return self


class CaptureConfig(Strict):
    engine: Literal["hf", "sglang", "inprocess"] = "hf"
    aux_layer_ids: list[int] | None = Field(
        None, description="0-indexed decoder layers whose OUTPUT is captured; default [1, N//2-1, N-4]"
    )
    encoding: Literal["bf16", "fp8"] = Field(
        "fp8",
        description="aux (and last hidden) storage: bf16, or e4m3 with one scale per token per fp8_block "
        "channels of a layer",
    )
    fp8_block: PositiveInt = Field(
        128,
        description="channels per fp8 scale (1x128 as DeepSeek-V3 quantizes activations); a layer width it "
        "does not divide gets a shorter last block, a block as wide as the layer is one scale per token and "
        "layer",
    )
    fp8_max_rel_error: float | None = Field(
        0.05,
        gt=0,
        description="a shard whose measured fp8 round-trip error (RMS over channels of the per-channel "
        "relative error) exceeds this in any layer is stored bf16, with a warning; e4m3 rounding alone "
        "measures 0.023-0.026 (docs/BENCHMARKS.md); null: never fall back",
    )
    teacher: list[TeacherKind] = Field(
        default_factory=_topk_teacher, min_length=1, description="post-norm last_hidden and/or topk log-probs"
    )
    teacher_topk: int = Field(16, ge=1, le=128)
    max_length: int = Field(2048, ge=8)
    batch_size: PositiveInt = 8
    part_max_mib: float = Field(
        2048,
        gt=0,
        description="a response shard's capture is stored as parts of about this many MiB of encoded rows: "
        "each part is uploaded while the next one is captured; local disk holds about three",
    )
    parity: ParityConfig = Field(default_factory=lambda: ParityConfig())
    sglang: SGLangClientConfig | None = None
    inprocess: InProcessCaptureConfig = Field(default_factory=lambda: InProcessCaptureConfig())

    @model_validator(mode="after")
    def _sglang_needs_urls(self) -> CaptureConfig:
        if self.engine != "sglang":
            return self
        if self.sglang is None:
            raise ValueError("capture.engine 'sglang' needs capture.sglang.urls (aux-state servers)")
        if "last_hidden" in self.teacher and not self.sglang.last_hidden_urls:
            raise ValueError(
                "a last_hidden teacher with SGLang needs capture.sglang.last_hidden_urls "
                "(servers without --enable-return-aux-hidden-states)"
            )
        return self

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_ascending(cls, ids: list[int] | None) -> list[int] | None:
        if ids is None:
            return ids
        if len(ids) != 3 or sorted(set(ids)) != ids or ids[0] < 0:
            raise ValueError(f"aux_layer_ids must be 3 distinct ascending layer ids >= 0, got {ids}")
        return ids


# Drafter settings that come from the target's config.json only: SGLang 0.5.23 refuses a draft whose context
# is shorter than the target's, and applies the draft config's own RoPE settings (pipeline.drafter.rope).
TARGET_DERIVED_DRAFTER_SETTINGS = ("max_position_embeddings", "rope_theta", "rope_scaling", "vocab_size")


class DrafterConfig(Strict):
    architecture: Literal["eagle3", "eagle3.1", "eagle3-mla"] = Field(
        "eagle3",
        description="the draft model's architecture: eagle3 (Llama-style layer), eagle3.1 (EAGLE-3.1's "
        "norms), eagle3-mla (an MLA layer, DeepSeek-family targets)",
    )
    draft_vocab_size: int = Field(32000, ge=2, description="at most the target's vocabulary")
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    export_dtype: Literal["float32", "bfloat16"] = "bfloat16"

    @model_validator(mode="after")
    def _mla_sizes_from_target(self) -> DrafterConfig:
        given = [key for key in ("num_kv_heads", "head_dim") if getattr(self, key) is not None]
        if self.architecture == "eagle3-mla" and given:
            raise ValueError(
                f"drafter.{given[0]} does not apply to drafter.architecture eagle3-mla: an MLA layer's "
                "key/value heads and head dims come from the target's config.json (q_lora_rank, "
                "kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim); remove "
                f"drafter.{', drafter.'.join(given)}"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _no_target_derived_settings(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [key for key in TARGET_DERIVED_DRAFTER_SETTINGS if key in data]
            if given:
                raise ValueError(
                    f"drafter.{given[0]} is not a setting: the drafter takes its context length "
                    "(max_position_embeddings), RoPE settings (rope_theta, rope_scaling) and vocab_size from "
                    "the target's config.json, so that SGLang serves it with the target; remove "
                    f"drafter.{', drafter.'.join(given)}"
                )
        return data


class PlateauConfig(Strict):
    enabled: bool = True
    window_epochs: PositiveInt = 2
    min_gain: float = Field(0.01, ge=0.0, description="cond_acc_0 gain needed over the window")


class AutoInitConfig(Strict):
    """How train.init auto decides between a warm start from the incumbent and scratch, and when a warm
    run gives up (pipeline.training.init_choice)."""

    min_probe_cond_acc: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="a warm start from an incumbent of another target needs its held-out cond_acc_0 on the "
        "new data at least this; default the gate's step-0 bar (gate.min_cond_acc[0])",
    )
    plateau_steps: PositiveInt = Field(
        200,
        description="a warm start auto chose whose training cond_acc_0 (per log interval) gains less "
        "than plateau_min_gain over this many steps, still under its restart bar, restarts from scratch; "
        "the bar is the incumbent's own held-out cond_acc_0 (its registry lineage) less "
        "plateau_shortfall_vs_own, or the gate's step-0 bar (gate.min_cond_acc[0]) when that is higher or "
        "the incumbent has no lineage",
    )
    plateau_min_gain: float = Field(0.01, ge=0.0)
    plateau_shortfall_vs_own: float = Field(
        0.15,
        ge=0.0,
        le=1.0,
        description="how far under what the incumbent reached on its own target's held-out data a warm "
        "start may stall before it is restarted from scratch (a Kimi-K2 drafter warm-started on K2.5 "
        "stalled at 38% while scratch reached 74.7%)",
    )
    max_vocabulary_gap: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="an incumbent of another target whose draft vocabulary misses more of the new data's "
        "held-out tokens than one built from the new data, by more than this share, is not warm-started: "
        "a warm start keeps its vocabulary and could never emit the rest",
    )


# DeepSpeed's multi-node runner reached nodes over SSH (pdsh), which lost the pods' environment (IRSA's S3
# credentials among it); every node now runs the same torchrun command instead.
_SSH_LAUNCHER_GONE = (
    "the SSH (pdsh) multi-node launcher: set train.nodes, train.rendezvous_endpoint and "
    "train.rendezvous_port; every node runs the same torchrun command with c10d rendezvous "
    "(train.launcher kubernetes creates their pods from infra/k8s/trainer-workers.yaml)"
)


def _names_pod_0_in_full(endpoint: str) -> bool:
    """An address, or a name under a cluster's services (<pod>.<service>.<namespace>.svc.<domain>)."""
    import ipaddress

    try:
        ipaddress.ip_address(endpoint)
    except ValueError:
        return ".svc." in f"{endpoint}."
    return True


class TrainConfig(Strict):
    epochs: PositiveInt = 4
    micro_batch_size: PositiveInt = 8
    max_length: int = Field(2048, ge=8)
    learning_rate: float = Field(1e-3, gt=0)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.5, gt=0)
    ttt_steps: PositiveInt = 7
    loss_decay: float = Field(0.8, gt=0, le=1)
    attention_chunk: PositiveInt = Field(512, description="query chunk of the TTT attention")
    cache_gb: float = Field(50.0, gt=0, description="local shard cache budget per rank (LRU)")
    prefetch_shards: int = Field(2, ge=0, description="shards fetched ahead of the one being trained on")
    nproc: PositiveInt = Field(2, description="ranks per node: GPUs per node, or CPU processes without GPUs")
    nodes: PositiveInt = Field(
        1,
        description="training nodes, one torchrun agent each, all running the same "
        "command and meeting at the c10d rendezvous (rendezvous_endpoint:"
        "rendezvous_port); one node started here runs `--standalone`",
    )
    launcher: Literal["torchrun", "kubernetes"] = Field(
        "torchrun",
        description="who starts the node agents: torchrun: this process, on this machine (several "
        "nodes here are the local rehearsal of a cluster run); kubernetes: the pods of "
        "the Indexed Job in kubernetes_job, created by the train stage, which waits for it",
    )
    rendezvous_endpoint: str | None = Field(
        None,
        description="host of the c10d rendezvous, reachable from every node (several nodes or launcher "
        "kubernetes): 127.0.0.1 on one machine; in Kubernetes node 0's full name under the "
        "headless Service, <job>-0.<service>.<namespace>.svc.<cluster domain>",
    )
    rendezvous_port: int = Field(
        29400, ge=1, le=65535, description="port of the rendezvous store on the endpoint"
    )
    rendezvous_timeout_s: PositiveInt = Field(
        900,
        description="how long a node waits for all nodes to join; pods "
        "on freshly scaled GPU nodes start minutes apart",
    )
    kubernetes_job: str = Field(
        "infra/k8s/trainer-workers.yaml",
        description="launcher kubernetes: the manifest of the Indexed Job of node pods",
    )
    deepspeed_config: str = "configs/deepspeed/zero2-cpu.json"
    precision: Literal["fp32", "bf16"] = "fp32"
    teacher: Literal["auto", "last_hidden", "topk"] = Field(
        "auto", description="auto: last_hidden when the captures carry it, else top-k log-probs"
    )
    checkpoint_every_steps: int = Field(0, ge=0, description="0: checkpoint at epoch ends only")
    seed: int = 0
    log_every: PositiveInt = 20
    init: Literal["scratch", "warm", "auto"] = Field(
        "scratch",
        description="scratch; warm from init_from; auto: warm from the incumbent (init_from, default "
        "registry:<registry.alias>) when it was trained on the same target or its probe on the new "
        "held-out data clears auto_init.min_probe_cond_acc, else scratch, and a warm run that plateaus "
        "early restarts from scratch. The DAGs' scheduled and Asset-triggered runs use auto",
    )
    init_from: str | None = None
    auto_init: AutoInitConfig = Field(default_factory=AutoInitConfig)
    plateau: PlateauConfig = Field(default_factory=PlateauConfig)

    @model_validator(mode="before")
    @classmethod
    def _no_removed_settings(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "hostfile" in data:
                raise ValueError(f"train.hostfile was removed with {_SSH_LAUNCHER_GONE}")
            if data.get("launcher") == "deepspeed":
                raise ValueError(f"train.launcher 'deepspeed' was removed with {_SSH_LAUNCHER_GONE}")
        return data

    @model_validator(mode="after")
    def _warm_needs_source(self) -> TrainConfig:
        if self.init == "warm" and not self.init_from:
            raise ValueError("train.init 'warm' needs train.init_from (a drafter directory or registry uri)")
        return self

    @model_validator(mode="after")
    def _rendezvous_for_several_nodes(self) -> TrainConfig:
        if (self.nodes > 1 or self.launcher == "kubernetes") and not self.rendezvous_endpoint:
            raise ValueError(
                "several nodes (train.nodes > 1) or train.launcher 'kubernetes' need "
                "train.rendezvous_endpoint (127.0.0.1 on one machine; <job>-0.<headless service>."
                "<namespace>.svc.cluster.local in Kubernetes)"
            )
        if self.launcher == "kubernetes" and not _names_pod_0_in_full(str(self.rendezvous_endpoint)):
            # torch's c10d backend makes the node whose own full name (its /etc/hosts, written by the
            # kubelet) equals the endpoint host the store (elastic/rendezvous/utils.py,
            # _matches_machine_hostname); a shorter name it can only resolve through cluster DNS, which may
            # not list pod 0 yet: then no node hosts the store and all wait out the join timeout
            raise ValueError(
                f"train.rendezvous_endpoint {self.rendezvous_endpoint!r}: with launcher 'kubernetes' name "
                "pod 0 in full, <job>-0.<headless service>.<namespace>.svc.cluster.local (pod 0 knows "
                "itself by that name before cluster DNS lists it; pytorch/pytorch#73682)"
            )
        return self


class EvaluateConfig(Strict):
    ttt_steps: PositiveInt | None = Field(None, description="default: train.ttt_steps")
    micro_batch_size: PositiveInt = 8
    simulated_anchors: int = Field(
        512,
        ge=0,
        description="held-out anchors, spread over every eval sample, at which each draft shape the "
        "benchmark may choose is simulated with the decoder's own tree code (0: none)",
    )


class GateConfig(Strict):
    """The candidate's bars. Against the incumbent there is no tolerance: a candidate whose held-out
    tau_simulated is below the incumbent's on the same held-out anchors never promotes."""

    min_cond_acc: list[float] = Field(default_factory=lambda: [0.3])
    min_tau_simulated: float = Field(1.3, ge=1.0)
    max_domain_regression_vs_incumbent: float | None = Field(
        None,
        ge=0.0,
        description="allowed drop in tau_simulated on each held-out domain the incumbent was also evaluated "
        "on (a candidate better on average but worse on one domain fails, naming it); None: not checked",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_tolerance_behind_the_incumbent(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_regression_vs_incumbent" in data:
            raise ValueError(
                "gate.max_regression_vs_incumbent was removed: a candidate behind the incumbent on the "
                "held-out split never promotes; delete the key (gate.max_domain_regression_vs_incumbent "
                "still sets the margin allowed on each domain)"
            )
        return data


class RegistryConfig(Strict):
    promote: bool = True
    alias: str = "production"

    @field_validator("alias")
    @classmethod
    def _valid_alias(cls, alias: str) -> str:
        return validate_id(alias, "registry.alias")


class TrackingConfig(Strict):
    """Where a run's training curves go while it trains, besides its metrics.jsonl: TensorBoard event files
    under the run's prefix (`<run>/train/tensorboard/`), and an MLflow tracking server when one is named."""

    tensorboard: bool = True
    upload_every_s: float = Field(
        60.0, gt=0, description="how often the event files are copied to the run's prefix while it trains"
    )
    mlflow_uri: str | None = Field(
        None, pattern=r"^https?://[^\s]+$", description="an MLflow tracking server (http or https)"
    )
    mlflow_experiment: str = Field("drafter", min_length=1, max_length=200)

    @field_validator("mlflow_uri")
    @classmethod
    def _no_credentials_in_uri(cls, uri: str | None) -> str | None:
        instead = "set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN"
        return uri if uri is None else refuse_credentials(uri, "tracking.mlflow_uri", instead)


# what `drafter plan` assumes: most figures are positive; prices and load times may be zero
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]


class PlanAssumptions(Strict):
    """What `drafter plan` assumes where no pilot run or benchmark measured it (replace with measured figures:
    `drafter plan --measured-from RUN_ID`, `--transport FILE` from benchmarks/bench_capture_transport.py)."""

    prompt_tokens_mean: Positive = Field(600, description="prompt tokens per conversation (all user turns)")
    response_tokens_mean: Positive | None = Field(
        None, description="assistant tokens per conversation (a pilot run measures it); unset: the mix below"
    )
    response_tokens_thinking: Positive = Field(
        3000, description="assistant tokens per conversation when the target thinks (reasoning + answer)"
    )
    response_tokens_non_thinking: Positive = Field(
        700, description="assistant tokens per conversation without thinking"
    )
    thinking_fraction: float = Field(
        1.0, ge=0, le=1, description="share of conversations generated with thinking on"
    )
    assistant_turns: Positive = Field(
        1.5,
        description="assistant turns per conversation (caps responses at generate.max_new_tokens per turn)",
    )
    generate_tok_s_per_server: Positive = Field(
        1500, description="output tok/s of one generation server at generate.sglang.concurrency"
    )
    capture_tok_s_per_server: Positive | None = Field(
        None,
        description="captured tok/s of one capture server end to end, as a pilot run measures it; unset: "
        "modelled from the GPU, transport, client and S3 rates below, whichever binds",
    )
    capture_gpu_tok_s_per_server: Positive = Field(
        20000,
        description="prompt tok/s one capture server's GPUs prefill with aux states: capture's rate when "
        "nothing else binds",
    )
    transport_tok_s_per_server: Positive = Field(
        343,
        description="HTTP capture: tok/s one SGLang server's JSON path moves (its slowest process; "
        "benchmarks/bench_capture_transport.py at Kimi-K2.5's width)",
    )
    client_parse_tok_s_per_core: Positive = Field(
        600, description="HTTP capture: tok/s one client core parses out of the JSON (same benchmark)"
    )
    shard_encode_tok_s_per_core: Positive = Field(
        300,
        description="tok/s one core checks and encodes into capture shards, on either path (same benchmark)",
    )
    capture_clients: PositiveInt | None = Field(
        None,
        description="HTTP capture: capture task pods running at once; unset: as many as keep the servers "
        "the bottleneck",
    )
    capture_client_cores: PositiveInt = Field(16, description="cores of one capture task's pod")
    capture_node_spare_cores: PositiveInt = Field(
        64, description="in-process capture: cores of a capture node left to encode shards beside the engine"
    )
    s3_write_mb_s: Positive = Field(500, description="MB/s one capture process uploads to the object store")
    s3_read_mb_s_per_node: Positive = Field(1000, description="MB/s one training node reads captures")
    train_tok_s_per_gpu: Positive | None = Field(
        None,
        description="trained tok/s per GPU, all TTT steps included, as a pilot run measures it; unset: the "
        "drafter architecture's training FLOPs per token over train_gpu_peak_flop_s x train_mfu",
    )
    train_gpu_peak_flop_s: Positive = Field(
        989e12,
        description="one training GPU's dense BF16 peak: an H200 SXM's 989 TFLOP/s (NVIDIA's datasheet)",
    )
    train_mfu: float = Field(
        0.3,
        gt=0,
        le=1,
        description="the share of that peak a one-layer drafter's training sustains (stated, not measured: "
        "its matmuls are a single layer's and the head's; `--measured-from` a pilot run replaces the rate)",
    )
    train_nodes: PositiveInt = Field(1, description="nodes planned for when train.nodes is 1")
    server_load_minutes: NonNegative = Field(
        20,
        description="from a fleet's scale-up to its servers answering: "
        "node, image pull, weights onto the GPUs",
    )
    text_bytes_per_token: Positive = Field(5, description="JSONL bytes per token of prompts and responses")
    gpu_hour_usd: NonNegative = 2.5
    s3_gb_month_usd: NonNegative = 0.023
    s3_put_per_1000_usd: NonNegative = 0.005
    s3_get_per_1000_usd: NonNegative = 0.0004
    retention_months: Positive = Field(1.0, description="how long captures are kept in S3 Standard")

    def response_tokens(self) -> float:
        """Assistant tokens per conversation: measured or set, else the thinking/non-thinking mix."""
        if self.response_tokens_mean is not None:
            return self.response_tokens_mean
        return (
            self.thinking_fraction * self.response_tokens_thinking
            + (1 - self.thinking_fraction) * self.response_tokens_non_thinking
        )


class RunConfig(Strict):
    storage: StorageConfig
    target: TargetConfig
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    plan: PlanAssumptions = Field(default_factory=PlanAssumptions)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        ids = self.capture.aux_layer_ids
        if ids is not None and self.target.num_layers is not None and ids[-1] >= self.target.num_layers:
            raise ValueError(
                f"capture.aux_layer_ids {ids} out of range for a target of {self.target.num_layers} layers"
            )
        tiny = self.target.tiny if self.target.source == "tiny" else None
        if ids is not None and tiny is not None:  # the model family is known before the target is built
            from pipeline.engines.layer_ids import TINY_TARGET_FAMILIES, refuse_unservable_capture

            refuse_unservable_capture(ids, TINY_TARGET_FAMILIES[tiny.architecture], tiny.num_layers)
        if self.target.vocab_size is not None and self.drafter.draft_vocab_size > self.target.vocab_size:
            raise ValueError("drafter.draft_vocab_size exceeds target.vocab_size")
        return self

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# Settings that name an executable, a command, or code that runs (a directory whose Python files run, a
# manifest of pods and their commands), or where the run's data is kept and sent (the store, which the
# registry, lineage and the training checkpoints' digests trust; the servers that get its prompts): an
# operator sets them in a run config file or on the command line; a scheduler's trigger form may not
# (pipeline.tasks.refuse_code_overrides).
CODE_SETTINGS = (
    "storage.root",
    "storage.endpoint_url",
    "generate.sglang.urls",
    "generate.vllm_server.urls",
    "capture.sglang.urls",
    "capture.sglang.last_hidden_urls",
    "target.model_path",  # its Python files (auto_map) run with target.trust_remote_code
    "target.trust_remote_code",
    "generate.vllm.python",
    "generate.vllm.extra_engine_args",  # vllm.LLM arguments: worker classes, remote code, ...
    "benchmark.vllm.python",
    "benchmark.vllm.extra_engine_args",
    "benchmark.sglang.launch",
    "benchmark.sglang.extra_args",  # the servers' command line: --trust-remote-code, loaders, ...
    "benchmark.sglang.model_path",
    "train.kubernetes_job",  # the node pods' image and command
    # the tiny target's code is built there and run; training checkpoints and their digests are kept there
    "storage.local_cache",
)


def overridden_code_settings(override: str) -> list[str]:
    """The CODE_SETTINGS a dotted override `key.path=value` sets: the setting itself, one inside it, or
    a section that holds it (which the value replaces whole)."""
    path = override.split("=", 1)[0].strip()
    return [
        setting
        for setting in CODE_SETTINGS
        if setting == path or setting.startswith(f"{path}.") or path.startswith(f"{setting}.")
    ]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The capture contract's default: outputs of layers 1, N//2 - 1 and N - 4 (0-indexed)."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if num_layers < 5 or sorted(set(ids)) != ids:
        raise ConfigError(f"no default aux layers for a {num_layers}-layer target; set capture.aux_layer_ids")
    return ids


class _ShortRepr(reprlib.Repr):
    """Reprs cut short at every level, of strings masked before they are cut (a cut could split a URL
    from the "@" that marks its password)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 2, 80, 80
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 4

    def repr_str(self, x: str, level: int) -> str:
        return super().repr_str(without_credentials(x), level)


def _shortened(text: str, most: int = 500) -> str:
    text = without_credentials(text)
    return text if len(text) <= most else text[:most] + "..."


def validation_problems(err: ValidationError, most: int = 20) -> str:
    """What a ValidationError says, bounded whatever the input (values and messages cut short, at most
    `most` problems listed; str(err) would write out a whole expanded input), credentials masked."""
    problems = err.errors(include_url=False, include_context=False)
    lines = [f"{len(problems)} validation error{'s' if len(problems) != 1 else ''} for {err.title}"]
    for problem in problems[:most]:
        lines.append(_shortened(".".join(str(part) for part in problem["loc"]) or "(top level)"))
        lines.append(f"  {_shortened(problem['msg'])} [input: {_ShortRepr().repr(problem.get('input'))}]")
    if len(problems) > most:
        lines.append(f"... and {len(problems) - most} more")
    return "\n".join(lines)


def apply_override(tree: dict[str, Any], dotted: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} is not of the form key.path=value")
    path, raw = dotted.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override {dotted!r} has an empty key")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = parse_yaml(raw, f"the value of override {path.strip()}") if raw.strip() else None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, data: dict[str, Any] | None = None
) -> RunConfig:
    """Load a RunConfig from a YAML file (or a dict) and dotted overrides."""
    if (path is None) == (data is None):
        raise ConfigError("give exactly one of a config path or a config dict")
    tree = (read_yaml_file(path) or {}) if path is not None else copy.deepcopy(data)
    if not isinstance(tree, dict):
        raise ConfigError(f"config {path or '<dict>'} must be a mapping at the top level")
    for dotted in overrides or []:
        apply_override(tree, dotted)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(f"invalid config {path or '<dict>'}:\n{validation_problems(err)}") from err
