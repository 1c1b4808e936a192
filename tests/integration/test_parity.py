"""Parity: the capture engine against an independent hook-based reference; SGLang server settings."""

import shutil

import torch

from pipeline.engines import TeacherRequest
from pipeline.engines.hf import HFEngine
from pipeline.engines.parity import check_parity, reference_capture

SEQUENCES = [[3, 10, 11, 12, 4, 20, 21], [3, 30, 31, 4, 7]]
BOTH = TeacherRequest(("last_hidden", "topk"), 5)


class OffByOne(HFEngine):
    """Reads hidden_states[k] for layer k: the classic layer-id mistake."""

    def capture(self, sequences, aux_layer_ids, teacher=BOTH):
        return super().capture(sequences, [k - 1 for k in aux_layer_ids], teacher)


class PreNorm(HFEngine):
    """Returns the last layer's output before the final norm as the teacher state."""

    def capture(self, sequences, aux_layer_ids, teacher=BOTH):
        captures = super().capture(sequences, aux_layer_ids, teacher)
        for sequence, capture in zip(sequences, captures, strict=True):
            out = self.model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
            capture.last_hidden = out.hidden_states[self.num_layers - 1][0] * 3.0
        return captures


def test_the_hf_engine_matches_the_reference(tiny_target_dir):
    engine = HFEngine(tiny_target_dir)
    report = check_parity(engine, engine.model, SEQUENCES, [1, 2, 3], BOTH, 1e-4)
    assert report.passed and report.problems == []
    assert max(report.aux_rel_error) < 1e-5 and report.top1_agreement == 1.0


def test_layer_off_by_one_and_pre_norm_teacher_are_caught(tiny_target_dir):
    engine = OffByOne(tiny_target_dir)
    report = check_parity(engine, engine.model, SEQUENCES, [2, 3, 4], BOTH, 1e-3)
    assert not report.passed
    assert any(p.startswith("aux layer 2:") for p in report.problems)
    engine = PreNorm(tiny_target_dir)
    report = check_parity(engine, engine.model, SEQUENCES, [1, 2, 3], BOTH, 1e-3)
    assert report.problems == [p for p in report.problems if "last hidden" in p] and report.problems


def tiny_deepseek_v3(tmp_path, tiny_target_dir):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        max_position_embeddings=256,
    )
    directory = tmp_path / "deepseek-v3-tiny"
    DeepseekV3ForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_target_dir / name).exists():
            shutil.copy(tiny_target_dir / name, directory / name)
    return directory


def test_a_deepseek_v3_architecture_target_is_captured_by_the_contract(tmp_path, tiny_target_dir):
    engine = HFEngine(tiny_deepseek_v3(tmp_path, tiny_target_dir))
    captured = engine.capture(SEQUENCES, [1, 3, 4], BOTH)
    reference = reference_capture(engine.model, SEQUENCES[0], [1, 3, 4], BOTH)
    torch.testing.assert_close(captured[0].aux, reference.aux, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(captured[0].last_hidden, reference.last_hidden, rtol=1e-4, atol=1e-5)
    assert check_parity(engine, engine.model, SEQUENCES, [1, 3, 4], BOTH, 1e-4).passed
