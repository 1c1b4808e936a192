"""The capture contract: what a hidden-state capture means, written into every capture manifest.

Layer convention: aux layer id k means "the output of 0-indexed decoder layer k", which is
HF `output_hidden_states[k + 1]` and SGLang capture point k + 1 (the residual stream entering
layer k + 1). The three aux states are concatenated in ascending layer order.

Any disagreement between a manifest's contract and what a trainer, exporter or server expects is an
error (ContractMismatch), never a warning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipeline.config_base import Strict

LAYER_CONVENTION = "output_of_decoder_layer_k == hf_hidden_states[k+1] == sglang_capture_point[k+1]"

# Fields whose disagreement makes captured features mean something else.
SEMANTIC_FIELDS = (
    "layer_convention",
    "aux_layer_ids",
    "concat_order",
    "num_layers",
    "hidden_size",
    "vocab_size",
    "teacher_norm",
)
TARGET_FIELDS = ("config_sha256", "tokenizer_sha256", "chat_template_sha256")


class ContractMismatch(ValueError):
    pass


# the teacher signals a capture can hold: the post-norm last hidden state, the top-k log-probs
TeacherKind = Literal["last_hidden", "topk"]


def _last_hidden_teacher() -> list[TeacherKind]:
    return ["last_hidden"]


class CaptureContract(Strict):
    layer_convention: str = LAYER_CONVENTION
    aux_layer_ids: list[int]
    hf_hidden_state_indices: list[int]
    sglang_capture_points: list[int]
    concat_order: Literal["ascending_layer"] = "ascending_layer"
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_encoding: Literal["bf16", "fp8"] = "bf16"
    # fp8: channels per scale (one float32 scale per token per block of a layer); None with bf16, and in
    # contracts written before block scales (one scale per token and layer). A shard whose measured fp8
    # error exceeded aux_fp8_max_rel_error is stored bf16 (its own header says so)
    aux_fp8_block: int | None = None
    aux_fp8_max_rel_error: float | None = None
    teacher_kinds: list[TeacherKind] = Field(default_factory=_last_hidden_teacher)
    teacher_topk: int | None = None
    # last_hidden is taken after the final RMSNorm; top-k log-probs are a full-vocabulary log-softmax
    # of the raw logits (temperature 1), at the position that predicts the next token
    teacher_norm: Literal["post_final_norm"] = "post_final_norm"
    target: dict[str, Any]
    engine: dict[str, str]


def build_contract(
    aux_layer_ids: list[int],
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    target_identity: dict[str, Any],
    engine: dict[str, str],
    encoding: str = "bf16",
    teacher_kinds: list[str] | None = None,
    teacher_topk: int | None = None,
    fp8_block: int | None = None,
    fp8_max_rel_error: float | None = None,
) -> CaptureContract:
    if (
        sorted(set(aux_layer_ids)) != list(aux_layer_ids)
        or aux_layer_ids[-1] >= num_layers
        or aux_layer_ids[0] < 0
    ):
        raise ContractMismatch(f"aux layer ids {aux_layer_ids} invalid for a {num_layers}-layer target")
    return CaptureContract(
        aux_layer_ids=list(aux_layer_ids),
        hf_hidden_state_indices=[k + 1 for k in aux_layer_ids],
        sglang_capture_points=[k + 1 for k in aux_layer_ids],
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        aux_encoding=encoding,
        aux_fp8_block=fp8_block if encoding == "fp8" else None,
        aux_fp8_max_rel_error=fp8_max_rel_error if encoding == "fp8" else None,
        teacher_kinds=list(teacher_kinds or ["last_hidden"]),
        teacher_topk=teacher_topk if "topk" in (teacher_kinds or []) else None,
        target=dict(target_identity),
        engine=dict(engine),
    )


def contract_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences in the fields that change what captured features mean."""
    problems = feature_differences(expected, actual)
    for field in TARGET_FIELDS:
        want, got = expected.get("target", {}).get(field), actual.get("target", {}).get(field)
        if want != got:
            problems.append(f"target.{field}: expected {want}, got {got}")
    return problems


def feature_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Differences that make one side's features unreadable by the other's drafter (layers, widths)."""
    return [
        f"{field}: expected {expected.get(field)!r}, got {actual.get(field)!r}"
        for field in SEMANTIC_FIELDS
        if expected.get(field) != actual.get(field)
    ]


def require_same_contract(expected: dict[str, Any], actual: dict[str, Any], what: str) -> None:
    problems = contract_differences(expected, actual)
    if problems:
        raise ContractMismatch(f"capture contract mismatch ({what}):\n  " + "\n  ".join(problems))
