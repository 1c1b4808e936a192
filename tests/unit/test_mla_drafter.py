"""The eagle3-mla drafter: its attention against SGLang's absorbed MLA written out by hand, its RoPE against
transformers', export as Eagle3DeepseekV2ForCausalLM and back, SGLang 0.5.23's load checks on it, and the
refusals (a target without MLA, vLLM here)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pipeline.config import ConfigError, load_config
from pipeline.drafter.export import (
    DrafterFormatError,
    export_drafter,
    load_drafter,
    no_engine_here,
    read_drafter_dir,
)
from pipeline.drafter.mla import MlaTargetRefused
from pipeline.drafter.rope import mla_rope_frequencies, mla_softmax_multiplier
from pipeline.engines.sglang_draft_checks import SpeculativeArgs, draft_model_problems
from pipeline.engines.tiny_target import KIMI_ROPE_PARAMETERS
from pipeline.training.worker import drafter_arch
from tests.builders import (
    AUX,
    SMALL_MLA,
    kimi_like_run_config,
    kimi_like_target,
    small_mla_drafter,
    small_target,
)

KIMI_YARN = {key: value for key, value in KIMI_ROPE_PARAMETERS.items() if key != "rope_theta"}
SERVED = SpeculativeArgs("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4)
CONTRACT = {"aux_layer_ids": AUX, "hidden_size": 16, "num_layers": 6, "target": {"model_family": "deepseek"}}


def mla_target(directory, **changes):
    """A kimi_like_target with the MLA sizes small_mla_drafter has (2 heads, 16 wide)."""
    return kimi_like_target(directory, **{**SMALL_MLA, **changes})


def rms(x, weight, eps):
    return weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps))


def absorbed_mla(attn, x, positions):
    """SGLang's absorbed MLA (forward_mla.py:343-363, 586, 611, 912-953; kimi_k25_eagle3.py:516-520), by hand:
    scores q_nope W_UK c_kv + q_pe . k_pe and outputs W_UV (attn @ c_kv), never forming per-head keys or
    values; RoPE as complex rotation of (even, odd) pairs with transformers' YaRN frequencies; causal."""
    m, heads, eps = attn.shape, attn.arch.num_heads, attn.arch.rms_norm_eps
    length = x.shape[1]
    q = rms(x @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight, eps) @ attn.q_b_proj.weight.T
    q = q.view(length, heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
    q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
    latent = x @ attn.kv_a_proj_with_mqa.weight.T
    c_kv = rms(latent[0, :, : m.kv_lora_rank], attn.kv_a_layernorm.weight, eps)  # [T, kl]
    k_pe = latent[0, :, m.kv_lora_rank :]  # [T, qr]
    w = attn.kv_b_proj.weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    w_kc, w_vc = w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]
    inv_freq, _ = transformers_yarn(m.qk_rope_head_dim)
    angle = positions.float()[:, None] * inv_freq[None]  # [T, qr/2]
    rotation = torch.polar(torch.ones_like(angle), angle)

    def rotate(x_pe):  # (x[2i] + i x[2i+1]) * e^(i p f_i)
        pairs = torch.view_as_complex(x_pe.float().reshape(*x_pe.shape[:-1], -1, 2).contiguous())
        turned = pairs * (rotation[:, None] if pairs.dim() == 3 else rotation)
        return torch.view_as_real(turned).flatten(-2)

    q_pe, k_pe = rotate(q_pe), rotate(k_pe)
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w_kc)  # absorbed: q_nope W_UK
    scores = torch.einsum("thl,sl->hts", q_latent, c_kv) + torch.einsum("thr,sr->hts", q_pe, k_pe)
    mscale = 0.1 * 1.0 * math.log(KIMI_YARN["factor"]) + 1.0
    scores = scores * (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5 * mscale**2
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    out_latent = torch.einsum("hts,sl->thl", probs, c_kv)
    out = torch.einsum("thl,hvl->thv", out_latent, w_vc)  # absorbed: W_UV after attention
    return out.reshape(1, length, -1) @ attn.o_proj.weight.T


def transformers_yarn(rope_dim):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = DeepseekV3Config(
        hidden_size=32,
        num_attention_heads=2,
        qk_rope_head_dim=rope_dim,
        max_position_embeddings=262144,
        rope_parameters=dict(KIMI_ROPE_PARAMETERS),
    )
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


def test_mla_attention_is_the_absorbed_mla_sglang_serves():
    model = small_mla_drafter(rope_scaling=KIMI_YARN).eval()
    attn = model.midlayer.self_attn
    x = torch.randn(1, 7, 32)
    positions = torch.arange(3, 10)  # not from 0: the rotation must depend on the position
    with torch.no_grad():
        q, k, v = attn.project(x, positions)
        assert q.shape == k.shape == (1, 2, 7, 10) and v.shape == (1, 2, 7, 12)
        ours = attn.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        reference = absorbed_mla(attn, x, positions)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)


