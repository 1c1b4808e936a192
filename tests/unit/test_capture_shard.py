"""Capture shards on local disk: safetensors with packed samples, bf16 or fp8 features, last-hidden
and/or top-k teachers. Ranged reads from either store backend: tests/integration/test_capture_shard.py."""

import struct

import pytest
import torch

from pipeline.data.capture_shards import (
    PER_LAYER_SCALE_FORMAT,
    CaptureSample,
    ShardFormatError,
    ShardReader,
    dequantize_fp8,
    fp8_rel_error,
    quantize_fp8,
    write_safetensors,
)
from pipeline.data.shard_writer import PendingSample, ShardWriter, write_checked_shard, write_shard
from pipeline.data.spilled_rows import SpilledRows
from tests.builders import capture_samples


@pytest.mark.parametrize("encoding", ["bf16", "fp8"])
def test_write_then_read_every_sample(tmp_path, encoding):
    samples = capture_samples()
    stats = write_shard(samples, tmp_path / "s.safetensors", encoding)
    assert stats["samples"] == 3 and stats["tokens"] == 15
    assert stats["assistant_tokens"] == int(sum(s.loss_mask.sum() for s in samples))
    assert stats["teacher"] == ["last_hidden", "topk"] and stats["encoding"] == encoding
    reader = ShardReader.from_file(tmp_path / "s.safetensors")
    assert reader.sample_ids == ["id0", "id1", "id2"] and reader.encoding == encoding
    tolerance = 0.01 if encoding == "bf16" else 0.07  # relative to each row's (layer's) largest value
    for index, original in enumerate(samples):
        got = reader.sample(index)
        assert torch.equal(got.input_ids, original.input_ids)
        assert torch.equal(got.loss_mask, original.loss_mask.to(torch.uint8))
        for name, groups in (("aux", 3), ("last_hidden", 1)):
            want, have = getattr(original, name), getattr(got, name)
            scale = want.reshape(want.shape[0], groups, -1).abs().amax(-1, keepdim=True)
            error = (have - want).reshape(want.shape[0], groups, -1).abs() / scale
            assert error.max() <= tolerance, (name, float(error.max()))
        assert torch.equal(got.topk_ids, original.topk_ids)
        torch.testing.assert_close(got.topk_logprobs, original.topk_logprobs, rtol=2e-3, atol=2e-3)
    reader.close()


def test_fp8_keeps_one_scale_per_token_and_block_of_channels():
    x = torch.cat([torch.randn(4, 16) * 1000, torch.randn(4, 16) * 0.001, torch.randn(4, 16)], dim=1)
    q, scale = quantize_fp8(x, groups=3, block=8)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 3 * 2)
    back = dequantize_fp8(q, scale, groups=3, block=8)
    for g in range(3):  # a huge layer does not wash out a tiny one
        block = slice(16 * g, 16 * (g + 1))
        assert ((back[:, block] - x[:, block]).abs().amax(-1) / x[:, block].abs().amax(-1)).max() < 0.07


def with_massive_channel(x: torch.Tensor, groups: int, channel: int, ratio: float) -> torch.Tensor:
    """x with one channel of every group set to `ratio` times the largest |value| of x (every token)."""
    rows = x.shape[0]
    out = x.clone().reshape(rows, groups, -1)
    out[:, :, channel] = ratio * x.abs().max()
    return out.reshape(rows, -1)


def test_block_scales_keep_a_massive_channel_from_crushing_the_other_blocks():
    torch.manual_seed(0)
    x = with_massive_channel(torch.randn(64, 3 * 256), groups=3, channel=5, ratio=1e6)
    per_layer = dequantize_fp8(*quantize_fp8(x, 3, block=256), groups=3, block=256)
    blocked = dequantize_fp8(*quantize_fp8(x, 3, block=128), groups=3, block=128)
    layers = x.reshape(64, 3, 256)
    second_block = (slice(None), slice(None), slice(128, 256))  # the block without the massive channel
    lost = (per_layer.reshape(64, 3, 256) - layers)[second_block].norm() / layers[second_block].norm()
    kept = (blocked.reshape(64, 3, 256) - layers)[second_block].norm() / layers[second_block].norm()
    assert lost > 0.9  # one scale per token and layer: the other channels are flushed to zero
    assert kept < 0.04  # their own scale: e4m3 rounding only
    # the measure capture decides on sees it too, though the massive channel itself is stored exactly:
    # every other channel lost (per layer), or the other 127 channels of its block, half the layer
    assert min(fp8_rel_error(x, per_layer, 3)) > 0.95
    assert 0.65 < min(fp8_rel_error(x, blocked, 3)) <= max(fp8_rel_error(x, blocked, 3)) < 0.75


