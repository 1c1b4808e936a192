"""The drafter directory (LlamaForCausalLMEagle3, or Eagle3DeepseekV2ForCausalLM for eagle3-mla) that SGLang
and vLLM load: write, validate, load.

A directory holds config.json, model.safetensors (fc, [fc_norm.{i}], midlayer.*, norm, lm_head, d2t, t2d;
never embed_tokens), capture_contract.json and target_config.json (the target's config.json, which gives the
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

from pipeline.drafter.arch import ARCHITECTURE_NORMS, DrafterArch, MlaShape
from pipeline.drafter.model import NUM_AUX_STATES, Eagle3Drafter
from pipeline.drafter.servable import TARGET_CONFIG_NAME, record_target_config, require_servable
from pipeline.engines.layer_ids import (
    ENGINES,
    Engine,
    LayerIdsInexpressible,
    ModelFamily,
    captured_layer_outputs,
    draft_config_ids,
)
from pipeline.user_files import UserFile

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
# eagle3-mla: SGLang 0.5.23's MLA draft class (models/kimi_k25_eagle3.py:523), which vLLM 0.32.0 registers
# too (model_executor/models/registry.py:672-673). model_type deepseek_v2: transformers parses it (SGLang's
# kimi_k2 alias is SGLang-only) and vLLM leaves it alone (it rewrites deepseek_v3 drafts to MTP,
# config/speculative.py:679-694). transformers' DeepseekV2Config fills every MLA key the file lacks with
# DeepSeek-V2's sizes, so each is written and required.
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_MODEL_TYPE = "deepseek_v2"
MLA_CONFIG_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
)
MLA_REQUIRED_CONFIG_KEYS = (
    *(key for key in REQUIRED_CONFIG_KEYS if key not in ("num_key_value_heads", "head_dim")),
    *MLA_CONFIG_KEYS,
    "target_hidden_size",
)


class DrafterFormatError(ValueError):
    pass


# EAGLE-3.1's flags, written at config.json's top level for every architecture (false for eagle3): SGLang
# 0.5.23 reads fc_norm and norm_output only there (models/llama_eagle3.py:184-187, :207) and norm_before_fc
# from eagle_config, else the top level (:169-175); vLLM 0.32.0 likewise
# (model_executor/models/llama_eagle3.py:231, :252, :184-188). Recording all three says which a drafter was
# trained with: drafters trained before a fix in them do not match what vLLM serves (issue 42). The project
# never trains norm_before_fc's input_norm.
NORM_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")
# SGLang's legacy name for fc_norm (llama_eagle3.py:184-187); vLLM does not read it, so the engines would
# disagree about a config that sets it
LEGACY_FC_NORM_FLAG = "use_aux_norm"
# The project's architecture name (pipeline.config DrafterConfig.architecture), recorded in config.json rather
# than in capture_contract.json: it describes the model, which config.json holds and arch_from_config reads,
# while the contract describes the features it reads; engines ignore the unknown key.
ARCHITECTURE_KEY = "drafter_architecture"


# Where config.json gives each engine the target layers to capture (the drafter's aux layer ids).
# vLLM 0.32.0 reads the TOP-LEVEL key first and falls back to eagle_config's only when it is absent
# (vllm/v1/worker/gpu_model_runner.py:5268-5283; the newer runner reads only the top-level one,
# vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:106). SGLang 0.5.23 captures the layers that
# eagle_config's key names
# (sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py:186-196) and reads the
# top-level key only to count the aux states when eagle_config has none
# (sglang/srt/speculative/eagle_utils.py:272-275). The engines count the ids differently
# (pipeline.engines.layer_ids), so one directory serves both: eagle_config holds SGLang's ids, the top
# level vLLM's. Directories exported before the top-level key are SGLang-only: vLLM would fall back to
# SGLang's ids and, for a Llama-family target, capture the layers one below the trained ones.
EAGLE_CONFIG_KEY = "eagle_config"
LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
LAYER_IDS_WHERE: dict[Engine, str] = {
    "sglang": f"{EAGLE_CONFIG_KEY}.{LAYER_IDS_KEY}",
    "vllm": f"top-level {LAYER_IDS_KEY}",
}
ENGINE_NAMES: dict[str, str] = {"sglang": "SGLang", "vllm": "vLLM"}


def contract_target(contract: dict[str, Any]) -> tuple[list[int], ModelFamily, int]:
    """The layer outputs a contract's features came from, the target's model family and its depth.

    The family is what the capture recorded in the contract's target (contracts from before it was recorded:
    the Llama rule). A contract without num_layers is read as the shallowest target its ids fit.
    """
    layers = [int(k) for k in contract["aux_layer_ids"]]
    family = (contract.get("target") or {}).get("model_family", "llama")
    num_layers = int(contract.get("num_layers") or layers[-1] + 2)
    return layers, family, num_layers


def engine_layer_ids(contract: dict[str, Any], engine: Engine) -> list[int]:
    """The eagle_aux_hidden_state_layer_ids that make `engine` feed the drafter the layer outputs its
    training features came from (the contract's aux_layer_ids), by the rule of the target's model family."""
    layers, family, num_layers = contract_target(contract)
    try:
        return draft_config_ids(engine, family, layers, num_layers)
    except LayerIdsInexpressible as err:
        raise DrafterFormatError(
            f"no {ENGINE_NAMES.get(engine, engine)} drafter can be fed this contract's layers: {err}"
        ) from err


def written_layer_ids(config: dict[str, Any], engine: Engine) -> list[int] | None:
    """The aux layer ids config.json gives `engine` (see LAYER_IDS_WHERE); None for vLLM in a directory
    exported before the top-level key (vLLM would fall back to SGLang's ids)."""
    if engine == "sglang":
        return (config.get(EAGLE_CONFIG_KEY) or {}).get(LAYER_IDS_KEY)
    if engine == "vllm":
        return config.get(LAYER_IDS_KEY)
    raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


def exported_for(config: dict[str, Any]) -> list[Engine]:
    """The engines config.json carries aux layer ids for: SGLang always, vLLM once exported with its ids."""
    return [engine for engine in ENGINES if written_layer_ids(config, engine) is not None]


# The MLA latents (kv_lora_rank + qk_rope_head_dim) vLLM 0.32.0 runs: its MLA attention refuses other widths
# (vllm/model_executor/layers/attention/mla_attention.py:1600-1602, 1714-1717), and its CPU build, the one
# here, has a decode kernel for 576 only, with block size 16 (vllm/v1/attention/backends/mla/cpu_mla.py:24-26,
# 61-72). Kimi-K2.5's and DeepSeek-V3's latent is 576 (512 + 64); the tiny targets' are far narrower. From
# reading vLLM's source: no MLA drafter has been run in vLLM here.
VLLM_MLA_LATENTS = (320, 512, 576)
VLLM_CPU_MLA_LATENT = 576
SGLANG_NOT_HERE = (
    "SGLang 0.5.23 serves it (Eagle3DeepseekV2ForCausalLM, models/kimi_k25_eagle3.py) but needs a GPU, so "
    "here only its load-time checks (pipeline.engines.sglang_draft_checks) and the stand-in run"
)


def mla_latent_width(config: dict[str, Any]) -> int | None:
    """kv_lora_rank + qk_rope_head_dim of an eagle3-mla drafter's config.json; None for other drafters."""
    if not is_mla_config(config):
        return None
    return int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])