def test_mla_rope_frequencies_and_softmax_factor_are_transformers_deepseek_yarn():
    inv_freq, attention_factor = transformers_yarn(8)
    torch.testing.assert_close(mla_rope_frequencies(8, 50000.0, KIMI_YARN, 262144), inv_freq)
    assert attention_factor == pytest.approx(1.0)  # mscale == mscale_all_dim: cos/sin unscaled, as in SGLang
    assert mla_softmax_multiplier(KIMI_YARN) == pytest.approx((0.1 * math.log(64) + 1) ** 2)
    assert mla_softmax_multiplier(None) == 1.0


def test_the_drafter_of_a_deepseek_family_target_takes_its_mla_sizes(tmp_path):
    target = mla_target(tmp_path / "target", num_attention_heads=2)
    arch = drafter_arch(kimi_like_run_config(tmp_path, architecture="eagle3-mla"), target, AUX, 50)
    assert arch.architecture == "eagle3-mla" and arch.mla is not None
    assert (arch.mla.q_lora_rank, arch.mla.v_head_dim, arch.mla.rope_interleave) == (12, 12, True)
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "yarn"


def test_a_target_without_mla_is_refused_with_the_reason(tmp_path):
    config = kimi_like_run_config(tmp_path, architecture="eagle3-mla")
    with pytest.raises(MlaTargetRefused, match="needs a DeepSeek-family .* has no q_lora_rank, kv_lora_rank"):
        drafter_arch(config, small_target(tmp_path), AUX, 50)
    null_q = mla_target(tmp_path / "null-q", q_lora_rank=None)
    with pytest.raises(MlaTargetRefused, match="q_lora_rank null.*kimi_k25_eagle3.py:114-117"):
        drafter_arch(config, null_q, AUX, 50)


def test_mla_settings_the_target_gives_cannot_be_set_by_hand(tmp_path):
    with pytest.raises(
        ConfigError, match="drafter.head_dim does not apply to drafter.architecture eagle3-mla"
    ):
        load_config(
            data={
                "storage": {"root": str(tmp_path)},
                "drafter": {"architecture": "eagle3-mla", "head_dim": 8},
            }
        )


def exported_mla(tmp_path):
    model = small_mla_drafter(rope_scaling=KIMI_YARN)
    target = mla_target(tmp_path / "target", num_attention_heads=2)
    return model, target, export_drafter(model, CONTRACT, tmp_path / "drafter", "float32", target)


