"""What SGLang 0.5.23 builds from a draft config, as the load-time checks model it: the draft model's shape
(DraftShape, with MlaSizes for the MLA draft class), its parameters (Param, by loader shard) and the tensors
a checkpoint holds (TensorInfo); shared by the checks of both draft classes
(pipeline.engines.sglang_draft_checks, pipeline.engines.sglang_mla_checks)."""

from __future__ import annotations

from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"


Shard = str | int | None  # q/k/v or gate/up (0/1) of a stacked parameter; None: the whole parameter


@dataclass(frozen=True)
class MlaSizes:
    """The MLA attention sizes Eagle3DeepseekV2ForCausalLM reads (models/kimi_k25_eagle3.py:93-99)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class DraftShape:
    """What LlamaForCausalLMEagle3 builds from a draft config (models/llama_eagle3.py:122-320), or, with mla,
    Eagle3DeepseekV2ForCausalLM (pipeline.engines.sglang_mla_checks)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    draft_vocab: int
    target_hidden: int
    num_aux: int
    fc_bias: bool
    o_proj_bias: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool  # no parameter: which state the next draft step gets (llama_eagle3.py:207, :266-269)
    tied: bool
    lm_head_from_target: bool
    shares_target_embedding: bool
    mla: MlaSizes | None = None


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: F32, BF16, I64, BOOL, ...


@dataclass(frozen=True)
class Param:
    """A parameter of the draft model: the shape each loader shard takes, and whether it must be loaded."""

    shards: dict[Shard, tuple[int, ...]]
    required: bool = True


class Unbuildable(Exception):
    """The draft model cannot even be constructed; the message is the problem."""


def sglang_problem(what: str, consequence: str, *where: str) -> str:
    return f"{what}: SGLang {SGLANG_VERSION} {consequence} ({', '.join(where)})"