def engine_refusals(config: dict[str, Any]) -> dict[Engine, str]:
    """Why no build of an engine could load this drafter (config.json), by engine; empty when, by its source,
    each can. vLLM: an MLA latent of a width its MLA attention does not take."""
    width = mla_latent_width(config)
    if width is None or width in VLLM_MLA_LATENTS:
        return {}
    return {
        "vllm": f"its MLA latent is {width} wide (kv_lora_rank + qk_rope_head_dim), and vLLM 0.32.0's MLA "
        "attention takes latents of 320, 512 or 576 only "
        "(vllm/model_executor/layers/attention/mla_attention.py:1600-1602, 1714-1717)"
    }


def no_engine_here(config: dict[str, Any]) -> str | None:
    """For a drafter (config.json) that no engine on this machine loads, the sentence that says so and why;
    None otherwise. Here vLLM is the CPU build, whose MLA runs only VLLM_CPU_MLA_LATENT-wide latents."""
    width = mla_latent_width(config)
    if width is None or width == VLLM_CPU_MLA_LATENT:
        return None
    vllm = engine_refusals(config).get("vllm") or (
        f"its MLA latent is {width} wide, and vLLM 0.32.0's CPU build runs MLA only with 576-wide latents "
        "(kv_lora_rank 512 + qk_rope_head_dim 64), block size 16 (vllm/v1/attention/backends/mla/cpu_mla.py:"
        "24-26, 61-72)"
    )
    return f"no engine here loads this eagle3-mla drafter: {vllm}; {SGLANG_NOT_HERE}"


