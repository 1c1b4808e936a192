"""The drafter takes its context length, RoPE and vocabulary from the target's config, trains with the RoPE
SGLang 0.5.23 applies to the exported config, and export refuses what the target's server would refuse."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.drafter.export import export_drafter
from pipeline.drafter.rope import draft_rope, rope_cos_sin, target_rope
from pipeline.engines.sglang_draft_checks import DraftModelRefused, derived_context_length
from pipeline.engines.tiny_target import KIMI_ROPE_PARAMETERS
from pipeline.training.worker import drafter_arch
from tests.builders import AUX, drafter_for, kimi_like_run_config, kimi_like_target
from tests.conftest import KIMI_CONFIG

# Kimi-K2.5's published rope_scaling (its config.json, v4 layout): YaRN 64x over 4K pre-training positions
KIMI_K25_ROPE_SCALING = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def transformers_rope(parameters: dict, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """transformers' own RoPE initialisation for these settings: (inv_freq, attention factor)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=dict(parameters),
    )
    return ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, "cpu")


YARN_CASES = {
    "tiny Kimi target": dict(KIMI_ROPE_PARAMETERS),
    "Kimi-K2.5": {"rope_type": "yarn", "rope_theta": 50000.0, **KIMI_K25_ROPE_SCALING},
    "no mscale keys (attention factor 0.1 ln s + 1)": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "mscale != mscale_all_dim": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_the_drafters_rope_matches_an_independent_implementation(case):
    parameters = {key: value for key, value in YARN_CASES[case].items() if key != "type"}
    head_dim, factor = 64, parameters["factor"]
    max_positions = int(parameters.get("original_max_position_embeddings", 4096) * factor)
    theta, scaling = target_rope({"rope_parameters": parameters, "max_position_embeddings": max_positions})
    inv_freq, attention_factor = transformers_rope(parameters, head_dim, max_positions)
    positions = torch.tensor([0, 1, 17, 4095, 4096, 65537, max_positions - 1])
    cos, sin = rope_cos_sin(positions, head_dim, theta, torch.float64, scaling, max_positions)
    # SGLang fills its cos/sin cache from float32 positions times float32 frequencies
    angles = (positions.float()[:, None] * inv_freq.float()[None, :]).double()
    torch.testing.assert_close(
        cos, torch.cat([angles.cos()] * 2, dim=-1) * attention_factor, rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        sin, torch.cat([angles.sin()] * 2, dim=-1) * attention_factor, rtol=0, atol=1e-6
    )


def test_sglang_ignores_transformers_attention_factor_and_so_does_the_drafter():
    # SGLang's get_rope forwards attn_factor, not transformers' attention_factor (layers/rotary_embedding)
    base = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    positions = torch.arange(5)
    plain = rope_cos_sin(positions, 16, 10000.0, torch.float32, base, 32768)
    with_hf_key = rope_cos_sin(
        positions, 16, 10000.0, torch.float32, {**base, "attention_factor": 3.0}, 32768
    )
    with_sglang_key = rope_cos_sin(positions, 16, 10000.0, torch.float32, {**base, "attn_factor": 3.0}, 32768)
    torch.testing.assert_close(with_hf_key, plain)
    torch.testing.assert_close(with_sglang_key[0], plain[0] * 3.0)
    assert math.isclose(
        float(plain[0][1, 0] ** 2 + plain[1][1, 0] ** 2), (0.1 * math.log(4) + 1) ** 2, rel_tol=1e-5
    )


def test_both_config_layouts_give_the_same_rope():
    v4 = {"rope_theta": 50000.0, "rope_scaling": dict(KIMI_K25_ROPE_SCALING)}
    v5 = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, **KIMI_K25_ROPE_SCALING}}
    v5["rope_parameters"].pop("type")
    assert (
        target_rope(v4)
        == target_rope(v5)
        == (
            50000.0,
            {"rope_type": "yarn", **{k: v for k, v in KIMI_K25_ROPE_SCALING.items() if k != "type"}},
        )
    )
    assert target_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None)
    assert target_rope({}) == (10000.0, None)


