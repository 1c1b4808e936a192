"""What SGLang 0.5.23 checks when it starts with an EAGLE-3 draft model, checked here without a GPU.

`draft_model_problems` reads the target's config.json, the draft's config.json (through transformers, as
SGLang's get_config does) and the draft's safetensors header, and returns one message per reason SGLang
0.5.23 would not serve that draft with that target and those launch flags. The stand-in server
(harness.sglang_standin) refuses to start on any of them, so a drafter the real server would refuse is
refused in tests and rehearsals too.

Each message says what is wrong, what SGLang does with it, and where SGLang does it (paths inside the
0.5.23 wheel, `sglang/srt/...:line`). Two kinds of consequence are reported, and the message says which:
- SGLang fails: it raises while starting (argument validation, config or model construction, weight
  loading) or on the first draft forward (CUDA-graph capture / the warm-up request);
- SGLang serves it broken: it starts, but runs a draft that is not the one trained, e.g. a parameter the
  checkpoint does not fill keeps its uninitialized memory (load_weights skips what is absent), or the
  target captures other layers than the drafter was trained on.

The draft classes the project exports are modelled: LlamaForCausalLMEagle3 (models/llama_eagle3.py), with
EAGLE-3.1's flags (fc_norm or the legacy use_aux_norm, norm_output: top level only, :184-187 and :207;
norm_before_fc: eagle_config first, :169-175), the fc_norm.{i} parameters fc_norm creates (:188-196) and the
legacy aux_norm_{low,mid,high} names load_weights maps onto them (:337-348) (a tensor load_weights has no
parameter for is a problem too: it drops it silently, :362-378, so a trained weight would not be served);
and, for eagle3-mla drafters, Eagle3DeepseekV2ForCausalLM (models/kimi_k25_eagle3.py; its config reading and
load_weights in pipeline.engines.sglang_mla_checks).
Not checked, because they depend on the GPU, the attention backend or flags the pipeline does not set:
tensor-parallel divisibility of heads (models/llama.py:183-193), topk > 1 with page_size > 1 on backends
other than flashinfer/fa3/triton (arg_groups/speculative_hook.py:1268-1282), trtllm_mha with topk > 1
(speculative_hook.py:1176-1180), rejection sampling / block verification / DP spec-prefill coordination /
adaptive steps (speculative_hook.py:175-195, 252-264, 1210-1253), the device checks of every algorithm, and
rope types (get_rope, models/llama.py:225-232). The draft's dtype is not a refusal: SGLang resolves it from
the draft's own config (float32 runs as float16 under --dtype auto, configs/model_config.py:2284-2345).
Weights in *.bin pickles are never opened here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.engines.layer_ids import (
    SOURCES,
    ModelFamily,
    capture_points,
    captured_layer_outputs,
    model_family,
)
from pipeline.engines.sglang_draft_shapes import (
    SGLANG_VERSION,
    DraftShape,
    Param,
    Shard,
    TensorInfo,
    Unbuildable,
    sglang_problem,
)
from pipeline.engines.sglang_mla_checks import mla_config_problems, mla_draft_shape, mla_weight_problems

DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
# models/kimi_k25_eagle3.py:523 registers the other EAGLE-3 draft class of 0.5.23 (MLA attention)
MLA_DRAFT_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
DRAFT_ARCHITECTURES = (DRAFT_ARCHITECTURE, MLA_DRAFT_ARCHITECTURE)
# configs/model_config.py / utils/hf_transformers/common.py:668-674, in SGLang's order of preference
CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class SpeculativeArgs:
    """The speculative-decoding launch flags; None means the flag was not given."""

    algorithm: str | None
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None


class DraftModelRefused(ValueError):
    """SGLang 0.5.23 would not serve this draft model with this target and these flags."""


@dataclass(frozen=True)
class TargetFacts:
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int
    deepseek_capture: bool  # SGLang serves it with models/deepseek_v2.py (pipeline.engines.layer_ids)

    @property
    def family(self) -> ModelFamily:
        return "deepseek" if self.deepseek_capture else "llama"


def draft_model_problems(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    speculative: SpeculativeArgs,
    *,
    context_length: int | None = None,
    trust_remote_code: bool = False,
) -> list[str]:
    """Every reason SGLang 0.5.23 would fail with, or serve broken, this draft for this target; [] if none.

    context_length is the server's --context-length (None: the target's own); only EAGLE3 loads a draft.
    """
    if speculative.algorithm != "EAGLE3":
        return []
    target = read_target(Path(target_dir))
    problems = speculative_arg_problems(speculative, target.architecture)
    if draft_dir is None:
        return problems + [
            sglang_problem(
                "--speculative-algorithm EAGLE3 without --speculative-draft-model-path",
                "reads the target checkpoint itself as the draft model, which is no EAGLE-3 drafter",
                "sglang/srt/arg_groups/speculative_hook.py:1138-1147",
                "sglang/srt/configs/model_config.py:956",
            )
        ]
    draft_dir = Path(draft_dir)
    config, unreadable = _read_draft_config(draft_dir, trust_remote_code)
    if config is None:
        return problems + unreadable
    problems += context_problems(target, config, context_length)
    try:
        shape = draft_shape(config)
    except Unbuildable as unbuildable:
        return problems + [str(unbuildable)]
    problems += config_problems(config)
    if shape.mla is not None:
        problems += mla_config_problems(json.loads((draft_dir / "config.json").read_text()), config)
    problems += target_fit_problems(target, shape)
    problems += aux_layer_problems(target, config, shape, _trained_aux_layer_ids(draft_dir))
    tensors, files_problems = read_weight_header(draft_dir)
    if files_problems:
        return problems + files_problems
    if shape.mla is not None:
        problems += mla_weight_problems(shape, tensors)
    else:
        problems += weight_problems(shape, tensors)
    problems += hot_token_problems(shape, tensors, _d2t_values(draft_dir, tensors), target.vocab_size)
    return problems


def require_loadable_draft(
    target_dir: str | Path, draft_dir: str | Path | None, speculative: SpeculativeArgs, **options: Any
) -> None:
    """Raise DraftModelRefused naming every problem draft_model_problems finds."""
    problems = draft_model_problems(target_dir, draft_dir, speculative, **options)
    if problems:
        raise DraftModelRefused(
            f"SGLang {SGLANG_VERSION} would not serve draft model {draft_dir} for target "
            f"{target_dir}:\n  - " + "\n  - ".join(problems)
        )


# ---- the target --------------------------------------------------------------------------------------------


def read_target(target_dir: Path) -> TargetFacts:
    """The target facts a draft must agree with, from config.json (its text part for multimodal targets)."""
    from pipeline.engines.target import text_config

    top = json.loads((target_dir / "config.json").read_text())
    text = text_config(target_dir)
    architecture = (top.get("architectures") or [""])[0]
    return TargetFacts(
        architecture=architecture,
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        context_length=derived_context_length(text),
        deepseek_capture=model_family(top) == "deepseek",
    )


def derived_context_length(config: Any) -> int:
    """SGLang's get_context_length (utils/hf_transformers/common.py:677-694) of a config dict or object.

    transformers 5 reads a config.json `rope_scaling` into `rope_parameters` and returns that for
    `rope_scaling`.
    """

    def field(key: str) -> Any:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    rope = field("rope_scaling") or field("rope_parameters")
    factor = 1
    if rope and "original_max_position_embeddings" not in rope and rope.get("rope_type") != "llama3":
        factor = rope.get("factor", 1)
    for key in CONTEXT_LENGTH_KEYS:
        if field(key) is not None:
            return int(factor * field(key))
    return 2048


# ---- the launch flags --------------------------------------------------------------------------------------


def effective_speculative_args(args: SpeculativeArgs, target_architecture: str) -> SpeculativeArgs:
    """The steps / topk / draft tokens SGLang 0.5.23 runs EAGLE3 with, after its defaults and adjustments."""
    if args.num_steps is None and args.eagle_topk is None and args.num_draft_tokens is None:
        # speculative_hook.py:1159-1174 and 1430-1461 (_auto_choose_speculative_params)
        steps, topk, tokens = (
            (5, 4, 8)
            if target_architecture in ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")
            else (3, 1, 4)
        )
        return replace(args, num_steps=steps, eagle_topk=topk, num_draft_tokens=tokens)
    if args.num_steps is not None and args.eagle_topk == 1 and args.num_draft_tokens != args.num_steps + 1:
        # speculative_hook.py:1255-1266: a warning, and draft tokens become steps + 1
        return replace(args, num_draft_tokens=args.num_steps + 1)
    return args


def speculative_arg_problems(args: SpeculativeArgs, target_architecture: str) -> list[str]:
    """The EAGLE3 steps / topk / draft-token combinations SGLang 0.5.23 cannot run."""
    if args.num_steps is None and (args.eagle_topk is not None or args.num_draft_tokens is not None):
        return [
            sglang_problem(
                "--speculative-eagle-topk or --speculative-num-draft-tokens without --speculative-num-steps",
                "fails at startup: an assertion wants all three flags or none",
                "sglang/srt/arg_groups/speculative_hook.py:1159-1163",
            )
        ]
    args = effective_speculative_args(args, target_architecture)
    # the defaults fill num_steps when it was missing; without them the check above has returned
    assert args.num_steps is not None
    if args.eagle_topk is None:
        return [
            sglang_problem(
                "--speculative-num-steps without --speculative-eagle-topk",
                "fails at startup comparing the missing topk with 1 (TypeError)",
                "sglang/srt/arg_groups/speculative_hook.py:1273-1276",
            )
        ]
    if args.eagle_topk > 1:
        return _draft_tree_problems(args.num_steps, args.eagle_topk, args.num_draft_tokens)
    return []


def _draft_tree_problems(steps: int, topk: int, draft_tokens: int | None) -> list[str]:
    # A topk > 1 draft scores topk tokens at step 1 and topk * topk at each later step, then keeps the best
    # num_draft_tokens - 1 of them with torch.topk (spec_utils.py:417-470, eagle_utils.py:100-110).
    candidates = topk + (steps - 1) * topk * topk
    where = ("sglang/srt/speculative/eagle_utils.py:100-110", "sglang/srt/speculative/spec_utils.py:417-470")
    if draft_tokens is None:
        return [
            sglang_problem(
                f"--speculative-eagle-topk {topk} without --speculative-num-draft-tokens",
                "fails building the first draft tree (num_draft_tokens - 1 of None)",
                *where,
            )
        ]
    if not 0 <= draft_tokens - 1 <= candidates:
        return [
            sglang_problem(
                f"--speculative-num-draft-tokens {draft_tokens} with {steps} steps and topk {topk}",
                f"fails building the first draft tree: it keeps num_draft_tokens - 1 = {draft_tokens - 1} "
                f"of {candidates} candidates (topk + (steps - 1) * topk^2) with torch.topk",
                *where,
            )
        ]
    return []


# ---- the draft config --------------------------------------------------------------------------------------


def _read_draft_config(draft_dir: Path, trust_remote_code: bool) -> tuple[Any | None, list[str]]:
    """The draft config as SGLang reads it: transformers' AutoConfig
    (utils/hf_transformers/config.py:378-380)."""
    from transformers import AutoConfig

    if not (draft_dir / "config.json").is_file():
        return None, [
            sglang_problem(
                f"draft directory {draft_dir} has no config.json",
                "fails reading its config",
                "sglang/srt/utils/hf_transformers/config.py:378-380",
            )
        ]
    try:
        return AutoConfig.from_pretrained(str(draft_dir), trust_remote_code=trust_remote_code), []
    except Exception as err:  # whatever transformers raises here, SGLang's get_config raises too
        return None, [
            sglang_problem(
                f"draft config.json does not load ({type(err).__name__}: {err})",
                "fails reading it with transformers",
                "sglang/srt/utils/hf_transformers/config.py:378-380",
            )
        ]


def _eagle_config(config: Any) -> dict[str, Any]:
    eagle = getattr(config, "eagle_config", None) or {}
    if not isinstance(eagle, dict):
        # llama_eagle3.py:159-160 calls .get on it while building the model
        raise Unbuildable(
            sglang_problem(
                f"eagle_config is a {type(eagle).__name__}, not an object",
                "fails building the draft model",
                "sglang/srt/models/llama_eagle3.py:159-160",
            )
        )
    return eagle


def _require_draft_architecture(config: Any) -> None:
    architectures = getattr(config, "architectures", None)
    if not architectures:
        raise Unbuildable(
            sglang_problem(
                "draft config.json has no architectures",
                "fails indexing architectures[0]",
                "sglang/srt/configs/model_config.py:699",
            )
        )
    if architectures[0] not in DRAFT_ARCHITECTURES:
        # the registry takes architectures[0] first (models/registry.py:98-104); only the EAGLE-3 draft
        # classes carry the hot_token_id the EAGLE3 worker reads (llama_eagle3.py:323)
        raise Unbuildable(
            sglang_problem(
                f"draft architectures {list(architectures)} do not start with "
                f"{' or '.join(DRAFT_ARCHITECTURES)}",
                "fails when the EAGLE3 worker reads the draft's hot_token_id",
                "sglang/srt/models/registry.py:98-104",
                "sglang/srt/speculative/eagle_worker_v2.py:366",
            )
        )


def _draft_vocab(config: Any, tied: bool) -> tuple[int, bool]:
    """(draft vocabulary size, lm_head comes from the target) as llama_eagle3.py:302-320 decides them."""
    if tied:  # the logits processor still uses draft_vocab_size (llama_eagle3.py:316-320)
        return int(getattr(config, "draft_vocab_size", None) or config.vocab_size), False
    if not hasattr(config, "draft_vocab_size"):
        raise Unbuildable(
            sglang_problem(
                "draft config.json has no draft_vocab_size",
                "fails building the draft model (AttributeError)",
                "sglang/srt/models/llama_eagle3.py:306",
            )
        )
    if config.draft_vocab_size is None:
        return int(config.vocab_size), True
    return int(config.draft_vocab_size), False


def _target_hidden(config: Any) -> int:
    # llama_eagle3.py:151-154 uses target_hidden_size whenever the attribute exists, even when it is null
    if not hasattr(config, "target_hidden_size"):
        return int(config.hidden_size)
    if config.target_hidden_size is None:
        raise Unbuildable(
            sglang_problem(
                "draft config.json has target_hidden_size: null",
                "fails sizing the fc layer from it",
                "sglang/srt/models/llama_eagle3.py:151-167",
            )
        )
    return int(config.target_hidden_size)


def draft_shape(config: Any) -> DraftShape:
    """The parameter shapes LlamaForCausalLMEagle3 allocates; raises Unbuildable when it cannot be built."""
    _require_draft_architecture(config)
    eagle = _eagle_config(config)
    if config.architectures[0] == MLA_DRAFT_ARCHITECTURE:
        return mla_draft_shape(config, eagle)
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    draft_vocab, head_from_target = _draft_vocab(config, tied)
    target_hidden = _target_hidden(config)
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return DraftShape(
        hidden=hidden,
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),  # llama.py:196-198
        # llama_eagle3.py:77-80
        intermediate=int(
            config.intermediate_size_mlp if config.model_type == "llama4_text" else config.intermediate_size
        ),
        layers=int(config.num_hidden_layers),
        vocab=int(config.vocab_size),
        draft_vocab=draft_vocab,
        target_hidden=target_hidden,
        num_aux=int(getattr(config, "num_aux_hidden_states", None) or (len(ids) if ids else 3)),  # :156-161
        fc_bias=bool(getattr(config, "bias", False)),  # :163-167
        o_proj_bias=bool(
            getattr(config, "attention_bias", False) or getattr(config, "bias", False)
        ),  # llama.py:339
        norm_before_fc=bool(
            eagle.get("norm_before_fc", getattr(config, "norm_before_fc", False))
        ),  # :173-182
        # top level only, or the legacy use_aux_norm (:184-187); one RMSNorm per aux state (:188-196)
        fc_norm=bool(getattr(config, "fc_norm", None) or getattr(config, "use_aux_norm", False)),
        norm_output=bool(getattr(config, "norm_output", False)),  # top level only (:207)
        tied=tied,
        lm_head_from_target=head_from_target,
        # llama.py:910-916: the target's embedding is shared unless target_hidden_size differs from
        # hidden_size
        shares_target_embedding=not hasattr(config, "target_hidden_size") or target_hidden == hidden,
    )


# EAGLE-3.1 flags SGLang reads only from config.json's top level (llama_eagle3.py:184-187, :207)
TOP_LEVEL_ONLY_FLAGS = ("fc_norm", "use_aux_norm", "norm_output")


def config_problems(config: Any) -> list[str]:
    """Draft config values SGLang refuses or drops while building the model."""
    problems = []
    eagle = getattr(config, "eagle_config", None)
    misplaced = [
        flag
        for flag in TOP_LEVEL_ONLY_FLAGS
        if isinstance(eagle, dict)
        and flag in eagle
        and bool(eagle[flag]) != bool(getattr(config, flag, False))
    ]
    if misplaced:
        problems.append(
            sglang_problem(
                f"eagle_config sets {', '.join(misplaced)} to other values than config.json's top level",
                "serves it broken: it reads these flags only at the top level and ignores eagle_config's",
                "sglang/srt/models/llama_eagle3.py:184-187",
                "sglang/srt/models/llama_eagle3.py:207",
            )
        )
    if config.hidden_act != "silu":
        problems.append(
            sglang_problem(
                f"draft hidden_act {config.hidden_act!r}",
                "fails building the draft MLP: only silu is supported",
                "sglang/srt/models/llama.py:116-119 (MLA: sglang/srt/models/deepseek_v2.py:330-333)",
            )
        )
    if getattr(config, "tie_word_embeddings", False):
        problems.append(
            sglang_problem(
                "draft tie_word_embeddings is true",
                "serves it broken: lm_head becomes the embedding, so the checkpoint's trained lm_head.weight "
                "has no parameter to load into and is dropped",
                "sglang/srt/models/llama_eagle3.py:303-304",
            )
        )
    return problems


def context_problems(target: TargetFacts, config: Any, context_length: int | None) -> list[str]:
    """A draft whose derived context length is shorter than the target's is refused (configs/model_config.py).

    The draft worker builds the draft's ModelConfig with the target's context length (eagle_worker_v2.py:229,
    managers/tp_worker.py:466-482); _derive_context_length raises unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN (or SGLANG_IS_IN_CI, sglang/utils.py:424) is set, and then
    overrides the draft's max_position_embeddings.
    """
    if _env_flag("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN") or _env_flag("SGLANG_IS_IN_CI"):
        return []
    where = "sglang/srt/configs/model_config.py:1291-1316"
    problems = []
    serving = target.context_length
    if context_length is not None:
        if context_length > target.context_length:
            problems.append(
                sglang_problem(
                    f"--context-length {context_length} exceeds the target's derived context length "
                    f"{target.context_length}",
                    f"fails at startup with ValueError: User-specified context_length ({context_length}) "
                    f"is greater than the derived context_length ({target.context_length})",
                    where,
                )
            )
        serving = context_length
    draft_context = derived_context_length(config)
    if serving > draft_context:
        problems.append(
            sglang_problem(
                f"the draft's derived context length {draft_context} (max_position_embeddings "
                f"{getattr(config, 'max_position_embeddings', None)}) is shorter than the target's {serving}",
                f"fails at startup with ValueError: Target model's context_length ({serving}) is greater "
                f"than the derived context_length ({draft_context}); "
                "set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 to override it",
                where,
                "sglang/srt/speculative/eagle_worker_v2.py:229",
            )
        )
    return problems


def _env_flag(name: str) -> bool:
    # SGLang's EnvBool (environ.py:143-151): true/1/yes/y; anything else unparsable counts as the default,
    # False
    return os.environ.get(name, "").lower() in ("true", "1", "yes", "y")


# ---- draft against target ----------------------------------------------------------------------------------


def target_fit_problems(target: TargetFacts, shape: DraftShape) -> list[str]:
    """Widths and vocabularies the draft shares with the target."""
    problems = []
    if shape.target_hidden != target.hidden_size:
        # fc takes num_aux states of target_hidden_size each (llama_eagle3.py:151-167, eagle_utils.py:265-275)
        problems.append(
            sglang_problem(
                f"the draft reads target states of width {shape.target_hidden} "
                "(target_hidden_size, else hidden_size) "
                f"but the target's hidden_size is {target.hidden_size}",
                f"fails feeding the target's {shape.num_aux} x {target.hidden_size} aux states into an fc "
                f"built for {shape.num_aux} x {shape.target_hidden}",
                "sglang/srt/models/llama_eagle3.py:151-167",
                "sglang/srt/speculative/eagle_utils.py:265-275",
            )
        )
    if shape.vocab != target.vocab_size:
        problems.append(
            sglang_problem(
                f"draft vocab_size {shape.vocab} differs from the target's {target.vocab_size}",
                "serves it broken: the draft embeds target token ids with an embedding sized by its own "
                "vocab_size (ids beyond it are out of range, and tensor-parallel shards split the vocabulary "
                "at other rows) while the weight is the target's",
                "sglang/srt/models/llama_eagle3.py:144-149",
                "sglang/srt/models/llama.py:910-918",
                "sglang/srt/layers/vocab_parallel_embedding.py:515-521",
            )
        )
    return problems


def sglang_capture_points(target: TargetFacts, layer_ids: list[int] | None) -> list[int]:
    """The target layers whose input SGLang captures for the draft's eagle_aux_hidden_state_layer_ids
    (the rule per family lives in pipeline.engines.layer_ids)."""
    return capture_points("sglang", target.family, layer_ids, target.num_layers)


def aux_layer_problems(
    target: TargetFacts, config: Any, shape: DraftShape, trained_ids: list[int] | None
) -> list[str]:
    """Whether the target captures the layers the draft's fc expects and was trained on.

    The target reads eagle_config (model_runner_components/spec_aux_hidden_state.py:185-196):
    use_aux_hidden_state defaults to true, missing layer ids mean SGLang's default layers. Capture
    point p is the input of layer p, i.e. the output of layer p - 1, which is the project's layer id
    (pipeline.data.capture_contract).
    """
    eagle = _eagle_config(config)
    if not eagle.get("use_aux_hidden_state", True):
        return [
            sglang_problem(
                "eagle_config.use_aux_hidden_state is false",
                "serves it broken: the target captures no aux states and the draft gets the last hidden "
                "state instead, skipping fc",
                "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py:189",
                "sglang/srt/speculative/eagle_utils.py:261-264",
                "sglang/srt/models/llama_eagle3.py:237-247",
            )
        ]
    layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    points = sglang_capture_points(target, layer_ids)
    served = captured_layer_outputs("sglang", target.family, layer_ids, target.num_layers)
    capture_where = SOURCES["sglang"][target.family]
    if len(served) != shape.num_aux:
        # only layers the forward loop visits are captured (llama.py:486-493; deepseek's packer then raises,
        # layers/aux_hidden_states.py:84-89)
        return [
            sglang_problem(
                f"eagle_aux_hidden_state_layer_ids {layer_ids} give capture points {points} on a "
                f"{target.num_layers}-layer target, {len(served)} distinct in range",
                f"fails: the draft's fc takes {shape.num_aux} aux states",
                capture_where,
                "sglang/srt/models/llama_eagle3.py:156-167",
            )
        ]
    trained = sorted(trained_ids if trained_ids is not None else (layer_ids or served))
    if served != trained:
        return [
            sglang_problem(
                f"the drafter was trained on the outputs of layers {trained} "
                "(capture_contract.json, else eagle_config)",
                f"serves it broken: it captures the outputs of layers {served} for "
                f"eagle_aux_hidden_state_layer_ids {layer_ids}",
                capture_where,
                "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py:185-196",
            )
        ]
    return []


def _trained_aux_layer_ids(draft_dir: Path) -> list[int] | None:
    """The layers the drafter was trained on, from the project's capture contract next to it (if any)."""
    contract = draft_dir / "capture_contract.json"
    if not contract.is_file():
        return None
    ids = json.loads(contract.read_text()).get("aux_layer_ids")
    return list(ids) if ids is not None else None