class EngineNotExported(DrafterFormatError):
    """The drafter directory carries no aux layer ids for this engine."""


def require_exported_for(config: dict[str, Any], engine: Engine, directory: str | Path = "") -> list[int]:
    """The ids config.json gives `engine`; EngineNotExported (saying to re-export) when it gives none."""
    ids = written_layer_ids(config, engine)
    if ids is None:
        where = f"drafter directory {directory}" if directory else "this drafter"
        raise EngineNotExported(
            f"{where} carries no {ENGINE_NAMES[engine]} aux layer ids ({LAYER_IDS_WHERE[engine]}): it was "
            f"exported for SGLang alone, and {ENGINE_NAMES[engine]} would fall back to SGLang's ids, which "
            "it counts differently, and may capture other layers than the drafter was trained on. Re-export "
            "it (export_drafter, or promote a new run) and publish the new version"
        )
    return list(ids)


def drafter_config(
    arch: DrafterArch, dtype: str, sglang_layer_ids: list[int], vllm_layer_ids: list[int] | None
) -> dict[str, Any]:
    """The drafter's config.json, with each engine's aux layer ids as given (engine_layer_ids gives the right
    ones; vllm_layer_ids None: no top-level key, an SGLang-only directory). Writing other ids (e.g. SGLang's
    at the top level too, how a drafter exported for SGLang alone loads in vLLM) makes a directory that
    read_drafter_dir refuses; experiments that need one use copy_with_layer_ids."""
    if arch.architecture == "eagle3-mla":
        config = mla_sglang_config(arch, dtype, sglang_layer_ids)
    else:
        config = sglang_config(arch, dtype, sglang_layer_ids)
    if vllm_layer_ids is not None:
        config[LAYER_IDS_KEY] = list(vllm_layer_ids)
    return config


