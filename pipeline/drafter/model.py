"""The EAGLE-3 drafter: fc over 3 aux states, one Llama decoder layer with a 2H attention input.

Architectures (DrafterArch.architecture): `eagle3` is the classic layer; `eagle3.1` adds EAGLE-3.1's norms,
`fc_norm` (one RMSNorm per aux state before fc) and `norm_output` (a draft step hands the next one its
post-final-norm state). Both engines read the two flags from config.json's top level (SGLang 0.5.23
models/llama_eagle3.py:184-196, :207; vLLM 0.32.0 model_executor/models/llama_eagle3.py:231, :252).

Parameter names match SGLang's LlamaForCausalLMEagle3 checkpoint (fc, midlayer.*, norm, lm_head,
d2t, t2d), so export is a rename-free save. The target's embedding is a frozen, non-persistent
buffer: it is never trained, checkpointed or exported (SGLang shares the target's).

Two forward paths share the same weights:
- `ttt_forward` unrolls training-time test over a whole sequence (training and evaluation), with
  the diagonal attention scheme of EAGLE-3 (see ttt_attention).
- `decode` runs on a growing KV cache for speculative decoding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.drafter.arch import ARCHITECTURES, DrafterArch, RMSNorm
from pipeline.drafter.mla import MLAAttention
from pipeline.drafter.rope import rope_cos_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _causal_block(q, k0, v0, diag_k, diag_v, start: int, scale: float):
    """Attention of queries [start, start+c) over causal step-0 keys plus per-position diagonal keys."""
    c = q.shape[2]
    end = start + c
    scores = torch.matmul(q, k0[:, :, :end].transpose(-1, -2)) * scale
    rows = torch.arange(start, end, device=q.device)[:, None]
    cols = torch.arange(end, device=q.device)[None, :]
    scores = scores.masked_fill(cols > rows, float("-inf"))
    parts = [scores]
    for k_diag in diag_k:
        parts.append((q * k_diag).sum(-1, keepdim=True) * scale)
    probs = torch.softmax(torch.cat(parts, dim=-1).float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :end], v0[:, :, :end])
    for index, v_diag in enumerate(diag_v):
        out = out + probs[..., end + index : end + index + 1] * v_diag
    return out


def ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], chunk: int
) -> torch.Tensor:
    """EAGLE-3 training-time-test attention, memory linear in sequence length.

    q: [B, h, L, d] queries of step i = len(keys) - 1. keys: per step [B, h, L, d]; values: per step
    [B, h, L, dv], dv may differ from d (MLA).
    A query at position t attends causally to step-0 keys s <= t and only to position t of each
    later step. Queries are processed in chunks under activation checkpointing, so no [L, L]
    score matrix outlives its chunk, forward or backward.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    length = q.shape[2]
    outputs = []
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        diag_k = [k[:, :, start:end] for k in keys[1:]]
        diag_v = [v[:, :, start:end] for v in values[1:]]
        args = (q[:, :, start:end], keys[0], values[0], diag_k, diag_v, start, scale)
        if torch.is_grad_enabled() and length > chunk:
            outputs.append(checkpoint(_causal_block, *args, use_reentrant=False))
        else:
            outputs.append(_causal_block(*args))
    return torch.cat(outputs, dim=2)


def dense_ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> torch.Tensor:
    """Reference: the same attention with every step's keys materialized as one dense mask."""
    steps, length = len(keys), q.shape[2]
    k_all = torch.cat(keys, dim=2)
    v_all = torch.cat(values, dim=2)
    scores = torch.matmul(q, k_all.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    t = torch.arange(length)[:, None]
    allowed = [torch.arange(length)[None, :] <= t]
    allowed += [torch.arange(length)[None, :] == t for _ in range(steps - 1)]
    mask = torch.cat(allowed, dim=1)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v_all)


