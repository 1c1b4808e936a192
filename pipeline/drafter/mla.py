"""The eagle3-mla draft layer's attention: DeepSeek-V2/V3 multi-head latent attention over EAGLE-3's 2H input.

As SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM computes it (models/kimi_k25_eagle3.py:151-187, attention
DeepseekV2AttentionMLA, models/deepseek_v2.py:2030-2180) and vLLM 0.32.0's deepseek_eagle3.py
(model_executor/layers/mla.py:172-255), un-absorbed (SGLang's MHA path, forward_mha.py:190-240, computes the
same):

    x = cat(input_layernorm(embeds), hidden_norm(h))                       [T, 2H]
    q = q_b_proj(q_a_layernorm(q_a_proj(x)))  per head [q_nope (qk_nope) ; q_pe (qk_rope)]
    c_kv, k_pe = kv_a_proj_with_mqa(x).split([kv_lora, qk_rope])           k_pe: one head shared by all heads
    k_nope, v = kv_b_proj(kv_a_layernorm(c_kv))  per head [k_nope (qk_nope) ; v (v_head)]
    q_pe, k_pe = rope(q_pe, k_pe)                                           pipeline.drafter.rope: mla_cos_sin
    out = o_proj(softmax(q k^T * scale) v),  scale = (qk_nope + qk_rope)^-0.5 * mla_softmax_multiplier

Parameter names are the checkpoint's (midlayer.self_attn.q_a_proj, ...), so export stays a rename-free save.
`project` returns k = cat(k_nope, k_pe) and folds the softmax multiplier into q, so the drafter's attention
code (ttt_attention, decode, decode_rows, DraftCache), which scales by q's width^-0.5, runs it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.drafter.arch import DrafterArch, MlaShape, RMSNorm
from pipeline.drafter.rope import apply_pair_rope, mla_cos_sin, mla_softmax_multiplier

# config.json keys that make a target DeepSeek-family (MLA attention) and give the MLA drafter its sizes
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class MlaTargetRefused(ValueError):
    """The target cannot take an eagle3-mla drafter."""


def mla_shape_of_target(text_config: dict, source: str) -> MlaShape:
    """The MLA sizes of a DeepSeek-family target's config.json (source names it in errors); MlaTargetRefused
    for a target without MLA attention and for q_lora_rank null, which SGLang's MLA drafter refuses
    (models/kimi_k25_eagle3.py:114-117)."""
    missing = [key for key in MLA_KEYS if key not in text_config]
    if missing:
        raise MlaTargetRefused(
            f"drafter.architecture eagle3-mla needs a DeepSeek-family (MLA attention) target, but {source} "
            f"has no {', '.join(missing)}: SGLang's MLA drafter (Eagle3DeepseekV2ForCausalLM) is built and "
            "tested only for Kimi-K2.x / DeepSeek-V3 MLA targets; use drafter.architecture eagle3 for this "
            "target"
        )
    if text_config["q_lora_rank"] is None:
        raise MlaTargetRefused(
            f"drafter.architecture eagle3-mla: {source} has q_lora_rank null, and SGLang 0.5.23's MLA "
            "drafter refuses it (ValueError 'Eagle3 MLA layer requires q_lora_rank', "
            "models/kimi_k25_eagle3.py:114-117); use drafter.architecture eagle3 for this target"
        )
    return MlaShape(
        q_lora_rank=int(text_config["q_lora_rank"]),
        kv_lora_rank=int(text_config["kv_lora_rank"]),
        qk_nope_head_dim=int(text_config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(text_config["qk_rope_head_dim"]),
        v_head_dim=int(text_config["v_head_dim"]),
        rope_interleave=bool(text_config.get("rope_interleave", True)),
    )


class MLAAttention(nn.Module):
    def __init__(self, arch: DrafterArch):
        super().__init__()
        if arch.mla is None:
            raise ValueError("an eagle3-mla drafter needs its MLA sizes (DrafterArch.mla)")
        self.arch, self.shape = arch, arch.mla
        m, heads, width = arch.mla, arch.num_heads, 2 * arch.hidden_size
        self.q_a_proj = nn.Linear(width, m.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(m.q_lora_rank, arch.rms_norm_eps)
        self.q_b_proj = nn.Linear(
            m.q_lora_rank, heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), bias=False
        )
        self.kv_a_proj_with_mqa = nn.Linear(width, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, arch.rms_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, arch.hidden_size, bias=False)
        # the attention code scales scores by q's width^-0.5 = (qk_nope + qk_rope)^-0.5; SGLang's extra factor
        # (deepseek_v2.py:2176-2178) goes into q
        self.softmax_multiplier = mla_softmax_multiplier(arch.rope_scaling)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, qk_rope / 2]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at positions ([T] or [B, T]), from a table of every position up to the largest asked
        for."""
        a = self.arch
        table = self._rope_table
        if table is not None and (table[0].dtype != dtype or table[0].device != positions.device):
            table = None
        needed = int(positions.max()) + 1
        if table is None or table[0].shape[0] < needed:
            size = max(needed, 2 * table[0].shape[0] if table is not None else 256)
            every = torch.arange(size, device=positions.device)
            table = mla_cos_sin(
                every,
                self.shape.qk_rope_head_dim,
                a.rope_theta,
                dtype,
                rope_scaling=a.rope_scaling,
                max_position_embeddings=a.max_position_embeddings,
            )
            self._rope_table = table
        return table[0][positions], table[1][positions]

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """q and k [B, h, T, qk_nope + qk_rope] (q pre-multiplied by the softmax multiplier), v
        [B, h, T, v_head]; RoPE on the rope dims at positions [T], or [B, T] when every row has its own."""
        m, heads = self.shape, self.arch.num_heads
        batch, length, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, length, heads, m.qk_nope_head_dim + m.qk_rope_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv))
        kv = kv.view(batch, length, heads, m.qk_nope_head_dim + m.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        cos, sin = self.rope(positions, q.dtype)
        if positions.dim() == 2:  # [B, T, d/2] -> [B, 1, T, d/2], one position per row and token
            cos, sin = cos[:, None], sin[:, None]
        q_pe = apply_pair_rope(q_pe, cos, sin, m.rope_interleave)
        k_pe = apply_pair_rope(k_pe[:, None], cos, sin, m.rope_interleave)  # [B, 1, T, qk_rope]
        q = torch.cat([q_nope, q_pe], dim=-1)
        if self.softmax_multiplier != 1.0:
            q = q * self.softmax_multiplier
        k = torch.cat([k_nope, k_pe.expand(-1, heads, -1, -1)], dim=-1)
        return q, k, v

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