def sglang_config(arch: DrafterArch, dtype: str, eagle_layer_ids: list[int]) -> dict[str, Any]:
    """The drafter's config.json for SGLang alone; eagle_layer_ids: SGLang's ids for arch's layers."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        **draft_layer_config(arch, dtype, eagle_layer_ids),
    }


def mla_sglang_config(arch: DrafterArch, dtype: str, eagle_layer_ids: list[int]) -> dict[str, Any]:
    """The eagle3-mla drafter's config.json as Eagle3DeepseekV2ForCausalLM reads it
    (models/kimi_k25_eagle3.py:78-99, 137-149, 199-255): every MLA size written, one layer, a dense silu MLP,
    the RoPE it trained with, and the aux ids in eagle_config, where the target reads them
    (spec_aux_hidden_state.py:185-196). The EAGLE-3.1 flags are read at the top level as in the Llama class
    (kimi_k25_eagle3.py:230-232, :255); both are off for eagle3-mla."""
    if arch.mla is None:
        raise DrafterFormatError("an eagle3-mla drafter has no MLA sizes (DrafterArch.mla)")
    m = arch.mla
    return {
        "architectures": [MLA_ARCHITECTURE],
        "model_type": MLA_MODEL_TYPE,
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_heads,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rope_interleave": m.rope_interleave,
        **draft_layer_config(arch, dtype, eagle_layer_ids),
    }


def draft_layer_config(arch: DrafterArch, dtype: str, eagle_layer_ids: list[int]) -> dict[str, Any]:
    """What both draft classes read alike: the MLP, the RoPE the drafter trained with (the target's
    variant, pipeline.drafter.rope; None: plain RoPE), the vocabularies, one layer, the EAGLE-3.1 flags at
    the top level and the aux ids in eagle_config."""
    return {
        "intermediate_size": arch.intermediate_size,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "hidden_act": arch.hidden_act,
        "vocab_size": arch.vocab_size,
        "num_hidden_layers": 1,
        "draft_vocab_size": arch.draft_vocab_size,
        "tie_word_embeddings": False,
        "target_hidden_size": arch.target_hidden_size or arch.hidden_size,
        "torch_dtype": dtype,
        ARCHITECTURE_KEY: arch.architecture,
        "fc_norm": arch.fc_norm,
        "norm_before_fc": False,
        "norm_output": arch.norm_output,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(eagle_layer_ids),
            "use_aux_hidden_state": True,
        },
    }


def is_mla_config(config: dict[str, Any]) -> bool:
    return config.get("architectures") == [MLA_ARCHITECTURE]


def architecture_of(config: dict[str, Any]) -> str:
    """drafter.architecture of an exported config.json: recorded, else told by its draft class."""
    return config.get(ARCHITECTURE_KEY) or ("eagle3-mla" if is_mla_config(config) else "eagle3")


def mla_attention_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The MLA attention tensors, unfused, as Eagle3DeepseekV2ForCausalLM.load_weights pairs and splits them
    (models/kimi_k25_eagle3.py:467-492, 503-520)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    return {
        "midlayer.self_attn.q_a_proj.weight": (q_lora, 2 * hidden),
        "midlayer.self_attn.q_a_layernorm.weight": (q_lora,),
        "midlayer.self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
        "midlayer.self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, 2 * hidden),
        "midlayer.self_attn.kv_a_layernorm.weight": (kv_lora,),
        "midlayer.self_attn.kv_b_proj.weight": (heads * (nope + v), kv_lora),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * v),
    }


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    attention = mla_attention_shapes(config) if is_mla_config(config) else _llama_attention_shapes(config)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    target_hidden = config.get("target_hidden_size") or hidden
    fc_norms = {f"fc_norm.{i}.weight": (target_hidden,) for i in range(NUM_AUX_STATES)}
    return {
        **(fc_norms if config.get("fc_norm") else {}),
        "fc.weight": (hidden, NUM_AUX_STATES * target_hidden),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        **attention,
        "midlayer.mlp.gate_proj.weight": (inter, hidden),
        "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
        "d2t": (config["draft_vocab_size"],),
        "t2d": (config["vocab_size"],),
    }


def _llama_attention_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, heads, kv_heads = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim = config["head_dim"]
    return {
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
    }


def validate_config(config: dict[str, Any]) -> None:
    required = MLA_REQUIRED_CONFIG_KEYS if is_mla_config(config) else REQUIRED_CONFIG_KEYS
    missing = [key for key in required if key not in config]
    if missing:
        raise DrafterFormatError(f"drafter config.json misses {missing}")
    if config["architectures"] not in ([ARCHITECTURE], [MLA_ARCHITECTURE]):
        raise DrafterFormatError(
            f"drafter architectures must be [{ARCHITECTURE!r}] or [{MLA_ARCHITECTURE!r}] (eagle3-mla), got "
            f"{config['architectures']}"
        )
    if is_mla_config(config) and config.get("q_lora_rank") is None:
        raise DrafterFormatError(
            "an eagle3-mla drafter's q_lora_rank is null; SGLang refuses it "
            "(models/kimi_k25_eagle3.py:114-117)"
        )
    if config["num_hidden_layers"] != 1:
        raise DrafterFormatError("an EAGLE-3 drafter has exactly one hidden layer")
    eagle = config["eagle_config"]
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if eagle.get("use_aux_hidden_state") is not True or not isinstance(ids, list) or len(ids) != 3:
        raise DrafterFormatError(
            "eagle_config needs use_aux_hidden_state: true and 3 eagle_aux_hidden_state_layer_ids"
        )
    validate_norm_flags(config)
    vllm_ids = written_layer_ids(config, "vllm")
    if vllm_ids is not None and (
        not isinstance(vllm_ids, list)
        or len(vllm_ids) != len(ids)
        or not all(type(k) is int for k in vllm_ids)
    ):
        raise DrafterFormatError(
            f"the top-level {LAYER_IDS_KEY} (vLLM's aux layer ids) must be a list of {len(ids)} integers "
            f"like eagle_config's, got {vllm_ids!r}"
        )


def validate_norm_flags(config: dict[str, Any]) -> None:
    """Refuse EAGLE-3.1 flags this project cannot load or the engines would read differently. Absent flags are
    false: drafters exported before they were recorded are eagle3."""
    for flag in NORM_FLAGS:
        if not isinstance(config.get(flag, False), bool):
            raise DrafterFormatError(f"config.json's {flag} must be true or false, got {config[flag]!r}")
    if config.get("norm_before_fc") or (config.get(EAGLE_CONFIG_KEY) or {}).get("norm_before_fc"):
        raise DrafterFormatError(
            "config.json sets norm_before_fc: this project's drafters have no input_norm over the whole fc "
            "input, so it cannot load this drafter (SGLang llama_eagle3.py:169-182, vLLM "
            "llama_eagle3.py:184-188)"
        )
    if LEGACY_FC_NORM_FLAG in config:
        raise DrafterFormatError(
            f"config.json sets {LEGACY_FC_NORM_FLAG}: SGLang reads it as fc_norm (llama_eagle3.py:184-187) "
            "but vLLM ignores it (llama_eagle3.py:231), so the engines would serve different drafters; write "
            "fc_norm"
        )
    architecture = config.get(ARCHITECTURE_KEY)
    if architecture is None:
        return
    if architecture not in ARCHITECTURE_NORMS:
        raise DrafterFormatError(
            f"config.json's {ARCHITECTURE_KEY} {architecture!r} is not one this model loads; known: "
            f"{', '.join(ARCHITECTURE_NORMS)}"
        )
    written = (bool(config.get("fc_norm", False)), bool(config.get("norm_output", False)))
    if written != ARCHITECTURE_NORMS[architecture]:
        raise DrafterFormatError(
            f"config.json's {ARCHITECTURE_KEY} {architecture!r} has fc_norm/norm_output "
            f"{ARCHITECTURE_NORMS[architecture]}, but the flags say {written}"
        )


def validate_tensors(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    shapes = expected_shapes(config)
    problems = [f"missing tensor {name}" for name in shapes if name not in tensors]
    problems += [f"unexpected tensor {name}" for name in tensors if name not in shapes]
    if config.get("fc_norm") and any(name.startswith("fc_norm.") and name not in tensors for name in shapes):
        problems.append(
            "config.json sets fc_norm but fc_norm weights are missing: both engines would leave them at "
            "their initial values (SGLang llama_eagle3.py:345-378, vLLM llama_eagle3.py:420-470 check "
            "nothing)"
        )
    if not config.get("fc_norm") and any(name.startswith("fc_norm.") for name in tensors):
        problems.append(
            "the weights hold fc_norm tensors but config.json's fc_norm is not true: SGLang would drop them "
            "silently (llama_eagle3.py:363, :373) and vLLM fail loading them "
            "(model_executor/models/utils.py:443)"
        )
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
    """Write the drafter directory atomically (staging dir, then rename), with each engine's aux layer ids
    for the contract's layers (SGLang's in eagle_config, vLLM's at the top level; see LAYER_IDS_WHERE).

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
    config = drafter_config(
        model.arch, dtype, engine_layer_ids(contract, "sglang"), engine_layer_ids(contract, "vllm")
    )
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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in REQUIRED_FILES:
        if not (directory / name).is_file():
            raise DrafterFormatError(f"drafter directory {directory} has no {name}")
    config = UserFile(directory / CONFIG_NAME, "drafter config", DrafterFormatError).read_json()
    contract = UserFile(directory / CONTRACT_NAME, "capture contract", DrafterFormatError).read_json()
    if not isinstance(config, dict) or not isinstance(contract, dict):
        raise DrafterFormatError(
            f"drafter directory {directory}: config.json or the contract is not an object"
        )
    validate_config(config)
    weights = directory / WEIGHTS_NAME
    require_safetensors_header(weights)
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise DrafterFormatError(f"weights {weights} cannot be read as safetensors: {err}") from err
    validate_tensors(config, tensors)
    if "aux_layer_ids" not in contract:
        raise DrafterFormatError(f"drafter directory {directory}: capture_contract.json has no aux_layer_ids")
    problems = layer_ids_problems(config, contract)
    if problems:
        raise DrafterFormatError(f"drafter directory {directory}: " + "; ".join(problems))
    return config, tensors, contract


