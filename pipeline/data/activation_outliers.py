"""Massive activations in the captured aux states: per layer, each channel's largest magnitude.

DeepSeek-family MoE targets carry a few fixed channels hundreds to thousands of times the median from
early layers on (Sun et al. 2024, "Massive activations in large language models"). Capture records, per
aux layer, how far the largest channel amax sits above the median channel amax, and which channels
those are: the measurement the fp8 block size (capture.fp8_block) is chosen against.
"""

from __future__ import annotations

from typing import Any

import torch

TOP_CHANNELS = 8


def channel_amax(features: list[torch.Tensor], groups: int) -> torch.Tensor:
    """[G, D]: the largest |value| of every channel of every group (layer) over all tokens given.

    features: tensors [T_i, G*D] (one per sample)."""
    if not features:
        raise ValueError("channel_amax needs at least one tensor")
    per_sample = [f.float().abs().amax(0).reshape(groups, -1) for f in features]
    return torch.stack(per_sample).amax(0)


def merge_channel_amax(amaxes: list[torch.Tensor]) -> torch.Tensor:
    """The channel amax of the union of the tokens the given channel amaxes were measured on."""
    return torch.stack(amaxes).amax(0)


def layer_outliers(amax: torch.Tensor, layer_id: int, top: int = TOP_CHANNELS) -> dict[str, Any]:
    """One layer's summary: amax over median by channel, and the channels furthest above the median."""
    median = float(amax.median())
    ratios = amax / max(median, 1e-30)
    order = torch.argsort(amax, descending=True)[:top]
    return {
        "aux_layer_id": layer_id,
        "median_channel_amax": round(median, 6),
        "amax_over_median": round(float(ratios.max()), 3),
        "top_channels": [
            {"channel": int(c), "amax": round(float(amax[c]), 6), "over_median": round(float(ratios[c]), 3)}
            for c in order
        ],
    }


def outlier_summary(
    amax: torch.Tensor, layer_ids: list[int], top: int = TOP_CHANNELS
) -> list[dict[str, Any]]:
    """Per aux layer (amax [G, D], rows in ascending layer order), what layer_outliers says."""
    if amax.shape[0] != len(layer_ids):
        raise ValueError(f"{amax.shape[0]} layers of channel amax for aux layer ids {layer_ids}")
    return [layer_outliers(row, layer_id, top) for row, layer_id in zip(amax, layer_ids, strict=True)]