@pytest.mark.parametrize("hidden, block, blocks", [(100, 32, 4), (100, 128, 1), (96, 32, 3), (7, 1, 7)])
def test_a_block_that_does_not_divide_the_layer_ends_with_a_shorter_block(hidden, block, blocks):
    torch.manual_seed(1)
    x = torch.randn(6, 3 * hidden) * torch.logspace(-2, 2, 3 * hidden)  # channels of very different sizes
    q, scale = quantize_fp8(x, groups=3, block=block)
    assert q.shape == x.shape and scale.shape == (6, 3 * blocks)
    back = dequantize_fp8(q, scale, groups=3, block=block)
    assert max(fp8_rel_error(x, back, 3)) < 0.05
    with pytest.raises(ShardFormatError, match="do not fit"):
        dequantize_fp8(q, scale[:, 1:], groups=3, block=block)


def test_shards_of_the_per_layer_scale_format_are_still_read(tmp_path):
    """Shards written before block scales (format /2: fp8 with one scale per token and layer)."""
    samples = capture_samples(hidden=16, last_hidden=True)
    aux = torch.cat([s.aux for s in samples])
    last = torch.cat([s.last_hidden for s in samples])
    aux_q, aux_scale = quantize_fp8(aux, 3, block=16)
    last_q, last_scale = quantize_fp8(last, 1, block=16)
    lengths = [s.length for s in samples]
    tensors = {
        "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in samples]),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples]),
        "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        "aux": aux_q,
        "aux_scale": aux_scale,
        "last_hidden": last_q,
        "last_hidden_scale": last_scale,
    }
    assert aux_scale.shape == (15, 3) and last_scale.shape == (15, 1)  # the old layout
    metadata = {"format": PER_LAYER_SCALE_FORMAT, "encoding": "fp8", "teacher": "last_hidden"}
    write_safetensors(tmp_path / "old.safetensors", tensors, {**metadata, "sample_ids": '["a", "b", "c"]'})
    reader = ShardReader.from_file(tmp_path / "old.safetensors")
    assert reader.fp8_block is None
    got = reader.sample(2)
    torch.testing.assert_close(got.aux, dequantize_fp8(aux_q, aux_scale, 3, 16)[6:])
    torch.testing.assert_close(got.last_hidden, dequantize_fp8(last_q, last_scale, 1, 16)[6:])
    assert max(fp8_rel_error(samples[2].aux, got.aux, 3)) < 0.05


def test_the_block_size_is_in_the_shard_header(tmp_path):
    write_shard(capture_samples(hidden=64), tmp_path / "s.safetensors", "fp8", fp8_block=16)
    reader = ShardReader.from_file(tmp_path / "s.safetensors")
    assert reader.fp8_block == 16 and reader.entries["aux_scale"]["shape"] == [15, 3 * 4]
    assert reader.entries["last_hidden_scale"]["shape"] == [15, 4]


def massive_samples(ratio: float) -> list[CaptureSample]:
    samples = capture_samples(hidden=32)
    for sample in samples:
        sample.aux = with_massive_channel(sample.aux, groups=3, channel=3, ratio=ratio)
    return samples


def test_a_shard_whose_fp8_error_exceeds_the_bound_is_stored_bf16(tmp_path):
    clean, report = write_checked_shard(
        capture_samples(hidden=32), tmp_path / "c.safetensors", "fp8", 32, 0.05
    )
    assert clean["encoding"] == report.stored == "fp8" and not report.fell_back
    assert 0.01 < report.worst < 0.05  # e4m3 rounding alone
    # one massive channel (1e6 x) breaks one scale per token and layer (the 32-channel block here)
    stats, report = write_checked_shard(massive_samples(1e6), tmp_path / "m.safetensors", "fp8", 32, 0.05)
    assert stats["encoding"] == report.stored == "bf16" and report.fell_back and report.requested == "fp8"
    assert report.worst > 0.5 and len(report.fp8_rel_error["aux"]) == 3
    assert report.as_dict()["fp8_rel_error"]["last_hidden"][0] < 0.05  # measured on what it would write
    reader = ShardReader.from_file(tmp_path / "m.safetensors")
    assert reader.encoding == "bf16" and reader.fp8_block is None
    original = massive_samples(1e6)[0].aux
    torch.testing.assert_close(reader.sample(0).aux, original.to(torch.bfloat16).float())
    # with no bound the shard stays fp8, whatever its error
    _, unbounded = write_checked_shard(massive_samples(1e6), tmp_path / "u.safetensors", "fp8", 32, None)
    assert unbounded.stored == "fp8" and ShardReader.from_file(tmp_path / "u.safetensors").fp8_block == 32