class DrafterAttention(nn.Module):
    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.arch = arch
        width = 2 * arch.hidden_size
        self.q_proj = nn.Linear(width, arch.num_heads * arch.head_dim, bias=False)
        self.k_proj = nn.Linear(width, arch.num_kv_heads * arch.head_dim, bias=False)
        self.v_proj = nn.Linear(width, arch.num_kv_heads * arch.head_dim, bias=False)
        self.o_proj = nn.Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=False)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, d]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at positions ([T] or [B, T]), looked up in a table of every position up to the
        largest asked for so far (`rope_cos_sin` of each position, computed once rather than per step)."""
        a = self.arch
        needed = int(positions.max()) + 1
        table = self._rope_table
        if table is None or table[0].dtype != dtype or table[0].device != positions.device:
            table = None
        if table is None or table[0].shape[0] < needed:
            size = max(needed, 2 * table[0].shape[0] if table is not None else 256)
            every = torch.arange(size, device=positions.device)
            scaling, max_positions = a.rope_scaling, a.max_position_embeddings
            table = rope_cos_sin(every, a.head_dim, a.rope_theta, dtype, scaling, max_positions)
            self._rope_table = table
        return table[0][positions], table[1][positions]

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """q [B, h, T, d], k and v [B, h, T, d] (kv heads repeated), RoPE applied at positions [T], or [B, T]
        when every row has its own."""
        a = self.arch
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, a.num_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, a.num_kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions, q.dtype)
        if positions.dim() == 2:  # [B, T, d] -> [B, 1, T, d], one position per row and token
            cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeat = a.num_heads // a.num_kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return q, k, v

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))


def attention_for(arch: DrafterArch) -> DrafterAttention | MLAAttention:
    """The draft layer's attention: Llama-style, or MLA for eagle3-mla; both give project(x, positions) ->
    q, k, v [B, heads, T, d] (v may be narrower or wider than q and k) and out(attended)."""
    if arch.architecture not in ARCHITECTURES:
        raise ValueError(
            f"unknown drafter architecture {arch.architecture!r}; known: {', '.join(ARCHITECTURES)}"
        )
    if arch.architecture == "eagle3-mla":
        return MLAAttention(arch)
    return DrafterAttention(arch)


class DrafterMLP(nn.Module):
    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """SGLang's `midlayer`: attention over cat(input_layernorm(embeds), hidden_norm(hidden))."""

    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn: DrafterAttention | MLAAttention = attention_for(arch)
        self.mlp = DrafterMLP(arch)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


NUM_AUX_STATES = 3  # fc reads the target's aux states of 3 layers, concatenated in ascending layer order


