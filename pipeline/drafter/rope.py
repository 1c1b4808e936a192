"""The drafter's rotary position encoding: exactly what SGLang 0.5.23 applies to the exported draft config.

What the drafter sees in training is what SGLang feeds it. SGLang builds the attention of the draft class the
project exports (LlamaForCausalLMEagle3, models/llama_eagle3.py: its midlayer is models/llama.py's
LlamaDecoderLayer) with

    get_rope(head_dim, rotary_dim=head_dim, max_position=max_position_embeddings, base=rope_theta,
             rope_scaling=rope_scaling, is_neox_style=True)

(models/llama.py LlamaAttention.__init__, cited as models/llama.py:225-232 in
pipeline/engines/sglang_draft_checks.py). Under transformers 5, rope_theta and rope_scaling are
config.rope_parameters["rope_theta"] and config.rope_parameters itself (utils/hf_transformers_utils.py
get_rope_config), so the draft config's `rope_theta` + `rope_scaling` reach get_rope whole.
get_rope (layers/rotary_embedding/factory.py, get_rope's scaling_type branches) then builds:
- no rope_scaling, or rope_type "default": RotaryEmbedding, inv_freq = theta ** (-2i / d);
- "linear": LinearScalingRotaryEmbedding, positions divided by `factor`;
- "llama3": Llama3RotaryEmbedding (layers/rotary_embedding/rope_variant.py), low/high-frequency bands;
- "yarn": YaRNScalingRotaryEmbedding (layers/rotary_embedding/yarn.py:91-180) built with `factor`,
  `original_max_position_embeddings` (default: max_position_embeddings) and, of the other keys, only
  extrapolation_factor, attn_factor, beta_fast, beta_slow, mscale, mscale_all_dim and truncate. SGLang
  ignores every other key: transformers' `attention_factor` among them (transformers multiplies cos/sin by
  it; SGLang by `attn_factor` times the mscale ratio), so the drafter follows SGLang and ignores it too.
Line numbers are those of the SGLang 0.5.23 wheel (sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl):
get_rope at layers/rotary_embedding/factory.py:125, its yarn branch :311-369; yarn.py helpers :15-65,
YaRNScalingRotaryEmbedding :91-180 (mscale :117-131, _compute_inv_freq :137-160, cos/sin cache :171-180).

Targets with any other rope type (dynamic NTK, longrope, ...): the drafter does not copy it; it trains and
is exported with plain RoPE over the target's whole derived context, which SGLang then applies as well.
"""

from __future__ import annotations

import math
from typing import Any

import torch

REPRODUCED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the keys get_rope's yarn branch forwards to YaRNScalingRotaryEmbedding (factory.py, branch "yarn")
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "extrapolation_factor",
    "attn_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
)
# keys of transformers 5's rope_parameters that describe the target's attention, not a RoPE variant
_NOT_SCALING_KEYS = ("rope_theta", "type", "rope_type", "partial_rotary_factor")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    """The RoPE variant a rope_scaling dict names, as get_rope reads it ("rope_type", else "type")."""
    if not rope_scaling:
        return "default"
    kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
    if not kind:
        raise ValueError(f"rope_scaling {rope_scaling} names no rope_type (SGLang's get_rope refuses it)")
    return str(kind)


