"""What a drafter is built from: its architecture's sizes and flags (DrafterArch, an MLA layer's MlaShape),
the draft architectures and the norms each turns on, and the RMSNorm every architecture uses. The model
(pipeline.drafter.model) and the MLA attention (pipeline.drafter.mla) are built from these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# the EAGLE-3.1 norms each draft architecture turns on: (fc_norm, norm_output); eagle3-mla is the MLA layer
# with EAGLE-3's norms (the public kimi-k2.5-eagle3-mla)
ARCHITECTURE_NORMS: dict[str, tuple[bool, bool]] = {
    "eagle3": (False, False),
    "eagle3.1": (True, True),
    "eagle3-mla": (False, False),
}

ARCHITECTURES = tuple(ARCHITECTURE_NORMS)  # pipeline.config DrafterConfig.architecture's values


@dataclass
class MlaShape:
    """The sizes of an MLA attention layer (DeepSeek-V2/V3's names), taken from a DeepSeek-family target."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # GPT-J pairs, as SGLang's default (models/deepseek_v2.py:2166)


@dataclass
class DrafterArch:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # SGLang's rope_scaling ({"rope_type": "yarn", "factor": ...}); None: plain RoPE (pipeline.drafter.rope)
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    target_hidden_size: int | None = None
    extra: dict = field(default_factory=dict)
    architecture: str = "eagle3"
    mla: MlaShape | None = None  # eagle3-mla: the attention's sizes (pipeline.drafter.mla)
    # EAGLE-3.1: an RMSNorm on each aux state before fc (weights fc_norm.{i}, i-th aux layer ascending)
    fc_norm: bool = False
    # EAGLE-3.1: the state carried to the next draft step is norm(h_out), not h_out
    norm_output: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def uniform(
        cls,
        hidden_size: int,
        num_heads: int,
        ffn_multiple: int,
        vocab: tuple[int, int],
        aux_layer_ids: list[int],
    ) -> DrafterArch:
        """A drafter with as many key/value heads as query heads, head_dim hidden_size / num_heads and an
        FFN ffn_multiple times the hidden size; vocab is (target vocabulary, draft vocabulary)."""
        return cls(
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=hidden_size // num_heads,
            intermediate_size=ffn_multiple * hidden_size,
            vocab_size=vocab[0],
            draft_vocab_size=vocab[1],
            aux_layer_ids=aux_layer_ids,
        )


def architecture_norms(architecture: str) -> tuple[bool, bool]:
    """(fc_norm, norm_output) of a draft architecture; ValueError naming the ones known."""
    if architecture not in ARCHITECTURE_NORMS:
        raise ValueError(
            f"drafter architecture {architecture!r} is not one this model builds; "
            f"known: {', '.join(ARCHITECTURE_NORMS)}"
        )
    return ARCHITECTURE_NORMS[architecture]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) in float32, cast back, then scaled: one fused op, not five (the
        drafter's per-step cost in decoding is mostly per-op overhead)."""
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)
