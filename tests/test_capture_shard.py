"""Capture shards: safetensors with packed samples, bf16 or fp8 features, last-hidden and/or top-k
teachers; per-sample ranged reads from either backend."""

import struct

import pytest
import torch

from pipeline.data.capture_shards import (
    CaptureSample,
    ShardFormatError,
    ShardReader,
    dequantize_fp8,
    quantize_fp8,
    store_range_reader,
    write_shard,
)


def make_samples(hidden=8, k=4, last_hidden=True, topk=True):
    torch.manual_seed(0)
    samples = []
    for i, length in enumerate([5, 1, 9]):
        logprobs = torch.log_softmax(torch.randn(length, 50), -1).topk(k, -1)
        samples.append(
            CaptureSample(
                f"id{i}",
                torch.randint(0, 100, (length,)),
                torch.randint(0, 2, (length,)),
                torch.randn(length, 3 * hidden) * 3,
                torch.randn(length, hidden) if last_hidden else None,
                logprobs.indices if topk else None,
                logprobs.values if topk else None,
            )
        )
    return samples


@pytest.mark.parametrize("encoding", ["bf16", "fp8"])
def test_write_then_read_every_sample(tmp_path, encoding):
    samples = make_samples()
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


def test_fp8_keeps_one_scale_per_token_and_layer():
    x = torch.cat([torch.randn(4, 16) * 1000, torch.randn(4, 16) * 0.001, torch.randn(4, 16)], dim=1)
    q, scale = quantize_fp8(x, groups=3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 3)
    back = dequantize_fp8(q, scale)
    for g in range(3):  # a huge layer does not wash out a tiny one
        block = slice(16 * g, 16 * (g + 1))
        assert ((back[:, block] - x[:, block]).abs().amax(-1) / x[:, block].abs().amax(-1)).max() < 0.07


def test_either_teacher_alone_is_stored(tmp_path):
    write_shard(make_samples(last_hidden=False), tmp_path / "a.safetensors", "fp8")
    only_topk = ShardReader.from_file(tmp_path / "a.safetensors")
    assert only_topk.teachers == ["topk"] and only_topk.sample(0).last_hidden is None
    write_shard(make_samples(topk=False), tmp_path / "b.safetensors", "bf16")
    assert ShardReader.from_file(tmp_path / "b.safetensors").teachers == ["last_hidden"]
    with pytest.raises(ShardFormatError, match="no teacher"):
        write_shard(make_samples(last_hidden=False, topk=False), tmp_path / "c.safetensors")


def test_one_sample_reads_only_its_own_bytes(store, tmp_path):
    hidden, k = 64, 4
    write_shard(make_samples(hidden=hidden, k=k), tmp_path / "s.safetensors", "fp8")
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
        write_shard(make_samples(), tmp_path / "x.safetensors", "int4")
