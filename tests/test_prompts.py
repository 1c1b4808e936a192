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


def conversation(i, prefix="def f"):
    return {"messages": [{"role": "user", "content": f"{prefix}{i}(alpha, beta, gamma): compute something {i}"}]}


def test_sources_in_every_format_from_disk_and_s3_mixed_by_weight(s3_endpoint, tmp_path):
    import boto3
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import BUCKET, storage_config

    storage = storage_config("file", tmp_path, None)
    storage["endpoint_url"] = s3_endpoint
    rows = [conversation(i, "def parquet_") for i in range(60)]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "a.parquet")
    with pa.OSFile(str(tmp_path / "b.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(pa.Table.from_pylist([conversation(i, "def arrow_") for i in range(60)]))
    body = "\n".join(json.dumps(conversation(i, "def s3_")) for i in range(60)).encode()
    uniq = tmp_path.name[-12:].replace("_", "-")
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=BUCKET, Key=f"{uniq}/src/part-0.jsonl", Body=body)
    data = tiny_config_dict(storage)
    data["prompts"] = {"num_samples": 50, "eval_fraction": 0.1, "shard_size": 100, "max_prompt_tokens": 200,
                       "sources": [{"kind": "parquet", "path": str(tmp_path / "a.parquet"), "weight": 3},
                                   {"kind": "arrow", "path": str(tmp_path / "b.arrow"), "weight": 1},
                                   {"kind": "jsonl", "path": f"s3://{BUCKET}/{uniq}/src/", "weight": 1}]}
    config = load_config(data=data)
    from pipeline.config import StorageConfig
    from pipeline.storage import open_store

    result = prompts.run(config, "mixed", open_store(StorageConfig(**storage)))
    assert result.manifest["counts"]["kept"] == 50
    per_source = result.manifest["kept_per_source"]
    assert per_source[str(tmp_path / "a.parquet")] == 30
    assert per_source[str(tmp_path / "b.arrow")] == 10
    assert per_source[f"s3://{BUCKET}/{uniq}/src/"] == 10


def test_near_duplicates_are_dropped_and_counted(store, storage, tmp_path):
    base = ("please write a python function that reads a csv file from disk, removes empty rows, "
            "converts every numeric column to floats and returns the cleaned table as a list of dicts")
    rows = [{"messages": [{"role": "user", "content": base}]},
            {"messages": [{"role": "user", "content": base.replace("csv file", "CSV file") + " please"}]},
            {"messages": [{"role": "user", "content": "Please, " + base + "!"}]},
            {"messages": [{"role": "user", "content": "explain how a bloom filter trades memory for false "
                                                      "positives, with an example in python"}]}]
    source = tmp_path / "near.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows))
    data = tiny_config_dict(storage)
    data["prompts"] = {"sources": [{"kind": "jsonl", "path": str(source)}], "max_prompt_tokens": 400}
    counts = prompts.run(load_config(data=data), "near", store).manifest["counts"]
    assert counts["kept"] == 2 and counts["rejected.near_duplicate"] == 2
    data["prompts"]["near_dedup"] = False
    assert prompts.run(load_config(data=data), "near-off", store).manifest["counts"]["kept"] == 4
