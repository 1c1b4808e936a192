"""Parity check: a capture engine's states against an independent reference forward.

The reference does not use `output_hidden_states`: forward hooks read the output of decoder layer k
and of the final norm directly, so an engine that is off by one layer, or returns the last hidden
state before the norm, disagrees with it by far more than numerical noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeline.data.spilled_rows import Rows, loaded
from pipeline.engines import Capture, CaptureEngine, TeacherRequest
from pipeline.engines.layer_ids import hf_hidden_states_indices

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ParityFailed(RuntimeError):
    pass


def decoder_layers_and_norm(model: nn.Module, num_layers: int) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layer list of a causal LM and the final norm beside it (Llama, DeepSeek, ...)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers and name.endswith("layers"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            norm = getattr(parent, "norm", None)
            if norm is not None:
                return module, norm
    raise ParityFailed("could not find the decoder layers and final norm of the reference model")


@torch.no_grad()
def reference_capture(
    model: PreTrainedModel, sequence: list[int], aux_layer_ids: list[int], teacher: TeacherRequest
) -> Capture:
    num_layers = model.config.get_text_config().num_hidden_layers
    # a forward hook on layer k sees its output: the project's layer id k, the layers capture engines can
    # be asked for (refused otherwise, as HF capture refuses them)
    hf_hidden_states_indices(aux_layer_ids, num_layers)
    layers, norm = decoder_layers_and_norm(model, num_layers)
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(_module, _inputs, output):
            seen[name] = (output[0] if isinstance(output, tuple) else output)[0].float()

        return hook

    handles = [layers[k].register_forward_hook(keep(f"layer{k}")) for k in aux_layer_ids]
    handles.append(norm.register_forward_hook(keep("norm")))
    try:
        logits = model(input_ids=torch.tensor([sequence]), use_cache=False).logits[0].float()
    finally:
        for handle in handles:
            handle.remove()
    capture = Capture(torch.cat([seen[f"layer{k}"] for k in aux_layer_ids], dim=-1))
    if "last_hidden" in teacher.kinds:
        capture.last_hidden = seen["norm"]
    if "topk" in teacher.kinds:
        capture.topk_logprobs, capture.topk_ids = torch.log_softmax(logits, -1).topk(teacher.topk, -1)
    return capture


@dataclass
class ParityReport:
    samples: int
    aux_rel_error: list[float]  # per aux layer: max |engine - reference| / max |reference|
    last_hidden_rel_error: float | None
    top1_agreement: float | None
    passed: bool
    problems: list[str]

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.detach().float(), reference.detach().float()
    return float((value - reference).abs().max() / reference.abs().max().clamp(min=1e-12))


def _asked_for(value: Rows | None, name: str) -> torch.Tensor:
    """A teacher tensor the request asked for (in memory); a capture that leaves it out fails parity."""
    if value is None:
        raise ParityFailed(f"the capture has no {name}, though the teacher request asked for it")
    return loaded(value)


def check_parity(
    engine: CaptureEngine,
    reference_model: PreTrainedModel,
    sequences: list[list[int]],
    aux_layer_ids: list[int],
    teacher: TeacherRequest,
    tolerance: float,
) -> ParityReport:
    captured = [c.materialized() for c in engine.capture(sequences, aux_layer_ids, teacher)]
    aux_errors = [0.0] * len(aux_layer_ids)
    last_error, agree, total = (0.0 if "last_hidden" in teacher.kinds else None), 0, 0
    for sequence, got in zip(sequences, captured, strict=True):
        want = reference_capture(reference_model, sequence, aux_layer_ids, teacher)
        want_aux, got_aux = _asked_for(want.aux, "aux"), _asked_for(got.aux, "aux")
        width = want_aux.shape[-1] // len(aux_layer_ids)
        for i in range(len(aux_layer_ids)):
            block = slice(i * width, (i + 1) * width)
            aux_errors[i] = max(aux_errors[i], _relative_error(got_aux[:, block], want_aux[:, block]))
        if last_error is not None:
            got_last = _asked_for(got.last_hidden, "last_hidden")
            want_last = _asked_for(want.last_hidden, "last_hidden")
            last_error = max(last_error, _relative_error(got_last, want_last))
        if "topk" in teacher.kinds:
            got_top = _asked_for(got.topk_ids, "topk_ids")
            want_top = _asked_for(want.topk_ids, "topk_ids")
            agree += int((got_top[:, 0] == want_top[:, 0]).sum())
            total += len(sequence)
    problems = [
        f"aux layer {k}: relative error {e:.3g} > {tolerance}"
        for k, e in zip(aux_layer_ids, aux_errors, strict=True)
        if e > tolerance
    ]
    if last_error is not None and last_error > tolerance:
        problems.append(f"last hidden state: relative error {last_error:.3g} > {tolerance} (pre/post norm?)")
    agreement = agree / total if total else None
    if agreement is not None and agreement < 0.99:
        problems.append(f"teacher top-1 agrees with the reference on only {agreement:.3f} of positions")
    return ParityReport(len(sequences), aux_errors, last_error, agreement, not problems, problems)