def test_export_writes_eagle3_deepseek_v2_for_causal_lm_and_loads_back(tmp_path):
    model, _, directory = exported_mla(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    assert (
        config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    )
    assert config["drafter_architecture"] == "eagle3-mla"
    assert {key: config[key] for key in SMALL_MLA} == SMALL_MLA and config["rope_interleave"] is True
    assert config["num_hidden_layers"] == 1 and config["hidden_act"] == "silu"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    tensors = load_file(str(directory / "model.safetensors"))
    assert tensors["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (8 + 4, 32)
    assert tensors["midlayer.self_attn.kv_b_proj.weight"].shape == (2 * (6 + 12), 8)
    assert not any(name.startswith("model.") or "fused" in name for name in tensors)
    loaded, _ = load_drafter(directory, model.embed_weight)
    assert loaded.arch.architecture == "eagle3-mla" and loaded.arch.mla == model.arch.mla
    aux, ids = torch.randn(1, 6, 48), torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        expected = [model.logits(h) for h in model.eval().ttt_forward(aux, ids, 2)]
        actual = [loaded.logits(h) for h in loaded.ttt_forward(aux, ids, 2)]
    for a, b in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, b)


def rewrite(directory, tensors=None, drop_keys=()):
    if tensors is not None:
        save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    for key in drop_keys:
        config.pop(key)
    (directory / "config.json").write_text(json.dumps(config))


def test_an_mla_export_passes_sglangs_load_checks(tmp_path):
    _, target, directory = exported_mla(tmp_path)
    assert draft_model_problems(target, directory, SERVED) == []


ATTN = "midlayer.self_attn"


def unpaired(tensors):
    tensors.pop(f"{ATTN}.kv_a_proj_with_mqa.weight")
    return tensors


def prefused(tensors):
    q, kv = tensors.pop(f"{ATTN}.q_a_proj.weight"), tensors.pop(f"{ATTN}.kv_a_proj_with_mqa.weight")
    tensors[f"{ATTN}.fused_qkv_a_proj_with_mqa.weight"] = torch.cat([q, kv])
    return tensors


def model_prefixed(tensors):
    return {(name if name in ("d2t", "t2d") else f"model.{name}"): t for name, t in tensors.items()}


def misshapen_kv_b(tensors):
    tensors[f"{ATTN}.kv_b_proj.weight"] = torch.zeros(2 * (6 + 6), 8)
    return tensors


@pytest.mark.parametrize(
    "damage, messages",
    [
        (
            unpaired,
            [
                "q_a_proj.weight has no partner midlayer.self_attn.kv_a_proj_with_mqa.weight",
                "kimi_k25_eagle3.py:467-492",
                "no tensor fills model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight",
            ],
        ),
        (prefused, ["fused_qkv_a_proj_with_mqa.weight has no partner", "keeps uninitialized memory"]),
        (
            model_prefixed,
            ["tensor model.fc.weight carries a model. prefix", "no tensor fills model.fc.weight"],
        ),
        (
            misshapen_kv_b,
            ["kv_b_proj.weight has shape [24, 8], but model.midlayer.self_attn.kv_b_proj.weight"],
        ),
    ],
)
def test_sglang_checks_catch_weights_its_mla_loader_drops_or_rejects(tmp_path, damage, messages):
    _, target, directory = exported_mla(tmp_path)
    rewrite(directory, damage(load_file(str(directory / "model.safetensors"))))
    problems = "\n".join(draft_model_problems(target, directory, SERVED))
    for message in messages:
        assert message in problems


def test_sglang_checks_catch_an_mla_size_left_to_deepseeks_default(tmp_path):
    _, target, directory = exported_mla(tmp_path)
    rewrite(directory, drop_keys=("v_head_dim",))
    problems = "\n".join(draft_model_problems(target, directory, SERVED))
    assert "draft config.json has no v_head_dim: SGLang 0.5.23 serves it broken" in problems
    assert "fills it with 128" in problems  # DeepseekV2Config's default
    assert "o_proj.weight has shape [16, 24]" in problems  # and the weights no longer fit


def test_the_drafter_format_refuses_a_missing_mla_key(tmp_path):
    _, _, directory = exported_mla(tmp_path)
    rewrite(directory, drop_keys=("kv_lora_rank",))
    with pytest.raises(DrafterFormatError, match="misses \\['kv_lora_rank'\\]"):
        read_drafter_dir(directory)


def test_vllm_takes_the_mla_latents_its_source_runs_and_no_engine_here_takes_a_tiny_one(tmp_path):
    """vLLM 0.32.0's MLA takes latents (kv_lora_rank + qk_rope_head_dim) of 320, 512 or 576, its CPU build 576
    only: Kimi's 512 + 64 loads in both, the tiny drafter's in neither, and a vLLM benchmark refuses it."""
    import json

    from pipeline.benchmark.job import BenchmarkFailed
    from pipeline.benchmark.vllm import vllm_loadable
    from pipeline.drafter.export import engine_refusals

    _, _, directory = exported_mla(tmp_path)
    tiny = json.loads((directory / "config.json").read_text())
    width = tiny["kv_lora_rank"] + tiny["qk_rope_head_dim"]
    assert no_engine_here({"architectures": ["LlamaForCausalLMEagle3"]}) is None
    here = no_engine_here(tiny)
    assert here is not None and here.startswith(
        f"no engine here loads this eagle3-mla drafter: its MLA latent is {width} wide"
    )
    assert "mla_attention.py:1600-1602" in here and "SGLang 0.5.23 serves it" in here
    assert "320, 512 or 576" in engine_refusals(tiny)["vllm"]
    kimi = {**tiny, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert engine_refusals(kimi) == {} and no_engine_here(kimi) is None
    gpu_only = {**tiny, "kv_lora_rank": 448, "qk_rope_head_dim": 64}  # 512 wide: not the CPU build's 576
    assert engine_refusals(gpu_only) == {} and "cpu_mla.py" in (no_engine_here(gpu_only) or "")
    with pytest.raises(
        BenchmarkFailed, match="cannot benchmark the candidate drafter .* eagle3-mla drafter: its MLA latent"
    ):
        vllm_loadable("candidate", directory, tmp_path / "work")