def test_either_teacher_alone_is_stored(tmp_path):
    write_shard(capture_samples(last_hidden=False), tmp_path / "a.safetensors", "fp8")
    only_topk = ShardReader.from_file(tmp_path / "a.safetensors")
    assert only_topk.teachers == ["topk"] and only_topk.sample(0).last_hidden is None
    write_shard(capture_samples(topk=False), tmp_path / "b.safetensors", "bf16")
    assert ShardReader.from_file(tmp_path / "b.safetensors").teachers == ["last_hidden"]
    with pytest.raises(ShardFormatError, match="no teacher"):
        write_shard(capture_samples(last_hidden=False, topk=False), tmp_path / "c.safetensors")


def test_files_that_are_not_capture_shards_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ShardFormatError, match="not a capture shard"):
        ShardReader.from_file(tmp_path / "other.safetensors")
    (tmp_path / "junk").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(ShardFormatError):
        ShardReader.from_file(tmp_path / "junk")
    with pytest.raises(ShardFormatError, match="empty"):
        write_shard([], tmp_path / "empty.safetensors")
    with pytest.raises(ShardFormatError, match="unsupported"):
        write_shard(capture_samples(), tmp_path / "x.safetensors", "int4")


@pytest.mark.parametrize(
    "override", ["capture.fp8_block=0", "capture.fp8_max_rel_error=0", "capture.fp8_blok=64"]
)
def test_bad_fp8_settings_are_refused_by_name(override):
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[1]):
        load_config("configs/local.yaml", [override])


def test_shards_captured_before_the_measurements_are_counted_as_unmeasured():
    from pipeline.stages.capture import feature_measurements

    amax = [[1.0, 2.0, 800.0, 1.0, 3.0], [1.0] * 5, [2.0] * 5]
    encoding = {"requested": "fp8", "stored": "fp8", "fp8_block": 128, "fell_back": False}
    outliers = [{"amax_over_median": 400.0}, {"amax_over_median": 1.0}, {"amax_over_median": 1.0}]
    measured = {"shard": {"name": "a"}, "aux_channel_amax": amax, "encoding": encoding, "outliers": outliers}
    older = {"shard": {"name": "b"}}
    fields = feature_measurements([measured, older], [1, 3, 4])
    assert fields["outliers"]["shards_measured"] == 1 and fields["outliers"]["shards_unmeasured"] == 1
    first = fields["outliers"]["layers"][0]
    assert first["aux_layer_id"] == 1 and first["top_channels"][0]["channel"] == 2
    assert first["amax_over_median"] == 400.0 and first["median_channel_amax"] == 2.0
    assert [s["name"] for s in fields["encoding"]["shards"]] == ["a"]
    assert fields["encoding"]["fell_back_to_bf16"] == []


@pytest.mark.parametrize("encoding,bound", [("fp8", 0.05), ("fp8", None), ("bf16", None)])
def test_a_shard_written_a_few_rows_at_a_time_has_the_same_bytes(tmp_path, encoding, bound):
    samples = capture_samples(hidden=32)
    whole, whole_report = write_checked_shard(samples, tmp_path / "whole.safetensors", encoding, 16, bound)
    spilled = []
    for index, sample in enumerate(samples):  # aux from local files, read back 2 rows at a time
        path = tmp_path / f"aux{index}.f32"
        sample.aux.float().numpy().tofile(path)
        spilled.append(PendingSample(**{**sample.__dict__, "aux": SpilledRows(path, *sample.aux.shape)}))
    with ShardWriter(encoding, 16, bound, chunk_bytes=2 * 4 * 96) as writer:
        for sample in spilled:
            writer.add(sample)
        chunked, chunked_report = writer.finish(tmp_path / "chunked.safetensors")
    assert (tmp_path / "whole.safetensors").read_bytes() == (tmp_path / "chunked.safetensors").read_bytes()
    assert chunked == whole and chunked_report.stored == whole_report.stored
    for name, errors in whole_report.fp8_rel_error.items():
        assert chunked_report.fp8_rel_error[name] == pytest.approx(errors, rel=1e-5)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("shard-spool-")] == []


def test_the_fall_back_to_bf16_is_decided_on_the_whole_shard_not_a_chunk(tmp_path):
    samples = massive_samples(1e6)
    with ShardWriter("fp8", 32, 0.05, chunk_bytes=4 * 96) as writer:  # one row per chunk
        for sample in samples:
            writer.add(sample)
        stats, report = writer.finish(tmp_path / "m.safetensors")
    assert stats["encoding"] == "bf16" and report.fell_back
    assert ShardReader.from_file(tmp_path / "m.safetensors").encoding == "bf16"


def test_samples_with_different_teachers_are_refused_in_one_shard(tmp_path):
    with ShardWriter("bf16") as writer:
        writer.add(capture_samples()[0])
        with pytest.raises(ShardFormatError, match="teachers"):
            writer.add(capture_samples(last_hidden=False)[1])
