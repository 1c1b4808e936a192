"""The SGLang drafter directory (LlamaForCausalLMEagle3): write, validate, load.

A directory holds config.json, model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d; never
embed_tokens), capture_contract.json and target_config.json (the target's config.json, which gives the
drafter its context length, RoPE and vocabulary). Export refuses a model missing any tensor SGLang needs,
and one the target's SGLang server would refuse, because SGLang would otherwise fail to start or silently
serve a broken draft.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pipeline.drafter.model import DrafterArch, Eagle3Drafter
from pipeline.drafter.servable import TARGET_CONFIG_NAME, record_target_config, require_servable
from pipeline.engines.layer_ids import LayerIdsInexpressible, draft_config_ids

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CONTRACT_NAME = "capture_contract.json"
REQUIRED_FILES = (CONFIG_NAME, WEIGHTS_NAME, CONTRACT_NAME)  # what a drafter directory cannot do without
# what export writes for a target (its config.json recorded as target_config.json), and what the train stage,
# evaluation and the registry move
DRAFTER_FILES = (*REQUIRED_FILES, TARGET_CONFIG_NAME)
ARCHITECTURE = "LlamaForCausalLMEagle3"
REQUIRED_CONFIG_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "hidden_act",
    "vocab_size",
    "num_hidden_layers",
    "draft_vocab_size",
    "tie_word_embeddings",
    "eagle_config",
)


class DrafterFormatError(ValueError):
    pass


def sglang_eagle_layer_ids(contract: dict[str, Any]) -> list[int]:
    """The eagle_aux_hidden_state_layer_ids that make SGLang feed the drafter the layer outputs its training
    features came from (the contract's aux_layer_ids), read with the rule of the target's model family.

    The family is what the capture recorded in the contract's target (contracts from before it was recorded:
    the Llama rule, ids unchanged). A contract without num_layers is checked against the shallowest target
    its ids fit.
    """
    layers = [int(k) for k in contract["aux_layer_ids"]]
    family = (contract.get("target") or {}).get("model_family", "llama")
    num_layers = contract.get("num_layers") or layers[-1] + 2
    try:
        return draft_config_ids("sglang", family, layers, num_layers)
    except LayerIdsInexpressible as err:
        raise DrafterFormatError(f"no SGLang drafter can be fed this contract's layers: {err}") from err


def sglang_config(arch: DrafterArch, dtype: str, eagle_layer_ids: list[int]) -> dict[str, Any]:
    """The drafter's config.json; eagle_layer_ids: SGLang's ids for arch's layers (sglang_eagle_layer_ids)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.intermediate_size,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        # the target's RoPE variant, which the drafter trained with (pipeline.drafter.rope); None: plain RoPE
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "hidden_act": arch.hidden_act,
        "vocab_size": arch.vocab_size,
        "num_hidden_layers": 1,
        "draft_vocab_size": arch.draft_vocab_size,
        "tie_word_embeddings": False,
        "target_hidden_size": arch.target_hidden_size or arch.hidden_size,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(eagle_layer_ids),
            "use_aux_hidden_state": True,
        },
    }


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, heads, kv_heads = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim, inter = config["head_dim"], config["intermediate_size"]
    target_hidden = config.get("target_hidden_size") or hidden
    return {
        "fc.weight": (hidden, 3 * target_hidden),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (inter, hidden),
        "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
        "d2t": (config["draft_vocab_size"],),
        "t2d": (config["vocab_size"],),
    }


def validate_config(config: dict[str, Any]) -> None:
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in config]
    if missing:
        raise DrafterFormatError(f"drafter config.json misses {missing}")
    if config["architectures"] != [ARCHITECTURE]:
        raise DrafterFormatError(
            f"drafter architectures must be [{ARCHITECTURE!r}], got {config['architectures']}"
        )
    if config["num_hidden_layers"] != 1:
        raise DrafterFormatError("an EAGLE-3 drafter has exactly one hidden layer")
    eagle = config["eagle_config"]
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if eagle.get("use_aux_hidden_state") is not True or not isinstance(ids, list) or len(ids) != 3:
        raise DrafterFormatError(
            "eagle_config needs use_aux_hidden_state: true and 3 eagle_aux_hidden_state_layer_ids"
        )


