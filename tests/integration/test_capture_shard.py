"""Capture shards: safetensors with packed samples, bf16 or fp8 features, last-hidden and/or top-k
teachers; per-sample ranged reads from either backend."""

import re

import pytest

from pipeline.data.capture_shards import (
    ShardReader,
    store_range_reader,
)
from pipeline.data.shard_writer import write_shard
from tests.builders import capture_samples


def test_one_sample_reads_only_its_own_bytes(store, tmp_path):
    hidden, k = 64, 4
    write_shard(capture_samples(hidden=hidden, k=k), tmp_path / "s.safetensors", "fp8")
    store.put_file("caps/s.safetensors", tmp_path / "s.safetensors")
    fetched = []

    def counting_range(start, end):
        fetched.append(end - start)
        return store_range_reader(store, "caps/s.safetensors")(start, end)

    reader = ShardReader(counting_range)
    fetched.clear()
    sample = reader.sample(1)  # one token's rows: ids, mask, aux + scales, last + scale, top-k ids + logprobs
    assert sample.sample_id == "id1"
    assert sum(fetched) == 4 + 1 + (3 * hidden + 3 * 4) + (hidden + 4) + k * 4 + k * 2


def test_capture_records_outliers_and_stores_bf16_what_fp8_would_damage(tmp_path, tiny_target_dir, caplog):
    """The capture stage: per aux layer channel amax statistics in the manifest; a shard over the bound
    is stored bf16, listed as such, with a warning naming it and its measured error."""
    import logging

    from pipeline.config import load_config
    from pipeline.manifest import read_manifest
    from pipeline.stages import run_stage
    from pipeline.storage import open_store
    from tests.conftest import storage_config, tiny_config_dict

    # below e4m3's own rounding error: every shard must fall back
    overrides = ["prompts.num_samples=16", "capture.parity.samples=0", "capture.fp8_max_rel_error=0.001"]
    config = load_config(data=tiny_config_dict(storage_config("file", tmp_path, None)), overrides=overrides)
    store = open_store(config.storage)
    for name in ("prompts", "generate"):
        run_stage(name, config, "snap", store)
    with caplog.at_level(logging.WARNING, logger="pipeline.stages.capture"):
        output = run_stage("capture", config, "snap", store)
    manifest = read_manifest(store, store.key_for(output.uri))
    names = [s["name"] for s in manifest["shards"]]
    assert names and manifest["encoding"]["fell_back_to_bf16"] == names
    assert {s["encoding"] for s in manifest["shards"]} == {"bf16"}
    for shard in manifest["encoding"]["shards"]:
        assert shard["requested"] == "fp8" and shard["stored"] == "bf16" and shard["fp8_block"] == 128
        assert 0.01 < max(shard["fp8_rel_error"]["aux"]) < 0.05  # e4m3 rounding, over the 0.001 bound
        warning = next(r.getMessage() for r in caplog.records if shard["name"] in r.getMessage())
        measured = float(re.search(r"round-trip error ([0-9.]+)", warning).group(1))
        assert "stored bf16" in warning and "fp8_max_rel_error 0.001" in warning
        assert measured == pytest.approx(max(shard["fp8_rel_error"]["aux"]), abs=1e-4)
    reader = ShardReader(store_range_reader(store, f"{store.key_for(output.uri)}/{names[0]}"))
    assert reader.encoding == "bf16"
    contract = manifest["contract"]
    assert contract["aux_encoding"] == "fp8" and contract["aux_fp8_block"] == 128
    layers = manifest["outliers"]["layers"]
    assert [layer["aux_layer_id"] for layer in layers] == contract["aux_layer_ids"]
    assert manifest["outliers"]["shards_measured"] == len(names)
    for layer in layers:
        top = layer["top_channels"]
        assert layer["amax_over_median"] == top[0]["over_median"] >= top[-1]["over_median"] >= 1.0
        assert all(0 <= t["channel"] < 64 for t in top) and layer["median_channel_amax"] > 0
