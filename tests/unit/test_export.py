"""The SGLang drafter directory: validated export, round trip, refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.drafter.export import DrafterFormatError, export_drafter, load_drafter, read_drafter_dir
from tests.builders import small_drafter

CONTRACT = {"aux_layer_ids": [1, 2, 3], "hidden_size": 16}


def exported(tmp_path, dtype="float32"):
    model = small_drafter()
    return model, export_drafter(model, CONTRACT, tmp_path / "drafter", dtype)


def test_export_writes_what_sglang_and_vllm_load(tmp_path):
    _, directory = exported(tmp_path, "bfloat16")
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "use_aux_hidden_state": True,
    }
    # vLLM reads the top-level list first, and counts layer k's input as id k (Llama: SGLang's ids + 1)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    tensors = load_file(str(directory / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and not any("embed" in k for k in tensors)
    assert tensors["fc.weight"].shape == (16, 48) and tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (16, 32)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


def test_round_trip_gives_the_same_logits(tmp_path):
    model, directory = exported(tmp_path)
    loaded, contract = load_drafter(directory, model.embed_weight)
    assert contract == CONTRACT
    aux, ids = torch.randn(1, 6, 48), torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        expected = [model.logits(h) for h in model.eval().ttt_forward(aux, ids, 2)]
        actual = [loaded.logits(h) for h in loaded.ttt_forward(aux, ids, 2)]
    for a, b in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop("midlayer.mlp.up_proj.weight"), "missing tensor midlayer.mlp.up_proj.weight"),
        (lambda t: t.__setitem__("fc.weight", torch.zeros(16, 32)), "fc.weight has shape"),
        (lambda t: t.__setitem__("embed_tokens.weight", torch.zeros(50, 16)), "unexpected tensor"),
        (lambda t: t.__setitem__("d2t", t["d2t"].to(torch.int32)), "d2t must be int64"),
        (lambda t: t.__setitem__("norm.weight", torch.full((16,), float("nan"))), "non-finite"),
    ],
)
def test_broken_drafter_directories_are_refused(tmp_path, damage, message):
    _, directory = exported(tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(DrafterFormatError, match=message):
        read_drafter_dir(directory)


def test_export_refuses_a_contract_with_other_layers(tmp_path):
    with pytest.raises(DrafterFormatError, match="disagree"):
        export_drafter(small_drafter(), {"aux_layer_ids": [2, 3, 4]}, tmp_path / "d")


def test_missing_config_keys_are_refused(tmp_path):
    _, directory = exported(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    del config["eagle_config"]["use_aux_hidden_state"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match="use_aux_hidden_state"):
        read_drafter_dir(directory)
