"""Capture: the HF engine follows the layer convention of the capture contract; bad samples are refused."""

import torch

from pipeline.engines import TeacherRequest
from pipeline.engines.hf import HFEngine


def test_hf_engine_captures_layer_outputs_and_the_post_norm_teacher(tiny_target_dir, tiny_model):
    engine = HFEngine(tiny_target_dir)
    sequences = [[3, 10, 11, 12, 4, 20, 21], [3, 30, 4]]
    captures = engine.capture(sequences, [1, 2, 3], TeacherRequest(("last_hidden",), 4))
    for seq, cap in zip(sequences, captures, strict=True):
        ids = torch.tensor([seq])
        with torch.no_grad():
            # an independent reference: run the decoder layers by hand
            inner = tiny_model.model
            hidden = inner.embed_tokens(ids)
            positions = torch.arange(len(seq))[None]
            rope = inner.rotary_emb(hidden, position_ids=positions)
            mask = torch.full((len(seq), len(seq)), float("-inf")).triu(1)[None, None]
            outputs = []
            for layer in inner.layers:
                hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=positions)
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
                outputs.append(hidden)
            expected_aux = torch.cat([outputs[1], outputs[2], outputs[3]], dim=-1)[0]
            expected_last = inner.norm(outputs[-1])[0]
            logits = tiny_model(input_ids=ids).logits[0]
        torch.testing.assert_close(cap.aux, expected_aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cap.last_hidden, expected_last, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(tiny_model.lm_head(cap.last_hidden), logits, rtol=1e-4, atol=1e-4)


def test_hf_engine_topk_teacher_is_the_full_vocabulary_log_softmax(tiny_target_dir, tiny_model):
    engine = HFEngine(tiny_target_dir)
    sequence = [3, 10, 11, 12, 4, 20, 21]
    capture = engine.capture([sequence], [1, 2, 3], TeacherRequest(("topk",), 5))[0]
    assert capture.last_hidden is None and capture.topk_ids.shape == (7, 5)
    with torch.no_grad():
        expected = torch.log_softmax(tiny_model(input_ids=torch.tensor([sequence])).logits[0], -1).topk(5, -1)
    assert torch.equal(capture.topk_ids, expected.indices)
    torch.testing.assert_close(capture.topk_logprobs, expected.values, rtol=1e-4, atol=1e-4)


def test_a_shard_is_stored_as_parts_each_uploaded_while_capture_goes_on(tmp_path, monkeypatch):
    """capture.part_max_mib cuts a response shard's capture into parts; a part's upload runs (in its own
    thread) while later samples are still being captured, and the parts hold exactly the samples one
    part would."""
    import threading
    import time

    from pipeline import layout
    from pipeline.config import load_config
    from pipeline.data.capture_shards import ShardReader, store_range_reader
    from pipeline.manifest import read_manifest
    from pipeline.stages import run_stage
    from pipeline.storage import open_store
    from tests.builders import response_ids
    from tests.conftest import storage_config, tiny_config_dict

    base = ["prompts.num_samples=16", "prompts.eval_fraction=0", "prompts.shard_size=16"]
    base += ["capture.parity.samples=0", "capture.batch_size=2"]
    config = load_config(data=tiny_config_dict(storage_config("file", tmp_path, None)), overrides=base)
    store = open_store(config.storage)
    for name in ("prompts", "generate"):
        run_stage(name, config, "snap", store)
    events: list[tuple[str, float, str]] = []
    real_capture, real_put = HFEngine.capture, type(store).put_file

    def capture(self, *args, **kwargs):
        events.append(("capture", time.monotonic(), threading.current_thread().name))
        return real_capture(self, *args, **kwargs)

    def put_file(self, key, path):
        if key.endswith(".safetensors"):
            events.append(("upload", time.monotonic(), threading.current_thread().name))
        return real_put(self, key, path)

    monkeypatch.setattr(HFEngine, "capture", capture)
    monkeypatch.setattr(type(store), "put_file", put_file)
    storage = storage_config("file", tmp_path, None)
    parts_config = load_config(data=tiny_config_dict(storage), overrides=[*base, "capture.part_max_mib=0.05"])
    manifest = read_manifest(store, store.key_for(run_stage("capture", parts_config, "snap", store).uri))
    names = [s["name"] for s in manifest["shards"]]
    assert len(names) >= 3 and names[1].endswith("-part001.safetensors")
    uploads = [(t, thread) for kind, t, thread in events if kind == "upload"]
    last_capture = max(t for kind, t, _ in events if kind == "capture")
    assert uploads[0][0] < last_capture and all(thread.startswith("capture-upload") for _, thread in uploads)

    prefix = layout.captures_prefix(config.target.name, "snap")
    stored = []
    for name in names:
        stored += ShardReader(store_range_reader(store, f"{prefix}/{name}")).sample_ids
    responses = response_ids(store, manifest["responses"])
    refused = sum(n for reason, n in manifest["counts"].items() if reason.startswith("quarantined."))
    assert len(stored) == len(set(stored)) == manifest["totals"]["samples"] == len(responses) - refused > 0
    assert set(stored) <= set(responses)
