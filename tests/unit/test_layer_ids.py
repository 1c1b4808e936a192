"""Which layer outputs SGLang 0.5.23 and vLLM capture for a draft config's aux layer ids, per model family
(pipeline.engines.layer_ids), and everything that writes or reads such ids agreeing with it: export, the
draft checks, the capture-server check, the stand-in server, HF capture and the config checks."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pipeline.engines.layer_ids import (
    LayerIdsInexpressible,
    captured_layer_outputs,
    draft_config_ids,
    hf_hidden_states_indices,
    model_family,
)

KIMI_TEXT = {"model_type": "kimi_k2", "num_hidden_layers": 61, "kv_lora_rank": 512, "hidden_size": 7168}


# ---- the model family --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, family",
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "llama"),
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "llama"),
        ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "deepseek"),
        ({"architectures": ["DeepseekV2ForCausalLM"]}, "deepseek"),
        ({"model_type": "deepseek_v32"}, "deepseek"),
        # Kimi-K2.5: a multimodal wrapper around DeepSeek-V3, the language model under text_config
        ({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": KIMI_TEXT}, "deepseek"),
        ({"architectures": ["SomethingNew"], "text_config": {"model_type": "deepseek_v3"}}, "deepseek"),
        # the project's tiny Kimi-style target: DeepSeek-V3 (MLA) under its own names
        (
            {"architectures": ["TinyKimiForCausalLM"], "model_type": "tiny_kimi", "kv_lora_rank": 16},
            "deepseek",
        ),
    ],
)
def test_the_model_family_comes_from_the_targets_config(config, family):
    assert model_family(config) == family


# ---- ids -> captured layer outputs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "engine, family, ids, num_layers, outputs",
    [
        # SGLang, Llama family: every id + 1 is a capture point, i.e. id k captures the output of layer k
        ("sglang", "llama", [1, 29, 57], 61, [1, 29, 57]),
        ("sglang", "llama", [2, 30, 58], 61, [2, 30, 58]),
        ("sglang", "llama", [0, 3, 5], 8, [0, 3, 5]),
        ("sglang", "llama", None, 61, [1, 29, 57]),  # the default points [2, N//2, N-3]
        ("sglang", "llama", [5, 1, 3], 8, [1, 3, 5]),  # captured in layer order whatever the order given
        ("sglang", "llama", [3, 3, 5], 8, [3, 5]),  # a repeated point is captured once
        ("sglang", "llama", [1, 3, 7], 8, [1, 3]),  # point 8 = the last layer's output is never reached
        ("sglang", "llama", [-1, 3, 5], 8, [-1, 3, 5]),  # point 0 is the embedding output
        # SGLang, DeepSeek family: shifted only when the first id is 1
        ("sglang", "deepseek", [1, 29, 57], 61, [1, 29, 57]),
        ("sglang", "deepseek", [2, 30, 58], 61, [1, 29, 57]),
        ("sglang", "deepseek", [3, 31, 59], 61, [2, 30, 58]),
        ("sglang", "deepseek", [2, 29, 57], 61, [1, 28, 56]),
        ("sglang", "deepseek", [1, 2, 3], 6, [1, 2, 3]),
        ("sglang", "deepseek", [3, 1, 2], 6, [0, 1, 2]),  # first id 3: unshifted, in layer order
        ("sglang", "deepseek", None, 61, [1, 29, 57]),
        ("sglang", "deepseek", [0, 29, 57], 61, [-1, 28, 56]),  # first id 0: point 0, the embeddings
        ("sglang", "deepseek", [1, 1, 57], 61, [1, 57]),
        ("sglang", "deepseek", [2, 30, 61], 61, [1, 29]),  # point 61 is past the last layer
        ("sglang", "deepseek", [1, 30, 60], 61, [1, 30]),  # shifted: 60 -> point 61
        # vLLM: ids are points as given, every family
        ("vllm", "llama", [1, 29, 57], 61, [0, 28, 56]),
        ("vllm", "deepseek", [1, 29, 57], 61, [0, 28, 56]),
        ("vllm", "deepseek", [2, 30, 58], 61, [1, 29, 57]),
        ("vllm", "llama", None, 61, [1, 29, 57]),
        ("vllm", "llama", [2, 2, 61], 61, [1]),
    ],
)
def test_captured_layer_outputs(engine, family, ids, num_layers, outputs):
    assert captured_layer_outputs(engine, family, ids, num_layers) == outputs


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_the_ids_found_capture_exactly_the_layers_asked_for(engine, family):
    num_layers, inexpressible = 8, []
    for outputs in map(list, itertools.combinations(range(num_layers - 1), 3)):
        try:
            ids = draft_config_ids(engine, family, outputs, num_layers)
        except LayerIdsInexpressible:
            inexpressible.append(outputs)
            continue
        assert captured_layer_outputs(engine, family, ids, num_layers) == outputs, (outputs, ids)
    # only SGLang's DeepSeek rule cannot start at layer 0's output: id 1 switches the shift on, 0 is point 0
    expected = (
        [o for o in map(list, itertools.combinations(range(num_layers - 1), 3)) if o[0] == 0]
        if (engine, family) == ("sglang", "deepseek")
        else []
    )
    assert inexpressible == expected


@pytest.mark.parametrize(
    "engine, family, outputs, ids",
    [
        ("sglang", "llama", [1, 29, 57], [1, 29, 57]),
        ("sglang", "llama", [2, 30, 58], [2, 30, 58]),
        ("sglang", "llama", [0, 30, 58], [0, 30, 58]),
        ("sglang", "deepseek", [1, 29, 57], [1, 29, 57]),  # Kimi-K2.5's ids mean the same on both rules
        ("sglang", "deepseek", [2, 30, 58], [3, 31, 59]),
        ("vllm", "llama", [1, 29, 57], [2, 30, 58]),
        ("vllm", "deepseek", [2, 30, 58], [3, 31, 59]),
    ],
)
def test_draft_config_ids(engine, family, outputs, ids):
    assert draft_config_ids(engine, family, outputs, 61) == ids


@pytest.mark.parametrize(
    "engine, family, outputs, why",
    [
        ("sglang", "deepseek", [0, 29, 57], "the first id decides whether SGLang shifts"),
        ("sglang", "llama", [1, 29, 60], "the last capturable output is layer 59's"),
        ("sglang", "deepseek", [1, 29, 61], "the last capturable output is layer 59's"),
        ("vllm", "llama", [1, 29, 60], "the last capturable output is layer 59's"),
        ("sglang", "llama", [-1, 29, 57], "layer ids start at 0"),
        ("sglang", "deepseek", [1, 29, 29], "distinct and ascending"),
        ("vllm", "deepseek", [29, 1, 57], "distinct and ascending"),
        ("sglang", "llama", [], "no layers given"),
    ],
)
def test_layers_no_ids_can_capture_are_refused_with_the_reason(engine, family, outputs, why):
    with pytest.raises(LayerIdsInexpressible) as refused:
        draft_config_ids(engine, family, outputs, 61)
    message = str(refused.value)
    assert isinstance(refused.value, ValueError)
    assert why in message and engine in message and f"({family} family)" in message
    assert str(outputs) in message


def test_unknown_engines_and_families_are_refused():
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        captured_layer_outputs("tgi", "llama", None, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown model family 'gpt'"):
        draft_config_ids("sglang", "gpt", [1, 2, 3], 8)  # type: ignore[arg-type]


def test_hf_hidden_state_indices_are_the_layer_outputs_plus_one():
    assert hf_hidden_states_indices([1, 29, 57], 61) == [2, 30, 58]
    with pytest.raises(LayerIdsInexpressible, match="last capturable output is layer 5's"):
        hf_hidden_states_indices([1, 3, 6], 7)


# ---- export and the draft checks ---------------------------------------------------------------------------


def deepseek_target(directory: Path, num_layers: int = 61, hidden: int = 16, vocab: int = 50) -> Path:
    """A DeepSeek-V3 target's config.json (all the draft checks read of a target)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": num_layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "kv_lora_rank": 8,
        "max_position_embeddings": 2048,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def drafter_trained_on(layers: list[int], vocab: int = 50, hidden: int = 16):
    from tests.builders import small_drafter

    return small_drafter(vocab=vocab, hidden=hidden, aux_layer_ids=layers)


