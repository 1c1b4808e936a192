"""The prompts stage: normalization, dedup, length filter, bad-record accounting, split, shards."""

import json

import pytest

from pipeline.config import load_config
from pipeline.manifest import read_listed, read_manifest
from pipeline.records import decode_jsonl
from pipeline.stages import prompts
from pipeline.stages.prompts import split_of
from tests.conftest import tiny_config_dict


def write_source(path):
    good = [{"conversations": [{"from": "human", "value": f"def f{i}(x):"}, {"from": "gpt", "value": "pass"}]}
            for i in range(30)]
    openai = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"def g{i}():"}]}
              for i in range(10)]
    duplicates = good[:5]
    bad = [{"conversations": [{"from": "gpt", "value": "answer first"}]},
           {"messages": [{"role": "user", "content": ""}]},
           {"messages": [{"role": "user"}]},
           {"conversations": [{"from": "human", "value": "x " * 400}]}]
    path.write_text("\n".join(json.dumps(r) for r in good + openai + duplicates + bad) + "\n")


def test_prompts_from_a_jsonl_source(store, storage, tmp_path):
    source = tmp_path / "source.jsonl"
    write_source(source)
    data = tiny_config_dict(storage)
    data["prompts"] = {"sources": [{"kind": "jsonl", "path": str(source)}], "num_samples": 1000,
                       "eval_fraction": 0.3, "shard_size": 8, "max_prompt_tokens": 100}
    config = load_config(data=data)
    result = prompts.run(config, "snap1", store)
    counts = result.manifest["counts"]
    assert counts["read"] == 49 and counts["kept"] == 40
    assert counts["rejected.duplicate"] == 5
    assert counts["rejected.no_user_turn_first"] == 1 and counts["rejected.empty_turn"] == 1
    assert counts["rejected.content_not_text"] == 1 and counts["rejected.too_long"] == 1
    assert sum(v for k, v in counts.items() if k != "read") == counts["read"]  # nothing vanishes
    records = []
    for shard in result.manifest["shards"]:
        batch = decode_jsonl(read_listed(store, "prompts/snap1", result.manifest, shard["name"]))
        assert len(batch) == shard["samples"] <= 8
        assert all(r["split"] == shard["split"] == split_of(r["id"], 0.3) for r in batch)
        records += batch
    assert len({r["id"] for r in records}) == 40
    assert {r["split"] for r in records} == {"train", "eval"}
    assert records[0]["messages"][0]["role"] in ("user", "system")
    again = prompts.run(config, "snap1", store)  # idempotent: the published snapshot is reused
    assert again.manifest["created_at"] == result.manifest["created_at"]


def test_missing_source_fails_with_its_path(store, storage, tmp_path):
    data = tiny_config_dict(storage)
    data["prompts"] = {"sources": [{"kind": "jsonl", "path": str(tmp_path / "nope.jsonl")}]}
    with pytest.raises(prompts.PromptSourceError, match="nope.jsonl"):
        prompts.run(load_config(data=data), "snap2", store)
    with pytest.raises(Exception):
        read_manifest(store, "prompts/snap2")


def test_demo_corpus_comes_only_from_modules_the_target_never_saw():
    from pipeline.tiny_target import corpus_turns, demo_conversations, is_heldout

    demo = demo_conversations()
    assert len(demo) > 300
    modules = {r["source"].split(":")[1].split(".")[0] for r in demo}
    assert all(is_heldout(m) for m in modules)
    assert not modules & {t.module for t in corpus_turns(heldout=False, max_modules=40)}