# ---- the draft weights -------------------------------------------------------------------------------------


def read_weight_header(draft_dir: Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """Names, shapes and dtypes of every tensor SGLang would read, without loading them.

    SGLang reads every *.safetensors file, restricted to the index's files when there is an index
    (model_loader/loader.py:545-582).
    """
    from safetensors import safe_open

    files = _weight_files(draft_dir)
    if not files:
        return {}, [
            sglang_problem(
                f"draft directory {draft_dir} has no *.safetensors weights",
                'fails ("Cannot find any model weights") unless it finds *.bin pickles, which this '
                "project never loads",
                "sglang/srt/model_loader/loader.py:579-582",
            )
        ]
    tensors = {}
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as handle:
                for name in handle.keys():
                    info = handle.get_slice(name)
                    tensors[name] = TensorInfo(tuple(info.get_shape()), info.get_dtype())
        except Exception as err:  # safetensors' own error type: a file SGLang's loader cannot read either
            return {}, [
                sglang_problem(
                    f"draft weights {path.name} are unreadable ({err})",
                    "fails loading them",
                    "sglang/srt/model_loader/loader.py:545-582",
                )
            ]
    return tensors, []


def _weight_files(draft_dir: Path) -> list[Path]:
    files = sorted(draft_dir.glob("*.safetensors"))
    index = draft_dir / "model.safetensors.index.json"
    if index.is_file():
        listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
        files = [path for path in files if path.name in listed]
    return files


def expected_parameters(shape: DraftShape) -> dict[str, Param]:
    """LlamaForCausalLMEagle3's named parameters (llama_eagle3.py:122-320) and the shapes their loaders
    take."""
    h, th = shape.hidden, shape.target_hidden
    params = {
        # shared with the target's embedding (then not loaded from the draft) unless the widths differ
        "model.embed_tokens.weight": Param(
            {None: (shape.vocab, h)}, required=not shape.shares_target_embedding
        ),
        "model.fc.weight": Param({None: (h, th * shape.num_aux)}),
        "model.norm.weight": Param({None: (h,)}),
    }
    if shape.fc_bias:
        params["model.fc.bias"] = Param({None: (h,)})
    if shape.norm_before_fc:
        params["model.input_norm.weight"] = Param({None: (th * shape.num_aux,)})
    if shape.fc_norm:
        params.update({f"model.fc_norm.{i}.weight": Param({None: (th,)}) for i in range(shape.num_aux)})
    for layer in range(shape.layers):
        params.update(_layer_parameters(shape, layer))
    if not shape.tied:
        # a draft without draft_vocab_size gets the target's lm_head (eagle_worker_v2.py:356-361)
        params["lm_head.weight"] = Param(
            {None: (shape.draft_vocab, h)}, required=not shape.lm_head_from_target
        )
    return params


def _layer_parameters(shape: DraftShape, layer: int) -> dict[str, Param]:
    h, inter = shape.hidden, shape.intermediate
    width_in = 2 * h if layer == 0 else h  # layer 0 reads [embeds, hidden] (llama_eagle3.py:62-75)
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    prefix = f"model.layers.{layer}"
    params = {
        f"{prefix}.self_attn.qkv_proj.weight": Param(
            {"q": (q_rows, width_in), "k": (kv_rows, width_in), "v": (kv_rows, width_in)}
        ),
        f"{prefix}.self_attn.o_proj.weight": Param({None: (h, q_rows)}),
        f"{prefix}.mlp.gate_up_proj.weight": Param({0: (inter, h), 1: (inter, h)}),
        f"{prefix}.mlp.down_proj.weight": Param({None: (h, inter)}),
        f"{prefix}.input_layernorm.weight": Param({None: (h,)}),
        f"{prefix}.post_attention_layernorm.weight": Param({None: (h,)}),
        f"{prefix}.hidden_norm.weight": Param({None: (h,)}),
    }
    if shape.o_proj_bias:
        params[f"{prefix}.self_attn.o_proj.bias"] = Param({None: (h,)})
    return params


# llama_eagle3.py:337-343 renames; :327-335 stacks q/k/v and gate/up into fused parameters
LEGACY_NAMES = (
    ("midlayer", "layers.0"),
    ("aux_norm_low", "fc_norm.0"),
    ("aux_norm_mid", "fc_norm.1"),
    ("aux_norm_high", "fc_norm.2"),
)
STACKED_NAMES = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


def sglang_parameter_for(name: str, params: dict[str, Param]) -> tuple[str, Shard] | None:
    """The (parameter, shard) LlamaForCausalLMEagle3.load_weights puts a checkpoint tensor in; None: it is
    dropped.

    Mirrors llama_eagle3.py:345-378; d2t and t2d are handled before this (:350-356).
    """
    for legacy, new in LEGACY_NAMES:
        if legacy in name:
            name = name.replace(legacy, new)
    shard: Shard = None
    for fused, part, part_shard in STACKED_NAMES:
        if part in name:
            name, shard = name.replace(part, fused), part_shard
            break
    param = name if name in params else f"model.{name}"
    return (param, shard) if param in params else None


def weight_problems(shape: DraftShape, tensors: dict[str, TensorInfo]) -> list[str]:
    """Tensors whose shape SGLang's loaders reject, and parameters no tensor fills."""
    params = expected_parameters(shape)
    problems, filled = [], set()
    for name, info in sorted(tensors.items()):
        if "d2t" in name or "t2d" in name:
            continue
        target = sglang_parameter_for(name, params)
        if target is None:
            if not (shape.tied and name.startswith("lm_head")):  # a tied lm_head: config_problems says why
                problems.append(_dropped_tensor(name))
            continue
        param, shard = target
        shards = params[param].shards
        expected = shards[shard] if shard is not None else _whole_shape(shards)
        if info.shape != expected:
            problems.append(
                sglang_problem(
                    f"tensor {name} has shape {list(info.shape)}, "
                    f"but {_described(param, shard)} takes {list(expected)}",
                    "fails loading it: the weight loader asserts the shape "
                    "(or narrows/pads a parallel dimension)",
                    _loader_assertion(param),
                )
            )
        filled |= {(param, s) for s in (shards if shard is None else [shard])}
    for param, spec in params.items():
        missing = [s for s in spec.shards if (param, s) not in filled]
        if spec.required and missing:
            problems.append(_missing_parameter(param, missing, shape))
    return problems


def _dropped_tensor(name: str) -> str:
    what = f"tensor {name} has no parameter to load into"
    if "fc_norm." in name or "aux_norm_" in name:
        what += " (the fc_norm weights exist only when config.json's top level sets fc_norm or use_aux_norm)"
    return sglang_problem(
        what,
        "serves it broken: load_weights drops it silently, so the draft runs without weights trained for it",
        "sglang/srt/models/llama_eagle3.py:184-196",
        "sglang/srt/models/llama_eagle3.py:362-378",
    )


def _whole_shape(shards: dict[Shard, tuple[int, ...]]) -> tuple[int, ...]:
    """A fused checkpoint tensor (qkv_proj, gate_up_proj) stacks its shards along the output rows."""
    parts = list(shards.values())
    return (sum(part[0] for part in parts), *parts[0][1:])


def _described(param: str, shard: Shard) -> str:
    return param if shard is None else f"{param} (shard {shard})"


def _loader_assertion(param: str) -> str:
    if ".qkv_proj." in param:
        return "sglang/srt/layers/linear.py:1547"
    if ".gate_up_proj." in param:
        return "sglang/srt/layers/linear.py:894"
    if ".o_proj." in param or ".down_proj." in param:
        return "sglang/srt/layers/linear.py:1708"
    if "embed_tokens" in param or param.startswith("lm_head"):
        return "sglang/srt/layers/vocab_parallel_embedding.py:436-446"
    return "sglang/srt/model_loader/weight_utils.py:1582-1585"


def _missing_parameter(param: str, shards: list[Shard], shape: DraftShape) -> str:
    what = f"no tensor fills {param}" + (f" (shards {shards})" if shards != [None] else "")
    if param == "model.embed_tokens.weight":
        what += (
            f": the target's embedding is not shared because target_hidden_size {shape.target_hidden} "
            f"differs from hidden_size {shape.hidden} (models/llama.py:910-916)"
        )
    return sglang_problem(
        what,
        "serves it broken: load_weights skips what the checkpoint lacks, so the parameter keeps "
        "its untrained initial values (uninitialized memory for linear layers)",
        "sglang/srt/models/llama_eagle3.py:345-378",
    )


# ---- the hot-token map (d2t) -------------------------------------------------------------------------------


def _is_float(dtype: str) -> bool:
    return dtype == "BF16" or dtype.startswith(
        "F"
    )  # safetensors names: F16, F32, F8_E4M3, ...; I64, U8, BOOL


def _d2t_values(draft_dir: Path, tensors: dict[str, TensorInfo]) -> Any:
    """The d2t offsets (a small int array), read from the file that holds them; None without a usable d2t."""
    from safetensors import safe_open

    name = next((n for n in sorted(tensors) if "d2t" in n), None)
    if name is None or _is_float(tensors[name].dtype) or len(tensors[name].shape) != 1:
        return None
    for path in _weight_files(draft_dir):
        with safe_open(str(path), framework="numpy") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None


def hot_token_problems(
    shape: DraftShape, tensors: dict[str, TensorInfo], d2t: Any, target_vocab: int
) -> list[str]:
    """d2t: hot_token_id = d2t + arange (llama_eagle3.py:350-353) maps draft ids to target ids
    (eagle_worker_v2.py:366-369, 897-898); t2d is ignored by SGLang (llama_eagle3.py:355-356)."""
    where = ("sglang/srt/models/llama_eagle3.py:350-353", "sglang/srt/speculative/eagle_worker_v2.py:897-898")
    name = next((n for n in sorted(tensors) if "d2t" in n), None)
    if name is None:
        if shape.draft_vocab == shape.vocab:
            return []
        return [
            sglang_problem(
                f"no d2t tensor for a draft vocabulary of {shape.draft_vocab} (vocab {shape.vocab})",
                "serves it broken: without hot_token_id it takes draft token ids for target token ids",
                "sglang/srt/models/llama_eagle3.py:323",
                *where,
            )
        ]
    info = tensors[name]
    if _is_float(info.dtype) or len(info.shape) != 1:
        return [
            sglang_problem(
                f"{name} is {info.dtype} {list(info.shape)}, not 1-D integer offsets",
                "fails using hot_token_id (d2t + arange) as token ids",
                *where,
            )
        ]
    if info.shape[0] < shape.draft_vocab:
        return [
            sglang_problem(
                f"{name} has {info.shape[0]} entries for a draft vocabulary of {shape.draft_vocab}",
                "fails indexing hot_token_id with draft token ids beyond it",
                *where,
            )
        ]
    import numpy as np

    hot_ids = d2t.astype(np.int64) + np.arange(d2t.shape[0])
    if hot_ids.min() < 0 or hot_ids.max() >= target_vocab:
        return [
            sglang_problem(
                f"{name} maps draft ids to target ids {int(hot_ids.min())}..{int(hot_ids.max())}, outside "
                f"the target vocabulary of {target_vocab}",
                "fails embedding those draft tokens",
                *where,
            )
        ]
    return []
