"""SGLang 0.5.23's load-time behaviour for the MLA EAGLE-3 draft class, Eagle3DeepseekV2ForCausalLM
(models/kimi_k25_eagle3.py), modelled for pipeline.engines.sglang_draft_checks.

What differs from LlamaForCausalLMEagle3 (paths and lines inside the 0.5.23 wheel, `sglang/srt/...:line`):
- the config: the draft config class (transformers' DeepseekV2Config for model_type deepseek_v2) fills every
  MLA size the file lacks with DeepSeek-V2's, so a missing key is served silently at the wrong size;
  q_lora_rank null is refused (kimi_k25_eagle3.py:114-117); one layer only (:243-244); the aux count comes
  from eagle_config's ids, then the top-level ones, else 3 (:48-59);
- the weights: load_weights (:428-501) renames `layers.0.` to `midlayer.`, prefixes `model.` (so a checkpoint
  name that already has it is skipped), stacks gate/up, and fuses q_a_proj with kv_a_proj_with_mqa of the same
  prefix into fused_qkv_a_proj_with_mqa; an a-projection whose partner never arrives, or a pre-fused tensor,
  is dropped with no warning, and nothing checks that every parameter was filled.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.engines.sglang_draft_shapes import (
    DraftShape,
    MlaSizes,
    Param,
    TensorInfo,
    Unbuildable,
    sglang_problem,
)

MODEL_FILE = "sglang/srt/models/kimi_k25_eagle3.py"
# the sizes config.json must state: transformers' DeepseekV2Config gives each a default (DeepSeek-V2's)
MLA_SIZE_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
A_PROJ = "q_a_proj"
KV_A_PROJ = "kv_a_proj_with_mqa"
FUSED_A_PROJ = "fused_qkv_a_proj_with_mqa"
STACKED_MLP = ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))  # :430-433


def mla_config_problems(raw: dict[str, Any], config: Any) -> list[str]:
    """MLA sizes config.json leaves to the config class (raw: the file; config: what transformers made of
    it)."""
    problems = []
    for key in MLA_SIZE_KEYS:
        if key in raw:
            continue
        if getattr(config, key, None) is None:
            problems.append(
                sglang_problem(
                    f"draft config.json has no {key}",
                    "fails building the MLA attention (AttributeError)",
                    f"{MODEL_FILE}:95-99",
                    "sglang/srt/configs/model_config.py:1394-1397",
                )
            )
        else:
            problems.append(
                sglang_problem(
                    f"draft config.json has no {key}",
                    f"serves it broken: the config class ({type(config).__name__}) fills it with "
                    f"{getattr(config, key)}, a DeepSeek size, not the drafter's",
                    f"{MODEL_FILE}:95-99",
                )
            )
    return problems


def mla_draft_shape(config: Any, eagle: dict[str, Any]) -> DraftShape:
    """The parameter shapes Eagle3DeepseekV2ForCausalLM allocates (kimi_k25_eagle3.py:78-149, 199-255,
    331-364); raises Unbuildable when it cannot be built."""
    absent = [key for key in MLA_SIZE_KEYS if not hasattr(config, key)]
    if absent:  # a config class that is not DeepSeek's (e.g. model_type llama) keeps only what the file has
        raise Unbuildable(
            sglang_problem(
                f"draft config has no {', '.join(absent)}",
                "fails building the MLA attention (AttributeError)",
                f"{MODEL_FILE}:95-99",
                "sglang/srt/configs/model_config.py:1394-1397",
            )
        )
    if config.q_lora_rank is None:
        raise Unbuildable(
            sglang_problem(
                "draft q_lora_rank is null",
                "fails building the MLA layer (ValueError: Eagle3 MLA layer requires q_lora_rank)",
                f"{MODEL_FILE}:114-117",
            )
        )
    if int(config.num_hidden_layers) != 1:
        raise Unbuildable(
            sglang_problem(
                f"draft num_hidden_layers {config.num_hidden_layers}",
                "fails building the draft (ValueError: EAGLE3 currently only supports 1 layer)",
                f"{MODEL_FILE}:243-244",
            )
        )
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    draft_vocab = getattr(config, "draft_vocab_size", None)
    target_hidden = getattr(config, "target_hidden_size", None)
    return DraftShape(
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim),
        intermediate=int(config.intermediate_size),  # :137-143
        layers=1,
        vocab=int(config.vocab_size),
        draft_vocab=int(draft_vocab or config.vocab_size),  # :351-358
        target_hidden=int(target_hidden or hidden),  # :208-210
        num_aux=len(ids) if ids is not None else 3,  # :48-59
        fc_bias=bool(getattr(config, "bias", False)),  # :215
        o_proj_bias=False,
        norm_before_fc=False,  # not read by this class
        fc_norm=bool(getattr(config, "fc_norm", None) or getattr(config, "use_aux_norm", False)),  # :230-232
        norm_output=bool(getattr(config, "norm_output", False)),  # :255, :311
        tied=tied,  # :352-353
        lm_head_from_target=not tied and draft_vocab is None,  # :355-358
        shares_target_embedding=target_hidden is None or int(target_hidden) == hidden,  # :404-411
        mla=MlaSizes(
            q_lora_rank=int(config.q_lora_rank),
            kv_lora_rank=int(config.kv_lora_rank),
            qk_nope_head_dim=int(config.qk_nope_head_dim),
            qk_rope_head_dim=int(config.qk_rope_head_dim),
            v_head_dim=int(config.v_head_dim),
        ),
    )


def mla_expected_parameters(shape: DraftShape) -> dict[str, Param]:
    """Eagle3DeepseekV2ForCausalLM's named parameters and the shapes their loaders take. The fused
    a-projection's shards are the two checkpoint tensors it is concatenated from (:480-482)."""
    assert shape.mla is not None
    m, h, th, heads, inter = shape.mla, shape.hidden, shape.target_hidden, shape.heads, shape.intermediate
    attn = "model.midlayer.self_attn"
    params = {
        "model.embed_tokens.weight": Param(
            {None: (shape.vocab, h)}, required=not shape.shares_target_embedding
        ),
        "model.fc.weight": Param({None: (h, th * shape.num_aux)}),
        "model.norm.weight": Param({None: (h,)}),
        "model.midlayer.input_layernorm.weight": Param({None: (h,)}),
        "model.midlayer.hidden_norm.weight": Param({None: (h,)}),
        "model.midlayer.post_attention_layernorm.weight": Param({None: (h,)}),
        f"{attn}.{FUSED_A_PROJ}.weight": Param(
            {A_PROJ: (m.q_lora_rank, 2 * h), KV_A_PROJ: (m.kv_lora_rank + m.qk_rope_head_dim, 2 * h)}
        ),
        f"{attn}.q_a_layernorm.weight": Param({None: (m.q_lora_rank,)}),
        f"{attn}.q_b_proj.weight": Param(
            {None: (heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank)}
        ),
        f"{attn}.kv_a_layernorm.weight": Param({None: (m.kv_lora_rank,)}),
        f"{attn}.kv_b_proj.weight": Param(
            {None: (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)}
        ),
        f"{attn}.o_proj.weight": Param({None: (h, heads * m.v_head_dim)}),
        "model.midlayer.mlp.gate_up_proj.weight": Param({0: (inter, h), 1: (inter, h)}),
        "model.midlayer.mlp.down_proj.weight": Param({None: (h, inter)}),
    }
    if shape.fc_bias:
        params["model.fc.bias"] = Param({None: (h,)})
    if shape.fc_norm:
        params.update({f"model.fc_norm.{i}.weight": Param({None: (th,)}) for i in range(shape.num_aux)})
    if not shape.tied:
        params["lm_head.weight"] = Param(
            {None: (shape.draft_vocab, h)}, required=not shape.lm_head_from_target
        )
    return params


