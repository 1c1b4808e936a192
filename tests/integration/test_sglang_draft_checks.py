"""SGLang 0.5.23's load-time checks on an EAGLE-3 draft (pipeline.engines.sglang_draft_checks): a drafter the
project exports for the tiny target passes; copies of it damaged one way each are refused with the reason;
the stand-in server refuses to start with one."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.engines.sglang_draft_checks import (
    SpeculativeArgs,
    TargetFacts,
    aux_layer_problems,
    draft_model_problems,
    draft_shape,
    effective_speculative_args,
    sglang_capture_points,
)
from pipeline.records import DrafterSource
from tests.conftest import REPO, free_port

SERVED = SpeculativeArgs("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4)
OVERRIDES = ("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "SGLANG_IS_IN_CI")


def export_for_tiny_target(tiny_target_dir, work: Path, architecture: str = "eagle3") -> Path:
    """What the train stage exports for the tiny target: the trainer's model (reduced draft vocabulary,
    head and norm from the target) under a real capture contract, written by export_drafter."""
    from pipeline.config import RunConfig, default_aux_layer_ids
    from pipeline.data.capture_contract import build_contract
    from pipeline.drafter.export import export_drafter
    from pipeline.engines.target import load_frozen_tensors, text_config
    from pipeline.training.worker import build_model
    from tests.conftest import storage_config, tiny_config_dict

    settings = tiny_config_dict(storage_config("file", work, None))
    settings["drafter"] = {**settings.get("drafter", {}), "architecture": architecture}
    config = RunConfig(**settings)
    text = text_config(tiny_target_dir)
    contract = build_contract(
        default_aux_layer_ids(text["num_hidden_layers"]),
        text["num_hidden_layers"],
        text["hidden_size"],
        text["vocab_size"],
        {"name": "tiny-test"},
        {"name": "hf"},
    )
    torch.manual_seed(0)
    used_ids = torch.randperm(text["vocab_size"])[: config.drafter.draft_vocab_size].sort().values.tolist()
    spec = DrafterSource(target_dir=str(tiny_target_dir), draft_vocab=used_ids, contract=contract)
    model = build_model(config, spec, load_frozen_tensors(tiny_target_dir))
    return export_drafter(model, contract.model_dump(), work / "drafter", config.drafter.export_dtype)


@pytest.fixture(scope="module")
def exported_drafter(tiny_target_dir, tmp_path_factory):
    return export_for_tiny_target(tiny_target_dir, tmp_path_factory.mktemp("exported"))


@pytest.fixture(scope="module")
def exported_eagle31(tiny_target_dir, tmp_path_factory):
    return export_for_tiny_target(tiny_target_dir, tmp_path_factory.mktemp("exported31"), "eagle3.1")


@pytest.fixture
def eagle31(exported_eagle31, tmp_path, monkeypatch):
    """A copy of an exported eagle3.1 drafter to damage."""
    for name in OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    return Path(shutil.copytree(exported_eagle31, tmp_path / "eagle31"))


@pytest.fixture
def drafter(exported_drafter, tmp_path, monkeypatch):
    """A copy of the exported drafter to damage, checked without the context-length overrides in the
    environment."""
    for name in OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    return Path(shutil.copytree(exported_drafter, tmp_path / "drafter"))


def edit_config(directory: Path, drop: tuple[str, ...] = (), **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    for key in drop:
        config.pop(key)
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def edit_eagle_config(directory: Path, drop: tuple[str, ...] = (), **changes) -> None:
    eagle = json.loads((directory / "config.json").read_text())["eagle_config"]
    for key in drop:
        eagle.pop(key)
    edit_config(directory, eagle_config={**eagle, **changes})


def edit_tensors(directory: Path, change) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def edit_contract_layers(directory: Path, layer_ids: list[int]) -> None:
    contract = json.loads((directory / "capture_contract.json").read_text())
    (directory / "capture_contract.json").write_text(json.dumps({**contract, "aux_layer_ids": layer_ids}))


def single_problem(target, drafter, args=SERVED, **options) -> str:
    problems = draft_model_problems(target, drafter, args, **options)
    assert len(problems) == 1, problems
    return problems[0]


def test_the_exported_drafter_passes_with_the_flags_the_pipeline_uses(tiny_target_dir, drafter):
    for args in (
        SERVED,
        SpeculativeArgs("EAGLE3"),
        SpeculativeArgs("EAGLE3", 2, 2, 4),
        SpeculativeArgs("NGRAM"),
    ):
        assert draft_model_problems(tiny_target_dir, drafter, args) == [], args


def test_tensors_sglang_drops_or_replaces_are_not_problems(tiny_target_dir, drafter):
    # t2d is skipped by load_weights, an embed_tokens.weight of the right shape is replaced by the target's
    edit_tensors(
        drafter, lambda t: (t.pop("t2d"), t.__setitem__("embed_tokens.weight", torch.zeros(1024, 64)))
    )
    assert draft_model_problems(tiny_target_dir, drafter, SERVED) == []


def test_a_draft_with_a_shorter_context_is_refused_unless_sglang_is_told_to_override(
    tiny_target_dir, drafter, monkeypatch
):
    edit_config(drafter, max_position_embeddings=512)
    problem = single_problem(tiny_target_dir, drafter)
    assert "Target model's context_length (1024) is greater than the derived context_length (512)" in problem
    assert "sglang/srt/configs/model_config.py:1291-1316" in problem
    assert draft_model_problems(tiny_target_dir, drafter, SERVED, context_length=512) == []
    longer = draft_model_problems(tiny_target_dir, drafter, SERVED, context_length=2048)
    assert any(
        "User-specified context_length (2048) is greater than the derived context_length (1024)" in p
        for p in longer
    ), longer
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert draft_model_problems(tiny_target_dir, drafter, SERVED) == []
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")
    edit_config(drafter, rope_scaling={"rope_type": "linear", "factor": 2.0})  # derived: 2 x 512
    assert draft_model_problems(tiny_target_dir, drafter, SERVED) == []


def test_a_draft_reading_other_hidden_widths_is_refused(tiny_target_dir, drafter):
    edit_config(drafter, target_hidden_size=32)
    problems = draft_model_problems(tiny_target_dir, drafter, SERVED)
    assert any("target states of width 32" in p and "llama_eagle3.py:151-167" in p for p in problems), (
        problems
    )
    assert any("fc.weight has shape [64, 192], but model.fc.weight takes [64, 96]" in p for p in problems), (
        problems
    )


def test_a_draft_wider_than_the_target_needs_its_own_embedding(tiny_target_dir, drafter):
    edit_config(drafter, hidden_size=128)  # target_hidden_size stays 64: the target's embedding is not shared
    problems = draft_model_problems(tiny_target_dir, drafter, SERVED)
    assert any(
        p.startswith("no tensor fills model.embed_tokens.weight: the target's embedding is not shared")
        for p in problems
    ), problems


@pytest.mark.parametrize(
    "changes, drop, message",
    [
        ({"vocab_size": 1000}, (), "draft vocab_size 1000 differs from the target's 1024"),
        (
            {"draft_vocab_size": 400},
            (),
            "lm_head.weight has shape [384, 64], but lm_head.weight takes [400, 64]",
        ),
        (
            {},
            ("draft_vocab_size",),
            "draft config.json has no draft_vocab_size: SGLang 0.5.23 fails building",
        ),
    ],
)
def test_vocabulary_mismatches_are_refused(tiny_target_dir, drafter, changes, drop, message):
    edit_config(drafter, drop, **changes)
    problems = draft_model_problems(tiny_target_dir, drafter, SERVED)
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "midlayer.mlp.up_proj.weight",
            "no tensor fills model.layers.0.mlp.gate_up_proj.weight (shards [1])",
        ),
        (
            "midlayer.self_attn.k_proj.weight",
            "no tensor fills model.layers.0.self_attn.qkv_proj.weight (shards ['k'])",
        ),
        ("norm.weight", "no tensor fills model.norm.weight"),
        ("lm_head.weight", "no tensor fills lm_head.weight"),
    ],
)
def test_a_missing_tensor_is_refused(tiny_target_dir, drafter, name, message):
    edit_tensors(drafter, lambda t: t.pop(name))
    problem = single_problem(tiny_target_dir, drafter)
    assert problem.startswith(message) and "untrained initial values" in problem
    assert "llama_eagle3.py:345-378" in problem


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("fc.weight", (64, 128), "fc.weight has shape [64, 128], but model.fc.weight takes [64, 192]"),
        ("midlayer.self_attn.q_proj.weight", (64, 64), "qkv_proj.weight (shard q) takes [64, 128]"),
        ("midlayer.mlp.down_proj.weight", (64, 96), "linear.py:1708"),
        ("midlayer.hidden_norm.weight", (32,), "model.layers.0.hidden_norm.weight takes [64]"),
    ],
)
def test_a_tensor_of_the_wrong_shape_is_refused(tiny_target_dir, drafter, name, shape, message):
    edit_tensors(drafter, lambda t: t.__setitem__(name, torch.zeros(shape)))
    assert message in single_problem(tiny_target_dir, drafter)


def test_use_aux_hidden_state_false_is_refused_and_missing_means_true(tiny_target_dir, drafter):
    edit_eagle_config(drafter, drop=("use_aux_hidden_state",))
    assert draft_model_problems(tiny_target_dir, drafter, SERVED) == []  # 0.5.23 defaults it to true
    edit_eagle_config(drafter, use_aux_hidden_state=False)
    assert "use_aux_hidden_state is false: SGLang 0.5.23 serves it broken" in single_problem(
        tiny_target_dir, drafter
    )


def test_aux_layers_sglang_would_not_capture_are_refused(tiny_target_dir, drafter):
    edit_config(
        drafter, drop=("eagle_config",)
    )  # SGLang's default layers for 7: outputs of 1, 2, 3 = the trained
    assert draft_model_problems(tiny_target_dir, drafter, SERVED) == []
    edit_contract_layers(drafter, [1, 3, 5])
    problem = single_problem(tiny_target_dir, drafter)
    assert "trained on the outputs of layers [1, 3, 5]" in problem
    assert "captures the outputs of layers [1, 2, 3]" in problem
    edit_config(
        drafter, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "use_aux_hidden_state": True}
    )
    edit_contract_layers(drafter, [1, 3, 6])
    problem = single_problem(tiny_target_dir, drafter)
    assert "capture points [2, 4, 7] on a 7-layer target, 2 distinct in range" in problem


def test_the_deepseek_capture_rule_shifts_only_ids_starting_at_1():
    kimi = TargetFacts("KimiK25ForConditionalGeneration", 61, 7168, 163840, 262144, deepseek_capture=True)
    assert sglang_capture_points(kimi, [1, 29, 57]) == [2, 30, 58]
    assert sglang_capture_points(kimi, [2, 29, 57]) == [2, 29, 57]
    assert sglang_capture_points(kimi, None) == [2, 30, 58]
    llama = TargetFacts("LlamaForCausalLM", 7, 64, 1024, 1024, deepseek_capture=False)
    assert sglang_capture_points(llama, [2, 3, 4]) == [3, 4, 5]


def test_a_deepseek_target_captures_unshifted_layers_for_ids_not_starting_at_1(drafter):
    from transformers import AutoConfig

    edit_eagle_config(drafter, eagle_aux_hidden_state_layer_ids=[2, 3, 4])
    config = AutoConfig.from_pretrained(str(drafter))
    deepseek = TargetFacts("DeepseekV3ForCausalLM", 7, 64, 1024, 1024, deepseek_capture=True)
    [problem] = aux_layer_problems(deepseek, config, draft_shape(config), [2, 3, 4])
    assert (
        "trained on the outputs of layers [2, 3, 4]" in problem and "outputs of layers [1, 2, 3]" in problem
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (SpeculativeArgs("EAGLE3", None, 2, None), "without --speculative-num-steps"),
        (SpeculativeArgs("EAGLE3", 3, None, 4), "without --speculative-eagle-topk"),
        (SpeculativeArgs("EAGLE3", 2, 3, None), "without --speculative-num-draft-tokens"),
        (SpeculativeArgs("EAGLE3", 2, 2, 8), "keeps num_draft_tokens - 1 = 7 of 6 candidates"),
        (SpeculativeArgs("EAGLE3", 2, 2, 7), None),
        (SpeculativeArgs("EAGLE3", 3, 1, 10), None),  # topk 1: SGLang sets draft tokens to steps + 1
    ],
)
def test_steps_topk_and_draft_tokens(tiny_target_dir, drafter, args, message):
    problems = draft_model_problems(tiny_target_dir, drafter, args)
    assert (problems == []) if message is None else (len(problems) == 1 and message in problems[0]), problems


def test_sglang_fills_in_and_adjusts_speculative_flags():
    assert effective_speculative_args(SpeculativeArgs("EAGLE3"), "LlamaForCausalLM") == SpeculativeArgs(
        "EAGLE3", 5, 4, 8
    )
    assert effective_speculative_args(
        SpeculativeArgs("EAGLE3"), "KimiK25ForConditionalGeneration"
    ) == SpeculativeArgs("EAGLE3", 3, 1, 4)
    assert effective_speculative_args(SpeculativeArgs("EAGLE3", 7, 1, 3), "x").num_draft_tokens == 8


@pytest.mark.parametrize(
    "changes, drop, message",
    [
        ({"architectures": ["LlamaForCausalLM"]}, (), "do not start with LlamaForCausalLMEagle3"),
        ({}, ("architectures",), "has no architectures: SGLang 0.5.23 fails indexing architectures[0]"),
        (
            {"architectures": ["Eagle3DeepseekV2ForCausalLM"]},
            (),
            # a Llama config under the MLA class: LlamaConfig has no MLA sizes
            "draft config has no q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: "
            "SGLang 0.5.23 fails building the MLA attention",
        ),
        ({"model_type": "no_such_model"}, (), "draft config.json does not load"),
        ({"hidden_act": "gelu"}, (), "only silu is supported"),
        ({"tie_word_embeddings": True}, (), "trained lm_head.weight has no parameter to load into"),
        ({"eagle_config": [1, 2, 3]}, (), "eagle_config is a list, not an object"),
        (
            {"target_hidden_size": None},
            (),
            "target_hidden_size: null: SGLang 0.5.23 fails sizing the fc layer",
        ),
    ],
)
def test_draft_configs_sglang_cannot_build_or_drops_weights_of(
    tiny_target_dir, drafter, changes, drop, message
):
    edit_config(drafter, drop, **changes)
    assert message in single_problem(tiny_target_dir, drafter)


def test_drafts_without_readable_safetensors_are_refused(tiny_target_dir, drafter):
    (drafter / "model.safetensors").write_bytes(b"not a safetensors file")
    assert "draft weights model.safetensors are unreadable" in single_problem(tiny_target_dir, drafter)
    (drafter / "model.safetensors").unlink()
    assert "has no *.safetensors weights" in single_problem(tiny_target_dir, drafter)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop("d2t"), "no d2t tensor for a draft vocabulary of 384 (vocab 1024)"),
        (lambda t: t.__setitem__("d2t", t["d2t"].float()), "d2t is F32 [384], not 1-D integer offsets"),
        (lambda t: t.__setitem__("d2t", t["d2t"][:100]), "d2t has 100 entries for a draft vocabulary of 384"),
        (lambda t: t.__setitem__("d2t", t["d2t"] + 1000), "outside the target vocabulary of 1024"),
    ],
)
def test_a_broken_hot_token_map_is_refused(tiny_target_dir, drafter, damage, message):
    edit_tensors(drafter, damage)
    assert message in single_problem(tiny_target_dir, drafter)


def test_eagle3_without_a_draft_path_is_refused(tiny_target_dir):
    assert "without --speculative-draft-model-path" in single_problem(tiny_target_dir, None)


def test_the_standin_refuses_to_start_with_a_draft_sglang_would_refuse(tiny_target_dir, drafter):
    edit_config(drafter, max_position_embeddings=512)
    edit_tensors(drafter, lambda t: t.pop("midlayer.mlp.up_proj.weight"))
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.sglang_standin",
            "--model-path",
            str(tiny_target_dir),
            "--port",
            str(free_port()),
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(drafter),
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        _, stderr = server.communicate(timeout=90)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 1, stderr
    assert "SGLang 0.5.23 would not serve draft model" in stderr
    assert "derived context_length (512)" in stderr and "model.layers.0.mlp.gate_up_proj.weight" in stderr


# ---- EAGLE-3.1's flags (llama_eagle3.py:184-207) -----------------------------------------------------------


def test_an_eagle31_export_sets_its_flags_and_sglang_fills_every_parameter_from_it(tiny_target_dir, eagle31):
    from transformers import AutoConfig

    from pipeline.engines.sglang_draft_checks import (
        expected_parameters,
        read_weight_header,
        sglang_parameter_for,
    )

    assert draft_model_problems(tiny_target_dir, eagle31, SERVED) == []
    shape = draft_shape(AutoConfig.from_pretrained(str(eagle31)))
    assert (shape.fc_norm, shape.norm_output, shape.norm_before_fc) == (True, True, False)
    params = expected_parameters(shape)
    assert {f"model.fc_norm.{i}.weight" for i in range(3)} <= set(params)
    tensors, problems = read_weight_header(eagle31)
    assert problems == []
    filled = {
        sglang_parameter_for(name, params)[0]
        for name in tensors
        if "d2t" not in name and "t2d" not in name and sglang_parameter_for(name, params) is not None
    }
    dropped = [
        n for n in tensors if "d2t" not in n and "t2d" not in n and sglang_parameter_for(n, params) is None
    ]
    assert dropped == []
    assert {name for name, param in params.items() if param.required} <= filled


def test_an_eagle3_export_records_its_flags_off(tiny_target_dir, drafter):
    from transformers import AutoConfig

    shape = draft_shape(AutoConfig.from_pretrained(str(drafter)))
    assert (shape.fc_norm, shape.norm_output, shape.norm_before_fc) == (False, False, False)


def test_fc_norm_weights_without_the_flag_are_refused_as_dropped(tiny_target_dir, eagle31):
    edit_config(eagle31, fc_norm=False)
    problems = draft_model_problems(tiny_target_dir, eagle31, SERVED)
    assert len(problems) == 3, problems
    assert all("has no parameter to load into" in p and "drops it silently" in p for p in problems)
    assert "tensor fc_norm.0.weight" in problems[0]


def test_the_fc_norm_flag_without_its_weights_is_refused_as_left_at_init(tiny_target_dir, eagle31):
    edit_tensors(eagle31, lambda t: t.pop("fc_norm.1.weight"))
    message = single_problem(tiny_target_dir, eagle31)
    assert "no tensor fills model.fc_norm.1.weight" in message
    assert "keeps its untrained initial values" in message


def test_legacy_aux_norm_names_load_into_fc_norm_only_with_the_flag(tiny_target_dir, eagle31):
    legacy = {"fc_norm.0.weight": "aux_norm_low.weight", "fc_norm.1.weight": "aux_norm_mid.weight"}
    legacy["fc_norm.2.weight"] = "aux_norm_high.weight"

    def rename(tensors):
        for new, old in legacy.items():
            tensors[old] = tensors.pop(new)

    edit_tensors(eagle31, rename)
    assert draft_model_problems(tiny_target_dir, eagle31, SERVED) == []
    edit_config(eagle31, drop=("fc_norm",), use_aux_norm=True)  # the legacy flag, too (:184-187)
    assert draft_model_problems(tiny_target_dir, eagle31, SERVED) == []
    edit_config(eagle31, drop=("use_aux_norm",))
    problems = draft_model_problems(tiny_target_dir, eagle31, SERVED)
    assert sorted(p.split(" has no")[0] for p in problems) == [
        "tensor aux_norm_high.weight",
        "tensor aux_norm_low.weight",
        "tensor aux_norm_mid.weight",
    ]


def test_flags_sglang_reads_only_at_the_top_level_are_refused_inside_eagle_config(tiny_target_dir, eagle31):
    edit_eagle_config(eagle31, norm_output=False)
    message = single_problem(tiny_target_dir, eagle31)
    assert "eagle_config sets norm_output" in message
    assert "reads these flags only at the top level" in message
