"""Capture: the HF engine follows the layer convention of the capture contract; bad samples are refused."""

import torch

from pipeline.engines import Capture
from pipeline.engines.hf import HFEngine
from pipeline.stages.capture import sample_problem


def test_hf_engine_captures_layer_outputs_and_the_post_norm_teacher(tiny_target_dir, tiny_model):
    engine = HFEngine(tiny_target_dir)
    sequences = [[3, 10, 11, 12, 4, 20, 21], [3, 30, 4]]
    captures = engine.capture(sequences, [1, 2, 3])
    for seq, cap in zip(sequences, captures):
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


def test_sample_validation_names_the_problem():
    good = Capture(torch.randn(4, 6), torch.randn(4, 2))
    assert sample_problem(good, 4, 2) is None
    assert sample_problem(good, 5, 2) == "wrong_shape"
    nan = Capture(good.aux.clone(), good.last_hidden.clone())
    nan.aux[2, 1] = float("nan")
    assert sample_problem(nan, 4, 2) == "non_finite_aux"
    assert sample_problem(Capture(torch.zeros(4, 6), good.last_hidden), 4, 2) == "all_zero_aux"