class Eagle3Drafter(nn.Module):
    # buffers registered in __init__; declared here so they type as tensors, not `Tensor | Module`
    embed_weight: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, arch: DrafterArch, embed_weight: torch.Tensor):
        super().__init__()
        if embed_weight.shape != (arch.vocab_size, arch.hidden_size):
            raise ValueError(
                f"target embedding {tuple(embed_weight.shape)} does not match "
                f"vocab {arch.vocab_size} x hidden {arch.hidden_size}"
            )
        self.arch = arch
        target_hidden = arch.target_hidden_size or arch.hidden_size
        # absent (not an empty list) when off, so that an eagle3 state dict is what it always was
        self.fc_norm = (
            nn.ModuleList([RMSNorm(target_hidden, arch.rms_norm_eps) for _ in range(NUM_AUX_STATES)])
            if arch.fc_norm
            else None
        )
        self.fc = nn.Linear(NUM_AUX_STATES * target_hidden, arch.hidden_size, bias=False)
        self.midlayer = DrafterLayer(arch)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.draft_vocab_size, bias=False)
        self.register_buffer("embed_weight", embed_weight.detach().clone(), persistent=False)
        self.register_buffer("d2t", torch.zeros(arch.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(arch.vocab_size, dtype=torch.bool))

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_weight).to(self.fc.weight.dtype)

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h_out))

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the target's aux states [.., 3 * target_hidden], each chunk RMS-normed first with fc_norm
        (chunk i = the i-th aux layer ascending; SGLang llama_eagle3.py:241-247, vLLM
        llama_eagle3.py:397-418)."""
        aux = aux.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux)

    def carried(self, h_out: torch.Tensor) -> torch.Tensor:
        """The state a draft step hands the next one: h_out, or with norm_output its final norm.

        The engines carry norm(h_out) itself (SGLang llama_eagle3.py:263-269, vLLM llama_eagle3.py:283-288
        with the proposer's llm_base_proposer.py:721, :761) and the next step uses it twice, as the residual
        and through hidden_norm (SGLang llama_eagle3.py:97-102; vLLM llama_eagle3.py:131-135 with
        _norm_after_residual :117-122, the default for the plain config.json export writes), never elsewhere.
        So carrying h_out and normalizing it when the next step starts (`step_input`) computes the same
        thing, and callers keep handing back the h_out that `logits` takes.
        """
        return self.norm(h_out) if self.arch.norm_output else h_out

    def step_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """A step's hidden input [.., H]: fc over target aux states, or the previous step's carried state."""
        if hidden.shape[-1] != self.arch.hidden_size:
            return self.project_aux(hidden)
        return self.carried(hidden)

    def ttt_forward(
        self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int, chunk: int = 512
    ) -> list[torch.Tensor]:
        """Unrolled training-time test; returns the pre-norm hidden state h_out of every step.

        Step k at anchor t sees feature f_t (for k = 0) or the draft's own carried state (k > 0), takes the
        ground-truth token x_{t+1+k} at RoPE position t + k, and predicts x_{t+2+k}. Input tokens
        past the end are padded with id 0 and must be masked out by the caller.
        """
        batch, length, _ = aux.shape
        hidden = self.project_aux(aux)
        positions = torch.arange(length, device=aux.device)
        attn = self.midlayer.self_attn
        keys, values, outputs = [], [], []
        for step in range(steps):
            tokens = F.pad(input_ids[:, 1 + step :], (0, 1 + step), value=0)[:, :length]
            x = self.midlayer.attention_input(self.embed(tokens), hidden)
            q, k, v = attn.project(x, positions + step)
            keys.append(k)
            values.append(v)
            attended = ttt_attention(q, keys, values, chunk)
            h_out = self.midlayer.finish(hidden, attn.out(attended))
            outputs.append(h_out)
            hidden = self.carried(h_out)
        return outputs

    def decode(
        self, hidden: torch.Tensor, token_ids: torch.Tensor, start_position: int, cache: DraftCache
    ) -> torch.Tensor:
        """Append T positions to the cache; hidden is [B, T, 3H] aux features or [B, T, H] own h_out (which
        `step_input` carries as the architecture does).

        Returns h_out [B, T, H] (pre-norm); logits come from `logits(h_out)`.
        """
        hidden = self.step_input(hidden)
        length = token_ids.shape[1]
        positions = torch.arange(start_position, start_position + length, device=token_ids.device)
        attn = self.midlayer.self_attn
        x = self.midlayer.attention_input(self.embed(token_ids), hidden)
        q, k, v = attn.project(x, positions)
        k_all, v_all = cache.append(k, v, start_position)
        past = k_all.shape[2] - length
        mask = None  # one new position attends to every cached one
        if length > 1:
            mask = torch.ones(length, k_all.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=past)
        attended = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        return self.midlayer.finish(hidden, attn.out(attended))

    def decode_rows(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`decode` for a batch whose rows hold different lengths: positions [B, T] per row, an additive
        mask [B, 1, T, L + T] over the past's L columns and the new ones. Returns h_out [B, T, H] and the
        new positions' keys and values [B, h, T, d]; the caller keeps the cache
        (pipeline.decoding.batched)."""
        hidden = self.step_input(hidden)
        attn = self.midlayer.self_attn
        x = self.midlayer.attention_input(self.embed(token_ids), hidden)
        q, k, v = attn.project(x, positions)
        k_all = k if past is None else torch.cat([past[0], k], dim=2)
        v_all = v if past is None else torch.cat([past[1], v], dim=2)
        attended = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask.to(q.dtype))
        return self.midlayer.finish(hidden, attn.out(attended)), k, v


class DraftCache:
    """KV cache of the drafter; positions are contiguous from 0 and can be cropped after verify."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def _filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None or self.v is None:
            raise ValueError("draft cache is empty")
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is None:
            return
        k, v = self._filled()
        self.k, self.v = k[:, :, :length], v[:, :, :length]

    def expanded(self, rows: int) -> DraftCache:
        """A copy with the batch repeated `rows` times (one row per tree branch)."""
        k, v = self._filled()
        copy = DraftCache()
        copy.k, copy.v = k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)
        return copy

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep, for each new row, the cache of the row it continues (beam-style)."""
        k, v = self._filled()
        self.k, self.v = k.index_select(0, rows), v.index_select(0, rows)

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start != self.length:
            raise ValueError(f"draft cache holds {self.length} positions, cannot append at {start}")
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v