# safetensors' own bound on its JSON header (safetensors' MAX_HEADER_SIZE, 100 MB)
MAX_SAFETENSORS_HEADER = 100_000_000


def require_safetensors_header(path: Path) -> None:
    """DrafterFormatError naming `path` unless it starts as a safetensors file does: an 8-byte little-endian
    header length that fits in the file and under MAX_SAFETENSORS_HEADER, then that many bytes of a JSON
    object. Checked before the library reads it, so a header that claims gigabytes is refused unread."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(9)
    claimed = int.from_bytes(prefix[:8], "little") if len(prefix) >= 8 else None
    if claimed is None or claimed > min(size - 8, MAX_SAFETENSORS_HEADER) or prefix[8:9] != b"{":
        said = "fewer than 8 bytes" if claimed is None else f"a header of {claimed:,} bytes"
        raise DrafterFormatError(
            f"weights {path} are not a safetensors file ({said} in a file of {size:,} bytes): export or "
            "pull the drafter again"
        )


def layer_ids_problems(config: dict[str, Any], contract: dict[str, Any]) -> list[str]:
    """Why config.json's aux layer ids would make an engine feed the drafter other layers than it was trained
    on (the contract's aux_layer_ids): each engine's ids are mapped back to the layer outputs that engine
    captures (pipeline.engines.layer_ids.captured_layer_outputs). Empty when every engine the directory was
    exported for (exported_for) is fed the trained layers."""
    trained, family, num_layers = contract_target(contract)
    captured = {
        engine: captured_layer_outputs(engine, family, written_layer_ids(config, engine), num_layers)
        for engine in exported_for(config)
    }
    problems = []
    if len({tuple(layers) for layers in captured.values()}) > 1:
        problems.append(
            "config.json's aux layer id lists disagree: "
            + ", ".join(
                f"{LAYER_IDS_WHERE[engine]} {written_layer_ids(config, engine)} make {ENGINE_NAMES[engine]} "
                f"capture the outputs of layers {layers}"
                for engine, layers in captured.items()
            )
            + f" of a {num_layers}-layer {family}-family target"
        )
    for engine in captured:
        written, expected = written_layer_ids(config, engine), engine_layer_ids(contract, engine)
        if written != expected:
            problems.append(
                f"config.json's {ENGINE_NAMES[engine]} aux layer ids ({LAYER_IDS_WHERE[engine]}) {written} "
                f"disagree with capture_contract.json's layers {trained} (they take {expected}): "
                f"{ENGINE_NAMES[engine]} would feed it other layers than it was trained on"
            )
    return problems


def copy_with_layer_ids(source: str | Path, dest: str | Path, engine: Engine, layer_ids: list[int]) -> Path:
    """A copy of a drafter directory whose config.json gives `engine` these aux layer ids, every other file
    unchanged; for experiments on what an engine serves when fed other layers, e.g. SGLang's ids at the top
    level too (`engine_layer_ids(contract, "sglang")` as vLLM's: the drafter exported for SGLang alone, as
    vLLM loads it). read_drafter_dir refuses the copy unless the ids are the right ones."""
    source, dest = Path(source), Path(dest)
    shutil.copytree(source, dest)
    config = json.loads((dest / CONFIG_NAME).read_text())
    if engine == "sglang":
        config[EAGLE_CONFIG_KEY] = {**config[EAGLE_CONFIG_KEY], LAYER_IDS_KEY: list(layer_ids)}
    elif engine == "vllm":
        config[LAYER_IDS_KEY] = list(layer_ids)
    else:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    (dest / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return dest


def arch_from_config(config: dict[str, Any]) -> DrafterArch:
    mla = None
    if is_mla_config(config):
        mla = MlaShape(**{key: config[key] for key in MLA_CONFIG_KEYS})
    return DrafterArch(
        hidden_size=config["hidden_size"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_attention_heads"] if mla else config["num_key_value_heads"],
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else config["head_dim"],
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
        architecture=architecture_of(config),
        mla=mla,
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
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
