"""One exported drafter directory for SGLang and vLLM: each engine's aux layer ids in config.json, computed by
pipeline.engines.layer_ids from the layers the features came from, and the reader refusing lists that
disagree."""

import json

import pytest

from pipeline.drafter.export import (
    DrafterFormatError,
    EngineNotExported,
    copy_with_layer_ids,
    engine_layer_ids,
    export_drafter,
    exported_for,
    read_drafter_dir,
    require_exported_for,
    written_layer_ids,
)
from pipeline.engines.layer_ids import captured_layer_outputs
from tests.builders import small_drafter


def contract(layers: list[int], family: str, num_layers: int) -> dict:
    return {
        "aux_layer_ids": layers,
        "num_layers": num_layers,
        "hidden_size": 16,
        "target": {"name": f"tiny-{family}", "model_family": family},
    }


def export(tmp_path, layers: list[int], family: str, num_layers: int, name: str = "drafter"):
    drafter = small_drafter(aux_layer_ids=layers)
    return export_drafter(drafter, contract(layers, family, num_layers), tmp_path / name, "float32")


def config_of(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize(
    "family, num_layers, layers, sglang_ids, vllm_ids",
    [
        # Llama: SGLang's id k is layer k's output (llama.py:938-941), vLLM's id k is layer k's input
        ("llama", 7, [1, 3, 4], [1, 3, 4], [2, 4, 5]),
        # DeepSeek / Kimi: SGLang shifts only ids starting with 1 (deepseek_v2.py:3470-3473)
        ("deepseek", 61, [1, 29, 57], [1, 29, 57], [2, 30, 58]),
        ("deepseek", 61, [2, 30, 58], [3, 31, 59], [3, 31, 59]),
    ],
)
def test_config_json_gives_each_engine_the_ids_that_capture_the_trained_layers(
    tmp_path, family, num_layers, layers, sglang_ids, vllm_ids
):
    directory = export(tmp_path, layers, family, num_layers)
    config = config_of(directory)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == sglang_ids
    assert config["eagle_aux_hidden_state_layer_ids"] == vllm_ids
    assert exported_for(config) == ["sglang", "vllm"]
    for engine, ids in (("sglang", sglang_ids), ("vllm", vllm_ids)):
        assert engine_layer_ids(contract(layers, family, num_layers), engine) == ids
        assert written_layer_ids(config, engine) == ids
        assert captured_layer_outputs(engine, family, ids, num_layers) == layers
    read_config, _, read_contract = read_drafter_dir(directory)
    assert read_config == config and read_contract["aux_layer_ids"] == layers


def test_a_directory_whose_two_lists_name_different_layers_is_refused(tmp_path):
    """SGLang's ids at the top level too: how the drafter exported for SGLang alone loads in vLLM, fed the
    outputs of the layers below the trained ones."""
    layers = [1, 3, 4]
    directory = export(tmp_path, layers, "llama", 7)
    unshifted = copy_with_layer_ids(
        directory, tmp_path / "unshifted", "vllm", engine_layer_ids(contract(layers, "llama", 7), "sglang")
    )
    assert config_of(unshifted)["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    with pytest.raises(DrafterFormatError) as refused:
        read_drafter_dir(unshifted)
    message = str(refused.value)
    assert "aux layer id lists disagree" in message
    sglang = "eagle_config.eagle_aux_hidden_state_layer_ids [1, 3, 4] make SGLang capture the outputs of"
    vllm = "top-level eagle_aux_hidden_state_layer_ids [1, 3, 4] make vLLM capture the outputs of"
    assert f"{sglang} layers [1, 3, 4]" in message and f"{vllm} layers [0, 2, 3]" in message
    assert "vLLM would feed it other layers than it was trained on" in message
    assert "SGLang would feed it" not in message


def test_lists_that_agree_with_each_other_but_not_with_the_contract_are_refused(tmp_path):
    directory = export(tmp_path, [1, 3, 4], "llama", 7)
    shifted = copy_with_layer_ids(directory, tmp_path / "both-shifted", "sglang", [2, 4, 5])
    shifted = copy_with_layer_ids(shifted, tmp_path / "both-shifted-again", "vllm", [3, 5, 6])
    with pytest.raises(DrafterFormatError) as refused:
        read_drafter_dir(shifted)
    message = str(refused.value)
    assert "disagree with capture_contract.json's layers [1, 3, 4]" in message
    assert "SGLang would feed it other layers" in message and "vLLM would feed it other layers" in message
    assert "lists disagree" not in message  # both name layers 2, 4, 5


def test_a_directory_exported_before_vllm_ids_reads_as_sglang_only(tmp_path):
    directory = export(tmp_path, [1, 3, 4], "llama", 7)
    config = config_of(directory)
    del config["eagle_aux_hidden_state_layer_ids"]
    (directory / "config.json").write_text(json.dumps(config))
    read_config, _, _ = read_drafter_dir(directory)
    assert exported_for(read_config) == ["sglang"]
    assert written_layer_ids(read_config, "vllm") is None
    assert require_exported_for(read_config, "sglang") == [1, 3, 4]
    with pytest.raises(EngineNotExported, match="no vLLM aux layer ids .*Re-export it"):
        require_exported_for(read_config, "vllm", directory)


@pytest.mark.parametrize("ids", [[2, 4], "2,4,5", [2.0, 4.0, 5.0]])
def test_a_malformed_vllm_list_is_refused(tmp_path, ids):
    directory = copy_with_layer_ids(export(tmp_path, [1, 3, 4], "llama", 7), tmp_path / "bad", "vllm", [0])
    config = config_of(directory)
    config["eagle_aux_hidden_state_layer_ids"] = ids
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match="must be a list of 3 integers like eagle_config's"):
        read_drafter_dir(directory)
