"""The Kimi-style tiny target (architecture deepseek_v3): shipped with its own code like Kimi-K2.5, loaded
only with target.trust_remote_code, captured by the contract, identified by its code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.engines.tiny_target import KIMI_ROPE_PARAMETERS
from pipeline.stages import run_stage
from tests.conftest import KIMI_TEST_RECIPE, TEST_CACHE, published

SEQUENCES = [[1013, 10, 11, 12, 1010, 20, 21], [1013, 30, 31, 1010, 7]]  # 1013 <|im_system|>, 1010 <|im_end|>
AUX_LAYERS = [1, 3, 4]


@pytest.fixture(scope="session")
def kimi_tokenizer(kimi_target_dir):
    from pipeline.engines.target import load_tokenizer

    return load_tokenizer(kimi_target_dir, trust_remote_code=True)


@pytest.fixture(scope="session")
def kimi_engine(kimi_target_dir):
    from pipeline.engines.hf import HFEngine

    return HFEngine(kimi_target_dir, trust_remote_code=True)


def kimi_run_config(model_dir: Path):
    from pipeline.config import load_config

    return load_config(
        data={
            "storage": {"root": str(model_dir.parent / "store"), "local_cache": str(TEST_CACHE)},
            "target": {
                "name": "kimi-tiny",
                "source": "hf",
                "model_path": str(model_dir),
                "trust_remote_code": True,
            },
        }
    )


def test_it_ships_its_code_and_loads_only_with_trust_remote_code(kimi_target_dir):
    from transformers import AutoConfig

    from pipeline.engines.target import TargetError, load_model, load_tokenizer

    config = json.loads((kimi_target_dir / "config.json").read_text())
    assert config["model_type"] == "tiny_kimi"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_tiny_kimi.TinyKimiConfig",
        "AutoModelForCausalLM": "modeling_tiny_kimi.TinyKimiForCausalLM",
    }
    tokenizer_config = json.loads((kimi_target_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["auto_map"] == {
        "AutoTokenizer": ["tokenization_tiny_kimi.TikTokenTokenizer", None]
    }
    for name in (
        "configuration_tiny_kimi.py",
        "modeling_tiny_kimi.py",
        "tokenization_tiny_kimi.py",
        "tiktoken.model",
    ):
        assert (kimi_target_dir / name).is_file(), name
    assert not (kimi_target_dir / "tokenizer.json").exists()
    for load in (load_tokenizer, load_model):
        with pytest.raises(TargetError, match=r"target\.trust_remote_code: true"):
            load(kimi_target_dir)
    with pytest.raises(ValueError, match="trust_remote_code"):  # transformers itself refuses, too
        AutoConfig.from_pretrained(str(kimi_target_dir))


def test_a_tiny_deepseek_v3_target_needs_the_setting_in_the_config():
    from pipeline.config import ConfigError, load_config

    target = {"name": "t", "source": "tiny", "tiny": {"architecture": "deepseek_v3"}}
    with pytest.raises(ConfigError, match="set target.trust_remote_code: true"):
        load_config(data={"storage": {"root": "/tmp/x"}, "target": target})
    config = load_config(
        data={"storage": {"root": "/tmp/x"}, "target": {**target, "trust_remote_code": True}}
    )
    assert config.target.tiny.deepseek_v3.n_routed_experts == 4
    with pytest.raises(ConfigError, match="deepseek_v3 is set but"):
        load_config(
            data={
                "storage": {"root": "/tmp/x"},
                "target": {"name": "t", "tiny": {"deepseek_v3": {"q_lora_rank": 8}}},
            }
        )


def test_llama_recipes_keep_the_names_of_their_cached_builds():
    from pipeline.config import TinyTargetRecipe
    from pipeline.engines.tiny_target import recipe_hash
    from tests.conftest import TEST_RECIPE

    # the hashes the builder gave before the architecture option existed
    assert recipe_hash(TinyTargetRecipe(**TEST_RECIPE), "corpus") == "8496dedb4e138835"
    assert recipe_hash(TinyTargetRecipe(), "corpus") == "6b38f1ea7db81edc"
    kimi = TinyTargetRecipe(**KIMI_TEST_RECIPE)
    assert recipe_hash(kimi, "corpus") != recipe_hash(kimi.model_copy(update={"train_steps": 41}), "corpus")


def test_the_tokenizer_is_tiktoken_and_round_trips_text_and_the_chat_template(kimi_tokenizer):
    import tiktoken

    tokenizer = kimi_tokenizer
    assert type(tokenizer).__name__ == "TikTokenTokenizer" and not tokenizer.is_fast
    assert type(tokenizer).__module__.endswith("tokenization_tiny_kimi")
    assert isinstance(tokenizer.model, tiktoken.Encoding)
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 1024
    texts = [
        "def f(x):\n    return x + 1\n",
        "naïve — 日本語 ✓",
        "  trailing spaces  \n\n",
        "<|im_end|> as text",
    ]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    messages = [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "return a + b"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.endswith(
        "<|im_user|>user<|im_middle|>def add(a, b):<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>return a + b<|im_end|>"
    )
    assert rendered.startswith("<|im_system|>system<|im_middle|>You are Kimi")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == rendered
    assert ids.count(tokenizer.eos_token_id) == 3  # every turn ends with one <|im_end|> token
    assert (
        tokenizer.decode(ids, skip_special_tokens=True) == "systemYou are Kimi, an AI assistant created by "
        "Moonshot AI.userdef add(a, b):assistantreturn a + b"
    )


def test_tiktoken_encodes_the_corpus_like_the_bpe_its_ranks_came_from(kimi_target_dir, kimi_tokenizer):
    from pipeline.engines.tiny_kimi.tokenization_tiny_kimi import SPECIAL_TOKEN_SLOTS, read_ranks
    from pipeline.engines.tiny_target import corpus_turns, tiktoken_ranks, train_byte_bpe

    build = json.loads((kimi_target_dir / "build.json").read_text())
    assert build["tiktoken_vs_bpe"]["different"] == 0 and build["tiktoken_vs_bpe"]["texts"] > 1000
    turns = corpus_turns(heldout=False, max_modules=KIMI_TEST_RECIPE["max_corpus_modules"])
    bpe = train_byte_bpe(turns, KIMI_TEST_RECIPE["vocab_size"] - SPECIAL_TOKEN_SLOTS, [])
    assert tiktoken_ranks(bpe) == read_ranks(kimi_target_dir / "tiktoken.model")  # the same BPE, retrained
    # both spell a token's bytes with GPT-2's byte-level characters, so a token maps by its spelling
    bpe_id_to_token_id = {i: kimi_tokenizer.get_vocab()[token] for token, i in bpe.get_vocab().items()}
    texts = [
        text for turn in turns[::7] for text in (turn.prompt, turn.response)
    ]  # the build compared them all
    for text, encoding in zip(texts, bpe.encode_batch(texts, add_special_tokens=False), strict=True):
        assert kimi_tokenizer(text, add_special_tokens=False)["input_ids"] == [
            bpe_id_to_token_id[i] for i in encoding.ids
        ], text[:80]


def test_the_loss_mask_covers_assistant_turns_without_character_offsets(kimi_tokenizer):
    from pipeline.data.conversations import tokenize_with_loss_mask

    messages = [
        {"role": "user", "content": "def f(x):"},
        {"role": "assistant", "content": "return x + 1"},
        {"role": "user", "content": "and ünïcode?"},
        {"role": "assistant", "content": "return 'é'"},
    ]
    ids, mask = tokenize_with_loss_mask(kimi_tokenizer, messages)
    assert ids == kimi_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert (
        kimi_tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        == "return x + 1<|im_end|>return 'é'<|im_end|>"
    )


def test_the_model_is_deepseek_v3_with_kimis_long_context(kimi_target_dir, kimi_engine):
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    model, config = kimi_engine.model, kimi_engine.model.config
    assert isinstance(model, DeepseekV3ForCausalLM) and type(model).__name__ == "TinyKimiForCausalLM"
    assert config.q_lora_rank == 32 and config.kv_lora_rank == 16  # MLA
    assert config.n_routed_experts == 4 and config.n_shared_experts == 1 and config.num_experts_per_tok == 2
    moe_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, DeepseekV3MoE)]
    assert moe_layers == [1, 2, 3, 4, 5]  # first_k_dense_replace 1
    assert config.max_position_embeddings == 262144
    rope = json.loads((kimi_target_dir / "config.json").read_text())["rope_parameters"]
    assert rope == KIMI_ROPE_PARAMETERS and rope["rope_type"] == "yarn"
    # 4K pre-training positions stretched by YaRN to the full context
    assert rope["original_max_position_embeddings"] * rope["factor"] == config.max_position_embeddings
    build = json.loads((kimi_target_dir / "build.json").read_text())
    assert build["heldout_perplexity"] < 200  # it learned the corpus at short sequence lengths


def test_the_hf_engine_captures_what_an_independent_reference_sees(kimi_engine):
    from pipeline.engines import TeacherRequest
    from pipeline.engines.parity import check_parity, reference_capture

    both = TeacherRequest(("last_hidden", "topk"), 5)
    captured = kimi_engine.capture(SEQUENCES, AUX_LAYERS, both)
    for sequence, capture in zip(SEQUENCES, captured, strict=True):
        reference = reference_capture(kimi_engine.model, sequence, AUX_LAYERS, both)
        torch.testing.assert_close(capture.aux, reference.aux, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(capture.last_hidden, reference.last_hidden, rtol=1e-4, atol=1e-5)
        assert capture.aux.shape == (len(sequence), 3 * 64)
    assert check_parity(kimi_engine, kimi_engine.model, SEQUENCES, AUX_LAYERS, both, 1e-4).passed


def test_the_sglang_stand_in_needs_the_flag_too(kimi_target_dir):
    from harness.sglang_standin import StandinBackend
    from pipeline.engines.target import TargetError

    with pytest.raises(TargetError, match="trust_remote_code"):
        StandinBackend(kimi_target_dir, None)
    backend = StandinBackend(kimi_target_dir, AUX_LAYERS, trust_remote_code=True)
    greedy = {"max_new_tokens": 4, "temperature": 0.0}
    plain = backend.generate_one({"sampling_params": greedy}, SEQUENCES[0])  # batched transformers generate
    with_states = backend.generate_one(
        {"sampling_params": greedy, "return_hidden_states": True}, SEQUENCES[0]
    )
    assert plain["output_ids"] == with_states["output_ids"] and 1 <= len(plain["output_ids"]) <= 4
    assert len(with_states["meta_info"]["hidden_states"][0]) == len(SEQUENCES[0])


def test_describe_target_and_its_identity_follow_the_shipped_code(kimi_target_dir, tmp_path):
    from pipeline.engines.target import describe_target

    model_dir = tmp_path / "Kimi-tiny"
    shutil.copytree(kimi_target_dir, model_dir)
    config = kimi_run_config(model_dir)
    info = describe_target(config)
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (6, 64, 1024)

    def identity_after(name: str, change) -> dict:
        path = model_dir / name
        original = path.read_bytes()
        path.write_bytes(change(original))
        try:
            return describe_target(config).identity
        finally:
            path.write_bytes(original)

    def comment(code: bytes) -> bytes:
        return code + b"\n# changed\n"

    tokenizer_code = identity_after("tokenization_tiny_kimi.py", comment)
    assert tokenizer_code["tokenizer_sha256"] != info.identity["tokenizer_sha256"]
    assert tokenizer_code["config_sha256"] == info.identity["config_sha256"]
    model_code = identity_after("modeling_tiny_kimi.py", comment)
    assert model_code["config_sha256"] != info.identity["config_sha256"]
    assert model_code["tokenizer_sha256"] == info.identity["tokenizer_sha256"]
    assert describe_target(config).identity == info.identity


def test_prompts_generate_and_capture_run_on_it(kimi_target_dir, tmp_path):
    """The stages that load the target, end to end, as the rehearsal runs them with the served target."""
    from pipeline.config import load_config
    from pipeline.engines.target import describe_target
    from pipeline.storage import open_store
    from tests.conftest import storage_config, tiny_config_dict

    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["target"] = {
        "name": "kimi-tiny",
        "source": "hf",
        "model_path": str(kimi_target_dir),
        "trust_remote_code": True,
    }
    data["prompts"].update({"num_samples": 8, "shard_size": 8, "eval_fraction": 0.0})
    data["generate"]["max_new_tokens"] = 8
    data["capture"].update({"aux_layer_ids": AUX_LAYERS, "parity": {"samples": 2}})
    config = load_config(data=data)
    store = open_store(config.storage)
    responses = run_stage(
        "generate", config, "kimi", store, prompts_uri=run_stage("prompts", config, "kimi", store).uri
    )
    captured = published(store, run_stage("capture", config, "kimi", store, responses_uri=responses.uri))
    assert captured["counts"]["captured"] == 8
    assert captured["contract"]["target"] == describe_target(config).identity
