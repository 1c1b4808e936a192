"""What each draft architecture costs at a target's width: parameters, bytes and training FLOPs per token.

Counted from the shapes the drafter's modules have (pipeline.drafter.model), not from a rule of thumb:
tests/unit/test_drafter_sizes.py checks each count against a built drafter's parameters.

- `eagle3`: fc over the aux states, one Llama decoder layer whose q/k/v take the 2H input, the final norm and
  the draft-vocabulary head. The target's embedding is shared, never trained or exported.
- `eagle3.1`: the same, plus one RMSNorm per aux chunk before fc (`fc_norm`).
- `eagle3-mla`: the layer's attention is DeepSeek's MLA: q_a_proj (2H -> q_lora_rank), q_b_proj
  (q_lora_rank -> heads x (qk_nope + qk_rope)), kv_a_proj_with_mqa (2H -> kv_lora_rank + qk_rope),
  kv_b_proj (kv_lora_rank -> heads x (qk_nope + v)), o_proj (heads x v -> H) and the two latent norms.

Training FLOPs per token: fc once per position, then per TTT step the layer and the head, plus attention
over the causal context (half the sequence on average); a backward pass costs twice the forward, so a
trained token costs three forwards (every drafter weight is trained; the target's features are data).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.drafter.arch import ARCHITECTURES, MlaShape

TRAIN_PASSES = 3  # forward + backward (twice the forward's matmuls)


@dataclass(frozen=True)
class DraftShape:
    """A drafter's sizes: its width (the target's hidden size), attention and MLP, the draft vocabulary;
    `mla` only for a DeepSeek-family target (None: eagle3-mla does not apply)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_hidden_size: int | None = None
    aux_layers: int = 3
    mla: MlaShape | None = None

    @property
    def aux_width(self) -> int:
        return self.aux_layers * (self.target_hidden_size or self.hidden_size)


def _layer_matmul_params(architecture: str, shape: DraftShape) -> int:
    """Weights of the decoder layer's linear maps (attention input 2H), the MLP included."""
    width, hidden = 2 * shape.hidden_size, shape.hidden_size
    mlp = 3 * hidden * shape.intermediate_size
    if architecture == "eagle3-mla":
        mla = _mla(shape)
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        attention = (
            width * mla.q_lora_rank
            + mla.q_lora_rank * shape.num_heads * qk
            + width * (mla.kv_lora_rank + mla.qk_rope_head_dim)
            + mla.kv_lora_rank * shape.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
            + shape.num_heads * mla.v_head_dim * hidden
        )
    else:
        q_out = shape.num_heads * shape.head_dim
        kv_out = 2 * shape.num_kv_heads * shape.head_dim
        attention = width * (q_out + kv_out) + q_out * hidden
    return attention + mlp


def _norm_params(architecture: str, shape: DraftShape) -> int:
    # hidden_norm, input_layernorm, post_attention_layernorm, the final norm
    norms = 4 * shape.hidden_size
    if architecture == "eagle3.1":
        norms += shape.aux_width  # fc_norm: one weight of the target's width per aux chunk
    if architecture == "eagle3-mla":
        mla = _mla(shape)
        norms += mla.q_lora_rank + mla.kv_lora_rank  # q_a_layernorm, kv_a_layernorm
    return norms


def _mla(shape: DraftShape) -> MlaShape:
    if shape.mla is None:
        raise ValueError("eagle3-mla needs a DeepSeek-family target's MLA sizes (q_lora_rank, ...)")
    return shape.mla


def parameter_count(architecture: str, shape: DraftShape) -> int:
    """Trained (and exported) parameters: fc, the layer, the norms and the head; not the shared embedding."""
    _known(architecture)
    fc = shape.aux_width * shape.hidden_size
    head = shape.hidden_size * shape.draft_vocab_size
    return fc + _layer_matmul_params(architecture, shape) + _norm_params(architecture, shape) + head


def _attention_flops_per_position(architecture: str, shape: DraftShape, context_tokens: float) -> float:
    """Scores and the weighted sum of one query over the causal context (context_tokens / 2 on average)."""
    if architecture == "eagle3-mla":
        mla = _mla(shape)
        qk, v = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    else:
        qk = v = shape.head_dim
    return 2.0 * shape.num_heads * (qk + v) * context_tokens / 2


def train_flops_per_token(
    architecture: str, shape: DraftShape, ttt_steps: int, context_tokens: float
) -> float:
    """FLOPs one trained token costs: fc once, then ttt_steps passes of the layer and the head, forward and
    backward (TRAIN_PASSES forwards)."""
    _known(architecture)
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be at least 1, not {ttt_steps}")
    fc = 2.0 * shape.aux_width * shape.hidden_size
    step = 2.0 * (_layer_matmul_params(architecture, shape) + shape.hidden_size * shape.draft_vocab_size)
    step += _attention_flops_per_position(architecture, shape, context_tokens)
    return TRAIN_PASSES * (fc + ttt_steps * step)


def _known(architecture: str) -> None:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown draft architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")


def architecture_costs(
    shape: DraftShape, ttt_steps: int, context_tokens: float, bytes_per_parameter: int, gpu_flop_s: float
) -> dict[str, dict[str, float | int | None]]:
    """Per architecture: parameters, exported bytes, training FLOPs per token and the tok/s one GPU trains at
    gpu_flop_s; None where the architecture does not apply (eagle3-mla without MLA sizes)."""
    costs: dict[str, dict[str, float | int | None]] = {}
    for architecture in ARCHITECTURES:
        if architecture == "eagle3-mla" and shape.mla is None:
            costs[architecture] = {"parameters": None, "bytes": None, "train_flops_per_token": None}
            costs[architecture]["train_tok_s_per_gpu"] = None
            continue
        parameters = parameter_count(architecture, shape)
        flops = train_flops_per_token(architecture, shape, ttt_steps, context_tokens)
        costs[architecture] = {
            "parameters": parameters,
            "bytes": parameters * bytes_per_parameter,
            "train_flops_per_token": flops,
            "train_tok_s_per_gpu": gpu_flop_s / flops,
        }
    return costs