def test_a_rope_type_the_drafter_does_not_reproduce_becomes_plain_rope_over_the_targets_context():
    target = {"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 4.0}}
    context = derived_context_length(target)
    assert context == 16384
    assert draft_rope(target, context) == (10000.0, None, 16384)


def test_the_drafter_of_a_kimi_like_target_takes_its_context_and_rope(tmp_path):
    target_dir = kimi_like_target(tmp_path / "target")
    model = drafter_for(tmp_path, target_dir)
    arch = model.arch
    assert arch.max_position_embeddings == 262144 and arch.vocab_size == 50
    assert arch.rope_theta == 50000.0
    assert arch.rope_scaling == {k: v for k, v in KIMI_ROPE_PARAMETERS.items() if k != "rope_theta"}
    # the attention rotates queries and keys as SGLang's YaRN does (checked against transformers above)
    positions = torch.tensor([0, 5, 100_000])
    inv_freq, attention_factor = transformers_rope(KIMI_ROPE_PARAMETERS, 8, 262144)
    cos, _ = rope_cos_sin(positions, 8, arch.rope_theta, torch.float32, arch.rope_scaling, 262144)
    angles = positions.float()[:, None] * inv_freq[None, :]
    torch.testing.assert_close(
        cos, torch.cat([angles.cos()] * 2, dim=-1) * attention_factor, rtol=0, atol=1e-4
    )


def test_export_carries_the_targets_context_and_rope_and_sglang_would_serve_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    target_dir = kimi_like_target(tmp_path / "target")
    model = drafter_for(tmp_path, target_dir)
    directory = export_drafter(
        model, {"aux_layer_ids": AUX, "hidden_size": 16}, tmp_path / "d", "float32", target_dir
    )
    config = json.loads((directory / "config.json").read_text())
    assert config["max_position_embeddings"] == 262144
    assert config["rope_theta"] == 50000.0
    assert config["rope_scaling"] == {k: v for k, v in KIMI_ROPE_PARAMETERS.items() if k != "rope_theta"}
    assert json.loads((directory / "target_config.json").read_text()) == json.loads(
        (target_dir / "config.json").read_text()
    )
    # SGLang reads the exported config through transformers: the same context length as the target
    from transformers import AutoConfig

    assert derived_context_length(AutoConfig.from_pretrained(str(directory))) == 262144


def test_export_refuses_a_drafter_the_targets_server_would_refuse(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    target_dir = kimi_like_target(tmp_path / "target")
    model = drafter_for(tmp_path, target_dir)
    model.arch.max_position_embeddings, model.arch.rope_scaling = (
        131072,
        None,
    )  # a hand-set context, as before
    with pytest.raises(
        DraftModelRefused, match="derived context length 131072 .* shorter than the target's 262144"
    ):
        export_drafter(
            model, {"aux_layer_ids": AUX, "hidden_size": 16}, tmp_path / "d", "float32", target_dir
        )
    assert not (tmp_path / "d").exists()


def test_a_draft_vocabulary_larger_than_the_targets_is_refused(tmp_path):
    target_dir = kimi_like_target(tmp_path / "target")
    with pytest.raises(ValueError, match="exceeds the target's vocab_size 50"):
        drafter_arch(kimi_like_run_config(tmp_path), target_dir, AUX, 64)


@pytest.mark.parametrize("setting", ["max_position_embeddings=131072", "rope_theta=50000", "vocab_size=1000"])
def test_a_hand_set_context_rope_or_vocabulary_is_refused_in_the_run_config(setting):
    with pytest.raises(
        ConfigError, match=f"drafter.{setting.split('=')[0]} is not a setting.*from the target"
    ):
        load_config(KIMI_CONFIG, [f"drafter.{setting}"])


def test_a_loaded_yarn_drafter_runs_the_rope_it_was_trained_with(tmp_path):
    from pipeline.drafter.export import load_drafter

    target_dir = kimi_like_target(tmp_path / "target")
    model = drafter_for(tmp_path, target_dir).eval()
    contract = {"aux_layer_ids": AUX, "hidden_size": 16}
    directory = export_drafter(model, contract, tmp_path / "d", "float32", target_dir)
    loaded, _ = load_drafter(directory, model.embed_weight)
    assert loaded.arch.rope_scaling == model.arch.rope_scaling and loaded.arch.rope_theta == 50000.0
    aux, ids = torch.randn(1, 64, 48), torch.randint(0, 50, (1, 64))  # positions where YaRN differs
    with torch.no_grad():
        for expected, actual in zip(
            model.ttt_forward(aux, ids, 2), loaded.ttt_forward(aux, ids, 2), strict=True
        ):
            torch.testing.assert_close(loaded.logits(actual), model.logits(expected))