def target_rope(text_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a target config in either layout: transformers 5's `rope_parameters`
    or a checkpoint's `rope_theta` + `rope_scaling`. rope_scaling is None for plain RoPE; otherwise it
    names its variant under "rope_type" and holds only the variant's own settings."""
    parameters = text_config.get("rope_parameters") or {}
    scaling = text_config.get("rope_scaling") or {}
    if any(isinstance(value, dict) for value in parameters.values()):
        raise ValueError(
            f"the target's rope_parameters are per layer type ({sorted(parameters)}); the drafter's single "
            "attention layer needs one RoPE"
        )
    merged = {**scaling, **parameters}
    theta = float(merged.get("rope_theta", text_config.get("rope_theta", 10000.0)))
    kind = rope_type_of(merged) if merged.get("rope_type") or merged.get("type") else "default"
    if kind == "default":
        return theta, None
    settings = {key: value for key, value in merged.items() if key not in _NOT_SCALING_KEYS}
    return theta, {"rope_type": kind, **settings}


def inverse_frequencies(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None, max_position_embeddings: int
) -> torch.Tensor:
    """The [head_dim / 2] rotation frequencies SGLang's rotary embedding for these settings uses."""
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = rope_type_of(rope_scaling)
    if kind == "default":
        return plain
    assert rope_scaling is not None
    if kind == "linear":  # LinearScalingRotaryEmbedding: position / factor
        return plain / float(rope_scaling.get("factor", 1.0))
    if kind == "llama3":
        return _llama3_frequencies(plain, rope_scaling, max_position_embeddings)
    if kind == "yarn":
        return _yarn_frequencies(plain, head_dim, theta, rope_scaling, max_position_embeddings)
    raise ValueError(
        f"RoPE type {kind!r}: the drafter reproduces only {list(REPRODUCED_ROPE_TYPES)} "
        "(pipeline.drafter.rope.draft_rope falls back to plain RoPE for a target using another one)"
    )


def _llama3_frequencies(
    plain: torch.Tensor, settings: dict[str, Any], max_position_embeddings: int
) -> torch.Tensor:
    """Llama3RotaryEmbedding._compute_inv_freq: long wavelengths interpolated by `factor`, short ones kept,
    the band between blended."""
    factor = float(settings.get("factor", 1.0))
    low, high = float(settings.get("low_freq_factor", 1.0)), float(settings.get("high_freq_factor", 4.0))
    original = float(settings.get("original_max_position_embeddings", max_position_embeddings))
    wavelength = 2 * math.pi / plain
    smooth = (original / wavelength - low) / (high - low) if low != high else torch.zeros_like(plain)
    blended = (1 - smooth) * plain / factor + smooth * plain
    interpolated = torch.where(wavelength > original / low, plain / factor, blended)
    return torch.where(wavelength < original / high, plain, interpolated)


def _yarn_correction_dim(rotations: float, head_dim: int, theta: float, original: float) -> float:
    return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def _yarn_frequencies(
    plain: torch.Tensor, head_dim: int, theta: float, settings: dict[str, Any], max_position_embeddings: int
) -> torch.Tensor:
    """YaRNScalingRotaryEmbedding._compute_inv_freq (yarn.py:137-160, helpers yarn.py:15-52): frequencies
    below the beta_slow..beta_fast band are interpolated by `factor`, those above kept, the band ramped."""
    factor = float(settings.get("factor", 1.0))
    original = float(settings.get("original_max_position_embeddings", max_position_embeddings))
    low = _yarn_correction_dim(float(settings.get("beta_fast", 32)), head_dim, theta, original)
    high = _yarn_correction_dim(float(settings.get("beta_slow", 1)), head_dim, theta, original)
    if settings.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # yarn_linear_ramp_mask's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp) * float(settings.get("extrapolation_factor", 1))
    return (plain / factor) * (1 - keep) + plain * keep


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_scale(rope_scaling: dict[str, Any] | None) -> float:
    """The factor SGLang multiplies cos and sin by: YaRN's mscale (yarn.py:117-131), 1 for the others."""
    if rope_type_of(rope_scaling) != "yarn":
        return 1.0
    assert rope_scaling is not None
    factor = float(rope_scaling.get("factor", 1.0))
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale is not None and mscale_all_dim is not None:
        scale = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    else:
        scale = _yarn_mscale(factor)
    return scale * float(rope_scaling.get("attn_factor", 1))


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., head_dim] for positions, neox style (halves rotated), as SGLang's cos_sin_cache
    holds them: computed in float32, scaled, then cast."""
    inv_freq = inverse_frequencies(head_dim, theta, rope_scaling, max_position_embeddings)
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = attention_scale(rope_scaling)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def draft_rope(text_config: dict[str, Any], context_length: int) -> tuple[float, dict[str, Any] | None, int]:
    """(rope_theta, rope_scaling, max_position_embeddings) the drafter of this target trains and is exported
    with. context_length is the target's derived context length (SGLang's get_context_length); a target
    whose rope type the drafter does not reproduce gets plain RoPE over that whole context."""
    theta, scaling = target_rope(text_config)
    if rope_type_of(scaling) in REPRODUCED_ROPE_TYPES:
        return theta, scaling, int(text_config.get("max_position_embeddings") or context_length)
    return theta, None, context_length


# ---- the MLA drafter (eagle3-mla): SGLang's DeepseekV2AttentionMLA ------------------------------
# Eagle3DeepseekV2ForCausalLM (models/kimi_k25_eagle3.py:80-88) hands DeepseekV2AttentionMLA the draft
# config's rope_parameters whole, or None when its rope_type is "default". DeepseekV2AttentionMLA rewrites
# any such rope_type to "deepseek_yarn" (models/deepseek_v2.py:2065-2066) and builds
# get_rope(qk_rope_head_dim, ..., is_neox_style=not rope_interleave) (deepseek_v2.py:2165-2174;
# rope_interleave defaults to True: GPT-J pairs), whose "deepseek_yarn" branch
# (layers/rotary_embedding/factory.py:371-401) builds DeepseekScalingRotaryEmbedding
# (layers/rotary_embedding/rope_variant.py:335-421) from `factor`, `original_max_position_embeddings`
# (default: max_position_embeddings) and only extrapolation_factor, attn_factor, beta_fast, beta_slow,
# mscale and mscale_all_dim: `truncate` is not forwarded, so the correction range is always truncated
# (yarn.py:27-40). Then the softmax scale (qk_nope + qk_rope)^-0.5 is multiplied by mscale^2
# (deepseek_v2.py:2059, 2176-2178; configs/model_config.py:2623-2648).
DEEPSEEK_YARN_KEYS = tuple(key for key in YARN_KEYS if key != "truncate")


def mla_rope_frequencies(
    rope_dim: int, theta: float, rope_scaling: dict[str, Any] | None, max_position_embeddings: int
) -> torch.Tensor:
    """The [rope_dim / 2] frequencies of the MLA drafter's rotary dims: plain RoPE, or
    DeepseekScalingRotaryEmbedding._compute_inv_freq (rope_variant.py:380-404) for any other rope type."""
    plain = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if rope_type_of(rope_scaling) == "default":
        return plain
    assert rope_scaling is not None
    settings = {key: value for key, value in rope_scaling.items() if key in DEEPSEEK_YARN_KEYS}
    return _yarn_frequencies(plain, rope_dim, theta, settings, max_position_embeddings)


def mla_cos_sin_scale(rope_scaling: dict[str, Any] | None) -> float:
    """What DeepseekScalingRotaryEmbedding multiplies cos and sin by (rope_variant.py:364-368): mscale's over
    mscale_all_dim's yarn_get_mscale (defaults 1 and 0, yarn.py:60-63), times attn_factor; 1 for plain
    RoPE."""
    if rope_type_of(rope_scaling) == "default":
        return 1.0
    assert rope_scaling is not None
    factor = float(rope_scaling.get("factor", 1.0))
    mscale = _yarn_mscale(factor, float(rope_scaling.get("mscale", 1)))
    return (
        mscale
        / _yarn_mscale(factor, float(rope_scaling.get("mscale_all_dim", 0)))
        * float(rope_scaling.get("attn_factor", 1))
    )


def mla_softmax_multiplier(rope_scaling: dict[str, Any] | None) -> float:
    """compute_mla_mscale_scaling (configs/model_config.py:2623-2648): the factor on (qk_nope + qk_rope)^-0.5,
    yarn_get_mscale(factor, mscale_all_dim)^2 unless apply_yarn_scaling or apply_scale is false."""
    if rope_type_of(rope_scaling) == "default":
        return 1.0
    assert rope_scaling is not None
    if not rope_scaling.get("apply_yarn_scaling", True) or not rope_scaling.get("apply_scale", True):
        return 1.0
    mscale = _yarn_mscale(
        float(rope_scaling.get("factor", 1.0)), float(rope_scaling.get("mscale_all_dim", 0))
    )
    return mscale * mscale


def mla_cos_sin(
    positions: torch.Tensor,
    rope_dim: int,
    theta: float,
    dtype: torch.dtype,
    *,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., rope_dim / 2], one per rotated pair, as the MLA drafter's cos_sin_cache holds them
    (rope_variant.py:406-416): computed in float32, scaled, then cast. The scaling and the length it was
    fitted for are named at the call: both come from the target's config."""
    inv_freq = mla_rope_frequencies(rope_dim, theta, rope_scaling, max_position_embeddings)
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    scale = mla_cos_sin_scale(rope_scaling)
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def apply_pair_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [..., d] by per-pair cos/sin [..., d / 2] (layers/rotary_embedding/utils.py:36-62): pairs are
    (x[2i], x[2i+1]) when interleaved (GPT-J style), else (x[i], x[i + d/2]) (neox style)."""
    if interleaved:
        x1, x2 = x[..., ::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if interleaved:
        return torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((o1, o2), dim=-1)