def deepseek_contract(layers: list[int], num_layers: int = 61) -> dict:
    return {
        "aux_layer_ids": layers,
        "num_layers": num_layers,
        "hidden_size": 16,
        "target": {"name": "kimi-like", "model_family": "deepseek"},
    }


def test_a_deepseek_drafter_is_exported_with_the_ids_sglang_maps_back_to_its_layers(tmp_path):
    from pipeline.drafter.export import export_drafter, load_drafter
    from pipeline.engines.sglang_draft_checks import SpeculativeArgs, draft_model_problems

    model = drafter_trained_on([2, 30, 58])
    directory = export_drafter(model, deepseek_contract([2, 30, 58]), tmp_path / "drafter", "float32")
    written = json.loads((directory / "config.json").read_text())["eagle_config"]
    assert written["eagle_aux_hidden_state_layer_ids"] == [3, 31, 59]
    assert captured_layer_outputs("sglang", "deepseek", [3, 31, 59], 61) == [2, 30, 58]
    target = deepseek_target(tmp_path / "target")
    served = SpeculativeArgs("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4)
    assert draft_model_problems(target, directory, served) == []
    loaded, contract = load_drafter(directory, model.embed_weight)
    assert loaded.arch.aux_layer_ids == [2, 30, 58] and contract["aux_layer_ids"] == [2, 30, 58]


def test_kimis_own_layers_are_exported_unchanged_and_a_llama_contract_keeps_its_ids(tmp_path):
    from pipeline.drafter.export import export_drafter

    for name, contract in (
        ("kimi", deepseek_contract([1, 29, 57])),
        ("llama", {**deepseek_contract([2, 30, 58]), "target": {"model_family": "llama"}}),
    ):
        model = drafter_trained_on(contract["aux_layer_ids"])
        directory = export_drafter(model, contract, tmp_path / name, "float32")
        eagle = json.loads((directory / "config.json").read_text())["eagle_config"]
        assert eagle["eagle_aux_hidden_state_layer_ids"] == contract["aux_layer_ids"]


def test_a_deepseek_drafter_with_unshifted_ids_is_refused_by_the_reader_and_the_draft_checks(tmp_path):
    from pipeline.drafter.export import DrafterFormatError, export_drafter, read_drafter_dir
    from pipeline.engines.sglang_draft_checks import SpeculativeArgs, draft_model_problems

    directory = export_drafter(
        drafter_trained_on([2, 30, 58]), deepseek_contract([2, 30, 58]), tmp_path / "drafter", "float32"
    )
    config = json.loads((directory / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 30, 58]  # what export wrote before
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match="SGLang would feed it other layers"):
        read_drafter_dir(directory)
    [problem] = draft_model_problems(
        deepseek_target(tmp_path / "target"), directory, SpeculativeArgs("EAGLE3", 3, 1, 4)
    )
    assert "trained on the outputs of layers [2, 30, 58]" in problem
    assert "captures the outputs of layers [1, 29, 57]" in problem


def test_export_refuses_layers_sglang_cannot_feed_a_deepseek_drafter(tmp_path):
    from pipeline.drafter.export import DrafterFormatError, export_drafter

    with pytest.raises(DrafterFormatError, match="first id decides whether SGLang shifts"):
        export_drafter(drafter_trained_on([0, 30, 58]), deepseek_contract([0, 30, 58]), tmp_path / "d")


# ---- capture servers, the stand-in, HF capture -------------------------------------------------------------


def test_capture_servers_are_read_with_the_targets_family():
    from pipeline.engines.sglang import capture_server_problems

    def server(ids):
        return {
            "version": "0.5.23",
            "enable_return_hidden_states": True,
            "enable_return_aux_hidden_states": True,
            "return_aux_hidden_state_layer_ids": ids,
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
        }

    def problems(ids, contract):
        return capture_server_problems(server(ids), contract, 61, 4096, True, False, family="deepseek")

    assert problems([3, 31, 59], [2, 30, 58]) == []
    assert problems([1, 29, 57], [1, 29, 57]) == []
    assert problems(None, [1, 29, 57]) == []
    [problem] = problems([2, 30, 58], [2, 30, 58])
    assert "captures aux layers [1, 29, 57]" in problem
    assert "start it with --return-aux-hidden-state-layer-ids 3 31 59" in problem
    [problem] = problems([1, 29, 57], [0, 29, 57])
    assert "no --return-aux-hidden-state-layer-ids (the first id decides" in problem


# ---- the config checks -------------------------------------------------------------------------------------


def test_a_tiny_deepseek_config_whose_layers_sglang_cannot_capture_is_refused(tmp_path):
    from pydantic import ValidationError

    from pipeline.config import RunConfig
    from tests.conftest import storage_config, tiny_config_dict

    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["target"]["trust_remote_code"] = True
    data["target"]["tiny"]["architecture"] = "deepseek_v3"
    data["capture"]["aux_layer_ids"] = [0, 2, 4]
    with pytest.raises(ValidationError, match="sglang cannot capture the outputs of layers \\[0, 2, 4\\]"):
        RunConfig(**data)
    data["capture"]["aux_layer_ids"] = [1, 2, 4]
    assert RunConfig(**data).capture.aux_layer_ids == [1, 2, 4]
    data["target"]["tiny"]["architecture"] = "llama"
    data["capture"]["aux_layer_ids"] = [0, 2, 4]
    assert RunConfig(**data).capture.aux_layer_ids == [0, 2, 4]


def test_capture_refuses_layers_sglang_cannot_capture_on_an_hf_targets_family(tmp_path):
    from pipeline.config import load_config
    from pipeline.engines.target import TargetInfo
    from pipeline.stages.capture import contract_for

    model_dir = deepseek_target(tmp_path / "Kimi", num_layers=8, hidden=64, vocab=1024)
    target = TargetInfo("kimi-like", model_dir, 8, 64, 1024, {"name": "kimi-like"})

    def config(layers):
        return load_config(
            data={
                "storage": {"root": str(tmp_path / "store")},
                "target": {"name": "kimi-like", "source": "hf", "model_path": str(model_dir)},
                "capture": {"aux_layer_ids": layers},
            }
        )

    with pytest.raises(LayerIdsInexpressible, match="capture.aux_layer_ids must name layers"):
        contract_for(config([0, 3, 5]), target, None)
    assert contract_for(config([2, 3, 5]), target, None).aux_layer_ids == [2, 3, 5]