def mla_parameter_name(name: str) -> str:
    """The parameter name load_weights looks a checkpoint name up under (:445-450)."""
    mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
    return mapped if mapped.startswith("lm_head.") else f"model.{mapped}"


def mla_weight_problems(shape: DraftShape, tensors: dict[str, TensorInfo]) -> list[str]:
    """What Eagle3DeepseekV2ForCausalLM.load_weights (:428-501) does with these tensors: shapes its loaders
    reject, a-projections it drops, names it skips, and parameters nothing fills."""
    params = mla_expected_parameters(shape)
    problems: list[str] = []
    filled: set[tuple[str, Any]] = set()
    cached: dict[str, str] = {}  # mapped a-projection name -> checkpoint name, waiting for its partner
    for name, info in sorted(tensors.items()):
        if name in ("d2t", "t2d") or name.endswith((".d2t", ".t2d")):  # :437-443
            continue
        mapped = mla_parameter_name(name)
        stacked = _stacked_mlp(mapped, params)
        if stacked is not None:
            problems += _shape_problem(name, info, stacked[0], stacked[1], params, f"{MODEL_FILE}:452-465")
            filled.add(stacked)
            continue
        if A_PROJ in mapped or KV_A_PROJ in mapped:  # :467-492
            cached[mapped] = name
            q_name = mapped if A_PROJ in mapped else mapped.replace(KV_A_PROJ, A_PROJ)
            kv_name = mapped if KV_A_PROJ in mapped else mapped.replace(A_PROJ, KV_A_PROJ)
            if q_name in cached and kv_name in cached:
                fused = q_name.replace(A_PROJ, FUSED_A_PROJ)
                if fused in params:
                    for part, part_name in ((A_PROJ, q_name), (KV_A_PROJ, kv_name)):
                        where = "sglang/srt/layers/linear.py:376"
                        problems += _shape_problem(
                            cached[part_name], tensors[cached[part_name]], fused, part, params, where
                        )
                        filled.add((fused, part))
                cached.pop(q_name)
                cached.pop(kv_name)
            continue
        if mapped not in params:
            if name.startswith("model."):
                problems.append(
                    sglang_problem(
                        f"tensor {name} carries a model. prefix",
                        f"serves it broken: load_weights prefixes model. again, finds no {mapped} and "
                        "skips it with a warning",
                        f"{MODEL_FILE}:449-450",
                        f"{MODEL_FILE}:494-496",
                    )
                )
            continue
        problems += _shape_problem(
            name, info, mapped, None, params, "sglang/srt/model_loader/weight_utils.py:1582-1585"
        )
        filled.add((mapped, None))
    for mapped, name in sorted(cached.items()):
        partner = mapped.replace(A_PROJ, KV_A_PROJ) if A_PROJ in mapped else mapped.replace(KV_A_PROJ, A_PROJ)
        problems.append(
            sglang_problem(
                f"tensor {name} has no partner {partner.removeprefix('model.')} under the same prefix",
                "serves it broken: load_weights fuses q_a_proj with kv_a_proj_with_mqa only in pairs and "
                f"drops an unpaired one without a warning, so {FUSED_A_PROJ} keeps uninitialized memory",
                f"{MODEL_FILE}:467-492",
            )
        )
    for param, spec in params.items():
        missing = [s for s in spec.shards if (param, s) not in filled]
        if spec.required and missing:
            shards = f" (from {', '.join(str(s) for s in missing)})" if missing != [None] else ""
            problems.append(
                sglang_problem(
                    f"no tensor fills {param}{shards}",
                    "serves it broken: nothing checks that every parameter was filled, so it keeps its "
                    "initial values (uninitialized memory for linear layers)",
                    f"{MODEL_FILE}:428-501",
                    "sglang/srt/model_loader/loader.py:1028-1030",
                )
            )
    return problems


def _stacked_mlp(mapped: str, params: dict[str, Param]) -> tuple[str, Any] | None:
    for fused, part, shard in STACKED_MLP:
        if part in mapped and mapped.replace(part, fused) in params:
            return mapped.replace(part, fused), shard
    return None


def _shape_problem(
    name: str, info: TensorInfo, param: str, shard: Any, params: dict[str, Param], where: str
) -> list[str]:
    expected = params[param].shards[shard]
    if info.shape == expected:
        return []
    target = param if shard is None else f"{param} (its {shard} part)"
    return [
        sglang_problem(
            f"tensor {name} has shape {list(info.shape)}, but {target} takes {list(expected)}",
            "fails loading it: the weight loader asserts the shape (or narrows a parallel dimension), or, "
            "for an a-projection, splits the fused rows at the wrong place",
            where,
        )
    ]
