"""The tiny target is built once per recipe + corpus, from held-in modules, with its quality recorded."""

import json

from pipeline.config import TinyTargetRecipe
from pipeline.engines.tiny_target import corpus_hash, corpus_turns, ensure_tiny_target, recipe_hash
from tests.conftest import TEST_CACHE, TEST_RECIPE


def test_build_is_cached_under_a_hash_of_recipe_and_corpus(tiny_target_dir):
    recipe = TinyTargetRecipe(**TEST_RECIPE)
    turns = corpus_turns(heldout=False, max_modules=recipe.max_corpus_modules)
    sha = corpus_hash(turns)
    assert tiny_target_dir.name == f"tiny-{recipe_hash(recipe, sha)}"
    stamp = (tiny_target_dir / "build.json").stat().st_mtime_ns
    assert ensure_tiny_target(recipe, TEST_CACHE) == tiny_target_dir
    assert (tiny_target_dir / "build.json").stat().st_mtime_ns == stamp  # not rebuilt
    changed = TinyTargetRecipe(**{**TEST_RECIPE, "train_steps": TEST_RECIPE["train_steps"] + 1})
    assert recipe_hash(changed, sha) != recipe_hash(recipe, sha)
    assert recipe_hash(recipe, "other-corpus") != recipe_hash(recipe, sha)


def test_build_records_its_quality_and_is_a_llama_with_a_chat_template(tiny_target_dir, tiny_tokenizer):
    build = json.loads((tiny_target_dir / "build.json").read_text())
    assert build["heldout_perplexity"] > 1 and 0 < build["greedy_distinct_2"] <= 1
    config = json.loads((tiny_target_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 7
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "def f():"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>def f():<|end|>\n<|assistant|>"
