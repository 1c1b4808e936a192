"""Which layer outputs an engine captures for a draft config's aux layer ids, and the ids that capture given
layers: the one place in the project that knows how each engine and model family reads those ids.

The project's convention (pipeline.data.capture_contract): layer id k is the OUTPUT of 0-indexed decoder
layer k, i.e. HF `output_hidden_states[k + 1]`. Engines capture at "points": point p is the residual stream
ENTERING layer p (hidden + residual, before its norm), which is the output of layer p - 1. A forward visits
layers 0..N-1 and captures at p when it reaches layer p, so only points 0..N-1 are ever captured, in
ascending order, each once; point 0 is the embedding output, no decoder layer's output (reported here as
layer -1), and the last layer's output (point N) is never captured.

How an engine turns the ids it is given (a draft config's `eagle_aux_hidden_state_layer_ids`, or a
capture server's `--return-aux-hidden-state-layer-ids`) into points:

SGLang 0.5.23 (`set_eagle3_layers_to_capture` of the target model class; paths inside the wheel):
- llama family, sglang/srt/models/llama.py:929-941 (and the models that copy it: qwen2, qwen3, ...):
  no ids -> points [2, N//2, N-3] (:933-936); ids -> [k + 1 for k] (:938-941). Captured before layer p runs
  (:486-493).
- deepseek family, sglang/srt/models/deepseek_v2.py:3458-3473 (DeepseekV2/V3/V32ForCausalLM; Kimi-K2.5's
  KimiK25ForConditionalGeneration delegates to it, models/kimi_k25.py:928-939): no ids -> [2, N//2, N-3]
  (:3462-3465); ids whose FIRST id is 1 -> [k + 1 for k]; any other ids -> the ids unchanged (:3470-3473).
  So [1, 29, 57] captures outputs 1, 29, 57, but [2, 30, 58] captures outputs 1, 29, 57 too.
  Line numbers are those of the 0.5.23 wheel (sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl), where
  :3468-3473 carry the first-id-is-1 rule, with an upstream note asking whether other draft models need
  the same adjustment; older releases shifted every id, so pin one SGLang version for capture and serving.

vLLM (0.32, checked on this machine; vllm/model_executor/models/llama.py `get_eagle3_aux_hidden_state_layers`
  and LlamaModel.forward): ids are points as given, every family; no ids -> (2, N//2, N-3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

ModelFamily = Literal["llama", "deepseek"]
Engine = Literal["sglang", "vllm"]
MODEL_FAMILIES: tuple[ModelFamily, ...] = ("llama", "deepseek")
ENGINES: tuple[Engine, ...] = ("sglang", "vllm")

# Targets SGLang serves with models/deepseek_v2.py (kimi_k25.py:928-939 delegates to its
# DeepseekV3ForCausalLM), matched by architecture or model_type.
DEEPSEEK_FAMILY_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
    }
)
DEEPSEEK_FAMILY_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25"})
# The embedded tiny target's architectures (target.tiny.architecture) and the family SGLang serves them as:
# the deepseek_v3 one stands for Kimi-K2.5 (pipeline.engines.tiny_target).
TINY_TARGET_FAMILIES: dict[str, ModelFamily] = {"llama": "llama", "deepseek_v3": "deepseek"}
SOURCES = {
    "sglang": {
        "llama": "sglang/srt/models/llama.py:929-941",
        "deepseek": "sglang/srt/models/deepseek_v2.py:3458-3473",
    },
    "vllm": {
        "llama": "vllm/model_executor/models/llama.py (get_eagle3_aux_hidden_state_layers)",
        "deepseek": "vllm/model_executor/models/llama.py (get_eagle3_aux_hidden_state_layers)",
    },
}


class LayerIdsInexpressible(ValueError):
    """No id list makes this engine capture exactly these layer outputs on this target."""

    def __init__(self, engine: str, family: str, layer_outputs: list[int], num_layers: int, why: str):
        self.engine, self.family, self.layer_outputs, self.why = engine, family, list(layer_outputs), why
        source = SOURCES.get(engine, {}).get(family)
        super().__init__(
            f"{engine} cannot capture the outputs of layers {list(layer_outputs)} of a {num_layers}-layer "
            f"target ({family} family): {why}" + (f" ({source})" if source else "")
        )


# ---- the model family of a target -------------------------------------------------------------------------


def model_family(config: dict[str, Any]) -> ModelFamily:
    """The family whose capture rule SGLang applies to a target, from its config.json (a dict).

    Multimodal checkpoints (Kimi-K2.5) nest the language model under text_config; both levels are read.
    An MLA config (kv_lora_rank) is DeepSeek-family too: the project's tiny Kimi-style target ships
    DeepSeek-V3 under its own architecture name and stands for Kimi-K2.5.
    """
    text = config.get("text_config") or config
    architectures = set(config.get("architectures") or []) | set(text.get("architectures") or [])
    model_types = {config.get("model_type"), text.get("model_type")}
    deepseek = (
        architectures & DEEPSEEK_FAMILY_ARCHITECTURES
        or model_types & DEEPSEEK_FAMILY_MODEL_TYPES
        or text.get("kv_lora_rank") is not None
    )
    return "deepseek" if deepseek else "llama"


def model_family_of(model_dir: str | Path) -> ModelFamily:
    """model_family of the config.json in a model directory."""
    return model_family(json.loads((Path(model_dir) / "config.json").read_text()))


# ---- ids -> captured layer outputs ------------------------------------------------------------------------


def _require_known(engine: str, family: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    if family not in MODEL_FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(MODEL_FAMILIES)}")


def default_capture_points(num_layers: int) -> list[int]:
    """Where SGLang and vLLM capture for EAGLE-3 when no ids are given (llama.py:933-936)."""
    return [2, num_layers // 2, num_layers - 3]


def capture_points(
    engine: Engine, family: ModelFamily, draft_ids: list[int] | None, num_layers: int
) -> list[int]:
    """The points (inputs of layers) the engine sets for these ids, before the forward drops any."""
    _require_known(engine, family)
    if draft_ids is None:
        return default_capture_points(num_layers)
    ids = [int(k) for k in draft_ids]
    if engine == "vllm":
        return ids
    if family == "deepseek" and not (ids and ids[0] == 1):
        return ids  # deepseek_v2.py:3470-3473: shifted only when the first id is 1
    return [k + 1 for k in ids]  # llama.py:938-941, deepseek_v2.py:3470-3471


def captured_layer_outputs(
    engine: Engine, family: ModelFamily, draft_ids: list[int] | None, num_layers: int
) -> list[int]:
    """The layer outputs (project ids, ascending, distinct) the engine captures for a draft config's ids.

    None means no ids (the engine's default layers). Points outside the forward (>= N, or negative) are not
    captured, repeated points are captured once; point 0 is reported as -1, the embedding output.
    """
    points = capture_points(engine, family, draft_ids, num_layers)
    return [p - 1 for p in sorted({p for p in points if 0 <= p < num_layers})]


# ---- layer outputs -> ids ---------------------------------------------------------------------------------


def capturable_problem(layer_outputs: list[int], num_layers: int) -> str | None:
    """Why no engine can capture these layer outputs as aux states; None when every engine could."""
    if not layer_outputs:
        return "no layers given"
    if sorted(set(layer_outputs)) != list(layer_outputs):
        return "the layers must be distinct and ascending (each point is captured once, in layer order)"
    if layer_outputs[0] < 0:
        return "layer ids start at 0 (the output of the first decoder layer)"
    if layer_outputs[-1] > num_layers - 2:
        return (
            f"the last capturable output is layer {num_layers - 2}'s: the output of the last layer "
            f"({num_layers - 1}) is never the input of a layer, so no capture point reaches it"
        )
    return None


def hf_hidden_states_indices(layer_outputs: list[int], num_layers: int) -> list[int]:
    """Indices into transformers' output_hidden_states holding these layer outputs (index 0: embeddings),
    for the layers an engine can capture; raises LayerIdsInexpressible for others."""
    problem = capturable_problem(list(layer_outputs), num_layers)
    if problem is not None:
        raise LayerIdsInexpressible("hf", "every", list(layer_outputs), num_layers, problem)
    return [k + 1 for k in layer_outputs]


def draft_config_ids(
    engine: Engine, family: ModelFamily, layer_outputs: list[int], num_layers: int
) -> list[int]:
    """The ids to give the engine (draft config / capture server flag) so it captures exactly these outputs.

    Raises LayerIdsInexpressible naming engine, family, layers and why when no id list does.
    """
    _require_known(engine, family)
    outputs = [int(k) for k in layer_outputs]
    problem = capturable_problem(outputs, num_layers)
    if problem is not None:
        raise LayerIdsInexpressible(engine, family, outputs, num_layers, problem)
    shifted_by_the_engine = engine == "sglang" and (family == "llama" or outputs[0] == 1)
    ids = outputs if shifted_by_the_engine else [k + 1 for k in outputs]
    if captured_layer_outputs(engine, family, ids, num_layers) != outputs:
        # deepseek_v2.py:3470-3473: unshifted ids would start with 1, which switches the shift on, and
        # shifted ids would start with 0, which captures the embeddings
        raise LayerIdsInexpressible(
            engine,
            family,
            outputs,
            num_layers,
            "the first id decides whether SGLang shifts the ids: to capture layer 0's output first it would "
            "take the unshifted id 1, which switches the shift on",
        )
    return ids


def refuse_unservable_capture(layer_outputs: list[int], family: ModelFamily, num_layers: int) -> None:
    """Refuse, before any capture work, capture layers that no SGLang draft config can make SGLang capture:
    a drafter trained on them would be served other layers than it was trained on."""
    try:
        draft_config_ids("sglang", family, layer_outputs, num_layers)
    except LayerIdsInexpressible as err:
        raise LayerIdsInexpressible(
            err.engine,
            err.family,
            err.layer_outputs,
            num_layers,
            f"{err.why}; capture.aux_layer_ids must name layers a served drafter can be fed",
        ) from None
