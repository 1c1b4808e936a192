"""The plan's per-architecture sizes (pipeline/drafter/sizes.py) are the drafter's own: parameters counted
against a built drafter, FLOPs against torch's FLOP counter on a forward pass."""

from dataclasses import fields, replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeline.drafter.arch import DrafterArch, MlaShape, architecture_norms
from pipeline.drafter.model import Eagle3Drafter
from pipeline.drafter.sizes import (
    TRAIN_PASSES,
    DraftShape,
    architecture_costs,
    parameter_count,
    train_flops_per_token,
)

SHAPE = DraftShape(
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    draft_vocab_size=40,
    target_hidden_size=48,
)


SHAPE_WITH_MLA = replace(
    SHAPE,
    mla=MlaShape(q_lora_rank=24, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=20),
)


def _drafter(shape: DraftShape, architecture: str = "eagle3") -> Eagle3Drafter:
    fc_norm, norm_output = architecture_norms(architecture)
    sizes = {field.name: getattr(shape, field.name) for field in fields(shape) if field.name != "aux_layers"}
    arch = DrafterArch(
        architecture=architecture,
        fc_norm=fc_norm,
        norm_output=norm_output,
        vocab_size=100,
        aux_layer_ids=list(range(1, shape.aux_layers + 1)),
        **sizes,
    )
    return Eagle3Drafter(arch, torch.zeros(100, shape.hidden_size))


@pytest.mark.parametrize("architecture", ["eagle3", "eagle3.1", "eagle3-mla"])
def test_parameters_are_the_built_drafters(architecture):
    drafter = _drafter(SHAPE_WITH_MLA, architecture)
    assert parameter_count(architecture, SHAPE_WITH_MLA) == sum(p.numel() for p in drafter.parameters())


def test_eagle31_adds_one_norm_per_aux_chunk_and_mla_needs_mla_sizes():
    assert parameter_count("eagle3.1", SHAPE) - parameter_count("eagle3", SHAPE) == 3 * 48
    with pytest.raises(ValueError, match="MLA sizes"):
        parameter_count("eagle3-mla", SHAPE)
    with pytest.raises(ValueError, match="unknown draft architecture"):
        parameter_count("eagle4", SHAPE)


def test_forward_flops_match_torchs_count_of_a_ttt_forward():
    """One TTT forward over a short sequence (attention a small share) against FlopCounterMode's count."""
    drafter = _drafter(SHAPE)
    length, steps = 8, 3
    aux = torch.randn(1, length, 3 * 48)
    ids = torch.randint(0, 100, (1, length))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        outputs = drafter.ttt_forward(aux, ids, steps)
        for hidden in outputs:
            drafter.logits(hidden)
    counted = counter.get_total_flops() / length
    planned = train_flops_per_token("eagle3", SHAPE, steps, context_tokens=length) / TRAIN_PASSES
    assert planned == pytest.approx(counted, rel=0.05)


def test_costs_at_kimis_width_rank_the_architectures_by_their_matmuls():
    kimi = DraftShape(
        hidden_size=7168,
        num_heads=64,
        num_kv_heads=64,
        head_dim=128,
        intermediate_size=18432,
        draft_vocab_size=32000,
        mla=MlaShape(
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
    )
    costs = architecture_costs(kimi, ttt_steps=7, context_tokens=4096, bytes_per_parameter=2, gpu_flop_s=3e14)
    # q/k/v/o of 64 x 128 heads on the 2H input against MLA's low-rank projections
    assert costs["eagle3-mla"]["parameters"] < costs["eagle3"]["parameters"] < costs["eagle3.1"]["parameters"]
    for cost in costs.values():
        assert cost["bytes"] == 2 * cost["parameters"]
        assert cost["train_tok_s_per_gpu"] == pytest.approx(3e14 / cost["train_flops_per_token"])
    no_mla = architecture_costs(SHAPE, ttt_steps=3, context_tokens=64, bytes_per_parameter=4, gpu_flop_s=1e12)
    assert no_mla["eagle3-mla"]["parameters"] is None and no_mla["eagle3"]["parameters"] > 0