def validate_tensors(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    shapes = expected_shapes(config)
    problems = [f"missing tensor {name}" for name in shapes if name not in tensors]
    problems += [f"unexpected tensor {name}" for name in tensors if name not in shapes]
    for name, shape in shapes.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    if "d2t" in tensors and tensors["d2t"].dtype != torch.int64:
        problems.append("d2t must be int64 offsets")
    if "t2d" in tensors and tensors["t2d"].dtype != torch.bool:
        problems.append("t2d must be bool")
    if not problems and int(tensors["t2d"].sum()) != config["draft_vocab_size"]:
        problems.append("t2d does not mark exactly draft_vocab_size target ids")
    if not problems:
        used = torch.arange(config["draft_vocab_size"]) + tensors["d2t"]
        if (used < 0).any() or (used >= config["vocab_size"]).any() or not tensors["t2d"][used].all():
            problems.append("d2t and t2d disagree about the draft vocabulary")
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor.float()).all():
            problems.append(f"{name} has non-finite values")
    if problems:
        raise DrafterFormatError("invalid drafter weights:\n  " + "\n  ".join(problems))


def export_drafter(
    model: Eagle3Drafter,
    contract: dict[str, Any],
    out_dir: str | Path,
    dtype: str = "bfloat16",
    target_dir: str | Path | None = None,
) -> Path:
    """Write the SGLang directory atomically (staging dir, then rename).

    With target_dir (the target model directory), the target's config.json is recorded in the directory as
    target_config.json and the drafter is refused (DraftModelRefused, with SGLang's reasons) when the target's
    SGLang server would refuse it or serve it broken.
    """
    from safetensors.torch import save_file

    if list(contract["aux_layer_ids"]) != list(model.arch.aux_layer_ids):
        raise DrafterFormatError(
            f"drafter aux layers {model.arch.aux_layer_ids} disagree with the capture "
            f"contract's {contract['aux_layer_ids']}"
        )
    out_dir = Path(out_dir)
    config = sglang_config(model.arch, dtype, sglang_eagle_layer_ids(contract))
    target_dtype = getattr(torch, dtype)
    tensors = {
        name: (t.to(target_dtype) if t.is_floating_point() else t).contiguous().clone()
        for name, t in model.state_dict().items()
    }
    validate_config(config)
    validate_tensors(config, tensors)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        save_file(tensors, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        (staging / CONTRACT_NAME).write_text(json.dumps(contract, indent=2, sort_keys=True))
        if target_dir is not None:
            record_target_config(Path(target_dir), staging)
            require_servable(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def read_drafter_dir(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """config, tensors and capture contract of a drafter directory, all validated."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in REQUIRED_FILES:
        if not (directory / name).is_file():
            raise DrafterFormatError(f"drafter directory {directory} has no {name}")
    try:
        config = json.loads((directory / CONFIG_NAME).read_text())
        contract = json.loads((directory / CONTRACT_NAME).read_text())
    except json.JSONDecodeError as err:
        raise DrafterFormatError(f"drafter directory {directory}: invalid JSON: {err}") from err
    validate_config(config)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    validate_tensors(config, tensors)
    written = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    if "aux_layer_ids" not in contract or written != sglang_eagle_layer_ids(contract):
        raise DrafterFormatError(
            f"config.json aux layer ids {written} disagree with capture_contract.json's layers "
            f"{contract.get('aux_layer_ids')}: SGLang would feed it other layers than it was trained on"
        )
    return config, tensors, contract


def arch_from_config(config: dict[str, Any]) -> DrafterArch:
    return DrafterArch(
        hidden_size=config["hidden_size"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        aux_layer_ids=list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config["max_position_embeddings"],
        hidden_act=config["hidden_act"],
        target_hidden_size=config.get("target_hidden_size"),
    )


def load_drafter(
    directory: str | Path, embed_weight: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """The drafter from an SGLang directory, with the target's embedding; returns (model, contract)."""
    config, tensors, contract = read_drafter_dir(directory)
    # the layers it was trained on, in the project's convention (config.json holds SGLang's ids for them)
    arch = replace(arch_from_config(config), aux_layer_ids=list(contract["aux_layer_ids"]))
    model = Eagle3Drafter(arch, embed_weight)
    model.load_state_dict({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()})
    model.to(dtype)
    model.eval()
    return model, contract
