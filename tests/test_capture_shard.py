"""Capture shards: safetensors with packed samples; per-sample ranged reads from either backend."""

import struct

import pytest
import torch

from pipeline.capture_shard import CaptureSample, ShardFormatError, ShardReader, store_range_reader, write_shard


def make_samples(hidden=8):
    torch.manual_seed(0)
    samples = []
    for i, length in enumerate([5, 1, 9]):
        samples.append(CaptureSample(f"id{i}", torch.randint(0, 100, (length,)), torch.randint(0, 2, (length,)),
                                     torch.randn(length, 3 * hidden), torch.randn(length, hidden)))
    return samples


def test_write_then_read_every_sample(tmp_path):
    samples = make_samples()
    stats = write_shard(samples, tmp_path / "s.safetensors")
    assert stats == {"samples": 3, "tokens": 15, "assistant_tokens": int(sum(s.loss_mask.sum() for s in samples))}
    reader = ShardReader.from_file(tmp_path / "s.safetensors")
    assert reader.sample_ids == ["id0", "id1", "id2"]
    for index, original in enumerate(samples):
        got = reader.sample(index)
        assert torch.equal(got.input_ids, original.input_ids)
        assert torch.equal(got.loss_mask, original.loss_mask.to(torch.uint8))
        torch.testing.assert_close(got.aux, original.aux.to(torch.bfloat16))
        torch.testing.assert_close(got.last_hidden, original.last_hidden.to(torch.bfloat16))
    reader.close()


def test_one_sample_reads_only_its_own_bytes(store, tmp_path):
    samples = make_samples(hidden=64)
    write_shard(samples, tmp_path / "s.safetensors")
    store.put_file("caps/s.safetensors", tmp_path / "s.safetensors")
    fetched = []

    def counting_range(start, end):
        fetched.append(end - start)
        return store_range_reader(store, "caps/s.safetensors")(start, end)

    reader = ShardReader(counting_range)
    header_bytes = sum(fetched)
    fetched.clear()
    sample = reader.sample(1)  # one token: 1 * (4 + 1 + 192*2 + 64*2) bytes of rows
    assert sample.sample_id == "id1"
    assert sum(fetched) == 4 + 1 + 3 * 64 * 2 + 64 * 2
    assert header_bytes < (tmp_path / "s.safetensors").stat().st_size / 4


def test_files_that_are_not_capture_shards_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ShardFormatError, match="not a capture shard"):
        ShardReader.from_file(tmp_path / "other.safetensors")
    (tmp_path / "junk").write_bytes(struct.pack("<Q", 10 ** 12) + b"{}")
    with pytest.raises(ShardFormatError):
        ShardReader.from_file(tmp_path / "junk")
    with pytest.raises(ShardFormatError, match="empty"):
        write_shard([], tmp_path / "empty.safetensors")
