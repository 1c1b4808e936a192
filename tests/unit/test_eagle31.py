"""EAGLE-3.1's norms (drafter.architecture eagle3.1): fc_norm and norm_output against by-hand references, and
the export's recorded flags, round trip and refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.drafter.export import DrafterFormatError, export_drafter, load_drafter, read_drafter_dir
from pipeline.drafter.model import DraftCache
from tests.builders import small_drafter

CONTRACT = {"aux_layer_ids": [1, 2, 3], "hidden_size": 16}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_fc_norm_normalizes_each_aux_state_with_its_own_weight_before_fc():
    model = small_drafter(architecture="eagle3.1")
    aux = torch.randn(2, 5, 48) * torch.tensor([1.0] * 16 + [7.0] * 16 + [0.1] * 16)
    eps = model.arch.rms_norm_eps
    weights = [model.fc_norm[i].weight for i in range(3)]
    by_hand = torch.cat([rms_norm(aux[..., 16 * i : 16 * (i + 1)], weights[i], eps) for i in range(3)], -1)
    with torch.no_grad():
        torch.testing.assert_close(model.project_aux(aux), by_hand @ model.fc.weight.T)
        # eagle3 has no fc_norm: fc sees the raw features
        plain = small_drafter()
        assert plain.fc_norm is None
        torch.testing.assert_close(plain.project_aux(aux), aux @ plain.fc.weight.T)


def layer_by_hand(model, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """One draft step at position 0 over an empty cache, written out: attention over a single key is its
    value, so the layer is o_proj(v) + MLP."""
    layer, eps = model.midlayer, model.arch.rms_norm_eps
    x = torch.cat(
        [
            rms_norm(model.embed(token), layer.input_layernorm.weight, eps),
            rms_norm(hidden, layer.hidden_norm.weight, eps),
        ],
        -1,
    )
    v = x @ layer.self_attn.v_proj.weight.T  # one kv head, repeated for both query heads
    attended = torch.cat([v, v], -1) @ layer.self_attn.o_proj.weight.T
    h = hidden + attended
    m = rms_norm(h, layer.post_attention_layernorm.weight, eps)
    return h + layer.mlp.down_proj(torch.nn.functional.silu(layer.mlp.gate_proj(m)) * layer.mlp.up_proj(m))


@pytest.mark.parametrize("architecture, carries_norm", [("eagle3", False), ("eagle3.1", True)])
def test_a_draft_step_carries_the_post_norm_state_only_with_norm_output(architecture, carries_norm):
    model = small_drafter(architecture=architecture).eval()
    h_out = torch.randn(1, 1, 16)
    token = torch.tensor([[7]])
    carried = rms_norm(h_out, model.norm.weight, model.arch.rms_norm_eps) if carries_norm else h_out
    with torch.no_grad():
        stepped = model.decode(h_out, token, 0, DraftCache())
        torch.testing.assert_close(stepped, layer_by_hand(model, carried, token), rtol=1e-4, atol=1e-5)
        # the logits always read norm(h_out), whatever is carried
        by_hand = rms_norm(h_out, model.norm.weight, model.arch.rms_norm_eps) @ model.lm_head.weight.T
        torch.testing.assert_close(model.logits(h_out), by_hand, rtol=1e-4, atol=1e-5)


def test_decode_rows_carries_as_decode_does():
    model = small_drafter(architecture="eagle3.1").eval()
    h_out, token = torch.randn(1, 1, 16), torch.tensor([[3]])
    with torch.no_grad():
        rows, _, _ = model.decode_rows(
            h_out, token, torch.zeros(1, 1, dtype=torch.long), None, torch.zeros(1, 1, 1, 1)
        )
        torch.testing.assert_close(rows, model.decode(h_out, token, 0, DraftCache()))


def exported31(tmp_path, dtype="float32"):
    model = small_drafter(architecture="eagle3.1")
    return model, export_drafter(model, CONTRACT, tmp_path / "drafter", dtype)


def test_export_records_the_flags_at_the_top_level_and_writes_fc_norm_weights(tmp_path):
    _, directory = exported31(tmp_path, "bfloat16")
    config = json.loads((directory / "config.json").read_text())
    assert (config["fc_norm"], config["norm_before_fc"], config["norm_output"]) == (True, False, True)
    assert config["drafter_architecture"] == "eagle3.1"
    assert "fc_norm" not in config["eagle_config"] and "norm_output" not in config["eagle_config"]
    tensors = load_file(str(directory / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in tensors.items() if name.startswith("fc_norm")} == {
        f"fc_norm.{i}.weight": (16,) for i in range(3)
    }


def test_an_eagle3_export_records_the_flags_off_and_no_fc_norm_weights(tmp_path):
    directory = export_drafter(small_drafter(), CONTRACT, tmp_path / "drafter", "float32")
    config = json.loads((directory / "config.json").read_text())
    assert (config["fc_norm"], config["norm_before_fc"], config["norm_output"]) == (False, False, False)
    assert config["drafter_architecture"] == "eagle3"
    assert not any(name.startswith("fc_norm") for name in load_file(str(directory / "model.safetensors")))


def test_eagle31_round_trip_keeps_the_flags_and_the_chain(tmp_path):
    model, directory = exported31(tmp_path)
    loaded, _ = load_drafter(directory, model.embed_weight)
    assert (loaded.arch.architecture, loaded.arch.fc_norm, loaded.arch.norm_output) == (
        "eagle3.1",
        True,
        True,
    )
    aux, ids = torch.randn(1, 6, 48), torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        expected = [model.logits(h) for h in model.eval().ttt_forward(aux, ids, 3)]
        actual = [loaded.logits(h) for h in loaded.ttt_forward(aux, ids, 3)]
    for a, b in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_a_drafter_exported_before_the_flags_were_recorded_loads_as_eagle3(tmp_path):
    model = small_drafter()
    directory = export_drafter(model, CONTRACT, tmp_path / "drafter", "float32")
    config = json.loads((directory / "config.json").read_text())
    for key in ("fc_norm", "norm_before_fc", "norm_output", "drafter_architecture"):
        config.pop(key)
    (directory / "config.json").write_text(json.dumps(config))
    loaded, _ = load_drafter(directory, model.embed_weight)
    assert (loaded.arch.architecture, loaded.arch.fc_norm, loaded.arch.norm_output) == (
        "eagle3",
        False,
        False,
    )


def edit(directory, config_changes=None, tensor_change=None):
    if config_changes is not None:
        config = json.loads((directory / "config.json").read_text())
        config.update(config_changes)
        (directory / "config.json").write_text(json.dumps(config))
    if tensor_change is not None:
        tensors = load_file(str(directory / "model.safetensors"))
        tensor_change(tensors)
        save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize(
    "config_changes, tensor_change, message",
    [
        (
            None,
            lambda t: t.pop("fc_norm.2.weight"),
            "config.json sets fc_norm but fc_norm weights are missing",
        ),
        (
            {"fc_norm": False, "drafter_architecture": "eagle3", "norm_output": False},
            None,
            "the weights hold fc_norm tensors but config.json's fc_norm is not true",
        ),
        (
            {"norm_output": False},
            None,
            "has fc_norm/norm_output (True, True), but the flags say (True, False)",
        ),
        ({"norm_before_fc": True}, None, "config.json sets norm_before_fc"),
        ({"use_aux_norm": True}, None, "vLLM ignores it"),
        ({"fc_norm": "yes"}, None, "fc_norm must be true or false"),
        ({"drafter_architecture": "eagle9"}, None, "'eagle9' is not one this model loads"),
    ],
)
def test_flags_and_tensors_that_disagree_are_refused(tmp_path, config_changes, tensor_change, message):
    _, directory = exported31(tmp_path)
    edit(directory, config_changes, tensor_change)
    with pytest.raises(DrafterFormatError, match=None) as refused:
        read_drafter_dir(directory)
    assert message in str(refused.value)


def test_an_unknown_architecture_is_refused_by_the_model():
    with pytest.raises(ValueError, match="known: eagle3, eagle3.1, eagle3-mla"):
        small_drafter(architecture="eagle4")
    with pytest.raises(ValueError, match="needs its MLA sizes"):
        small_drafter(architecture="eagle3-mla")
