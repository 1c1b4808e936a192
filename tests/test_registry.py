"""Registry on both backends: promote, aliases, rollback, verified pull, refusals."""

import json

import pytest

from pipeline import layout
from pipeline.export import export_drafter
from pipeline.registry import RegistryError, list_versions, promote, pull, read_alias, rollback, verify_dir
from tests.test_ttt import small_drafter

CONTRACT = {"aux_layer_ids": [1, 2, 3], "hidden_size": 16}
SERVING = {"steps": 3, "topk": 1, "draft_tokens": 4}


def drafter_dir(tmp_path, seed):
    return export_drafter(small_drafter(seed), CONTRACT, tmp_path / f"drafter-{seed}", "float32")


def test_promote_then_pull_and_verify(store, tmp_path):
    promoted = promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1", "eval": {"tau_simulated": 2.0}},
                       "production", SERVING)
    assert read_alias(store, "tgt", "production")["version"] == promoted["version"]
    dest = pull(store, "tgt", "production", tmp_path / "served")
    manifest = verify_dir(dest)
    assert manifest["version"] == promoted["version"]
    assert {p.name for p in dest.iterdir()} == {"config.json", "model.safetensors", "capture_contract.json",
                                                "README.md", "manifest.json"}
    card = (dest / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3" in card and "--speculative-num-steps 3" in card
    assert [v["version"] for v in list_versions(store, "tgt")] == [promoted["version"]]


def test_second_promotion_moves_previous_and_rollback_restores(store, tmp_path):
    first = promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)["version"]
    second = promote(store, "tgt", drafter_dir(tmp_path, 2), {"run_id": "r2"}, "production", SERVING)["version"]
    assert first != second
    assert read_alias(store, "tgt", "previous")["version"] == first
    rollback(store, "tgt")
    assert read_alias(store, "tgt", "production")["version"] == first
    assert read_alias(store, "tgt", "previous")["version"] == second
    history = [json.loads(store.get_bytes(k)) for k in store.list(layout.alias_history_prefix("tgt"))]
    assert [h["reason"] for h in history if h["alias"] == "production"][-1] == "rollback"


def test_pull_of_a_corrupted_version_is_refused_and_keeps_the_old_copy(store, tmp_path):
    good = promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)["version"]
    dest = pull(store, "tgt", "production", tmp_path / "served")
    before = (dest / "model.safetensors").read_bytes()
    bad = promote(store, "tgt", drafter_dir(tmp_path, 2), {"run_id": "r2"}, "production", SERVING)["version"]
    key = f"{layout.drafter_version_prefix('tgt', bad)}/model.safetensors"
    store.put_bytes(key, store.get_bytes(key)[:-8] + b"\x00" * 8)
    with pytest.raises(RegistryError, match="checksum mismatch"):
        pull(store, "tgt", "production", dest)
    assert (dest / "model.safetensors").read_bytes() == before
    assert verify_dir(dest)["version"] == good
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".served")) == []


def test_pull_of_a_missing_alias_is_a_clear_error(store, tmp_path):
    with pytest.raises(RegistryError, match="no alias or version named 'production'"):
        pull(store, "tgt", "production", tmp_path / "served")
    assert not (tmp_path / "served").exists()


def test_verify_detects_a_tampered_directory(store, tmp_path):
    promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)
    dest = pull(store, "tgt", "production", tmp_path / "served")
    (dest / "config.json").write_text((dest / "config.json").read_text().replace('"num_hidden_layers": 1', '"num_hidden_layers": 2'))
    with pytest.raises(RegistryError, match="checksum mismatch for config.json"):
        verify_dir(dest)
