"""The prompts stage: normalization, dedup, length filter, bad-record accounting, split, shards."""

import json
import uuid

import pytest

from pipeline.config import load_config
from pipeline.data.jsonl import decode_jsonl
from pipeline.manifest import ManifestError, read_listed, read_manifest
from pipeline.stages import prompts, run_stage
from pipeline.stages.prompts import split_of
from tests.conftest import published, tiny_config_dict


def write_source(path):
    good = [
        {"conversations": [{"from": "human", "value": f"def f{i}(x):"}, {"from": "gpt", "value": "pass"}]}
        for i in range(30)
    ]
    openai = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"def g{i}():"}]}
        for i in range(10)
    ]
    duplicates = good[:5]
    bad = [
        {"conversations": [{"from": "gpt", "value": "answer first"}]},
        {"messages": [{"role": "user", "content": ""}]},
        {"messages": [{"role": "user"}]},
        {"conversations": [{"from": "human", "value": "x " * 400}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in good + openai + duplicates + bad) + "\n")


def test_prompts_from_a_jsonl_source(store, storage, tmp_path):
    source = tmp_path / "source.jsonl"
    write_source(source)
    data = tiny_config_dict(storage)
    data["prompts"] = {
        "sources": [{"kind": "jsonl", "path": str(source)}],
        "num_samples": 1000,
        "eval_fraction": 0.3,
        "shard_size": 8,
        "max_prompt_tokens": 100,
    }
    config = load_config(data=data)
    result = published(store, run_stage("prompts", config, "snap1", store))
    counts = result["counts"]
    assert counts["read"] == 49 and counts["kept"] == 40
    assert counts["rejected.duplicate"] == 5
    assert counts["rejected.no_user_turn_first"] == 1 and counts["rejected.empty_turn"] == 1
    assert counts["rejected.content_not_text"] == 1 and counts["rejected.too_long"] == 1
    assert sum(v for k, v in counts.items() if k != "read") == counts["read"]  # nothing vanishes
    records = []
    for shard in result["shards"]:
        batch = decode_jsonl(read_listed(store, "prompts/snap1", result, shard["name"]))
        assert len(batch) == shard["samples"] <= 8
        assert all(
            r["split"] == shard["split"] and r["domain"] == shard["domain"] == "general" for r in batch
        )
        records += batch
    assert len({r["id"] for r in records}) == 40
    # the id's hash splits, but for the domain's first conversation: held out while none of it was
    forced = [r for r in records if r["split"] != split_of(r["id"], 0.3)]
    assert len(forced) <= 1 and all(r["split"] == "eval" for r in forced)
    assert {r["split"] for r in records} == {"train", "eval"}
    assert records[0]["messages"][0]["role"] in ("user", "system")
    again = published(store, run_stage("prompts", config, "snap1", store))  # the published snapshot is reused
    assert again["created_at"] == result["created_at"]


def _conversation(text: str, **fields) -> dict:
    return {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "pass"}], **fields}


def test_domains_are_tagged_split_and_sharded_per_domain(store, storage, tmp_path, tiny_tokenizer):
    chat = tmp_path / "chat.jsonl"
    records = [_conversation(f"def chat{i}(x):") for i in range(30)]
    records.append(_conversation("def solve(n): return", domain="math"))  # a record's own domain
    records.append(_conversation("def bad():", domain="../escape"))  # not an id: a bad record
    chat.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    code = tmp_path / "humaneval.jsonl"
    code.write_text("\n".join(json.dumps(_conversation(f"def task{i}(s):")) for i in range(6)) + "\n")
    data = tiny_config_dict(storage)
    data["prompts"] = {
        "sources": [
            {"kind": "jsonl", "path": str(chat), "domain": "chat"},
            {"kind": "jsonl", "path": str(code), "domain": "code", "split": "eval"},
        ],
        "num_samples": 1000,
        "eval_fraction": 0.1,
        "shard_size": 4,
        "max_prompt_tokens": 100,
    }
    result = published(store, run_stage("prompts", load_config(data=data), "snap-domains", store))
    assert result["counts"]["rejected.bad_domain"] == 1 and result["counts"]["kept"] == 37
    domains = result["domains"]
    assert set(domains) == {"chat", "code", "math"}
    assert domains["code"] == {"train": 0, "eval": 6}  # a standard set: held out whole
    assert domains["math"] == {"train": 0, "eval": 1}  # one conversation: held out, so math is evaluated
    assert domains["chat"]["eval"] >= 1 and sum(domains["chat"].values()) == 30
    for shard in result["shards"]:  # every shard holds one split of one domain
        batch = decode_jsonl(read_listed(store, "prompts/snap-domains", result, shard["name"]))
        assert {(r["split"], r["domain"]) for r in batch} == {(shard["split"], shard["domain"])}
    # the benchmark takes its held-out prompts from every domain in turn
    from pipeline.stages.benchmark import heldout_prompts

    picked = heldout_prompts(store, store.uri("prompts/snap-domains"), tiny_tokenizer, 5)
    texts = [tiny_tokenizer.decode(ids) for ids in picked]
    kinds = [next(kind for kind in ("chat", "task", "solve") if f"def {kind}" in text) for text in texts]
    assert kinds == ["chat", "task", "solve", "chat", "task"]  # chat, code, math, then math is used up


def test_a_source_domain_must_be_an_id(storage):
    from pipeline.config import ConfigError

    data = tiny_config_dict(storage)
    data["prompts"] = {"sources": [{"kind": "demo", "domain": "chat/../x"}]}
    with pytest.raises(ConfigError, match="domain"):
        load_config(data=data)


def test_missing_source_fails_with_its_path(store, storage, tmp_path):
    data = tiny_config_dict(storage)
    data["prompts"] = {"sources": [{"kind": "jsonl", "path": str(tmp_path / "nope.jsonl")}]}
    with pytest.raises(prompts.PromptSourceError, match="nope.jsonl"):
        run_stage("prompts", load_config(data=data), "snap2", store)
    with pytest.raises(ManifestError):
        read_manifest(store, "prompts/snap2")


def test_demo_corpus_comes_only_from_modules_the_target_never_saw():
    from pipeline.engines.tiny_target import corpus_turns, demo_conversations, is_heldout

    demo = demo_conversations()
    assert len(demo) > 300
    modules = {r["source"].split(":")[1].split(".")[0] for r in demo}
    assert all(is_heldout(m) for m in modules)
    assert not modules & {t.module for t in corpus_turns(heldout=False, max_modules=40)}


def conversation(i, prefix="def f"):
    return {
        "messages": [{"role": "user", "content": f"{prefix}{i}(alpha, beta, gamma): compute something {i}"}]
    }


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
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(
        Bucket=BUCKET, Key=f"{uniq}/src/part-0.jsonl", Body=body
    )
    data = tiny_config_dict(storage)
    data["prompts"] = {
        "num_samples": 50,
        "eval_fraction": 0.1,
        "shard_size": 100,
        "max_prompt_tokens": 200,
        "sources": [
            {"kind": "parquet", "path": str(tmp_path / "a.parquet"), "weight": 3},
            {"kind": "arrow", "path": str(tmp_path / "b.arrow"), "weight": 1},
            {"kind": "jsonl", "path": f"s3://{BUCKET}/{uniq}/src/", "weight": 1},
        ],
    }
    config = load_config(data=data)
    from pipeline.storage import StorageConfig, open_store

    store = open_store(StorageConfig(**storage))
    result = published(store, run_stage("prompts", config, "mixed", store))
    assert result["counts"]["kept"] == 50
    per_source = result["kept_per_source"]
    assert per_source[str(tmp_path / "a.parquet")] == 30
    assert per_source[str(tmp_path / "b.arrow")] == 10
    assert per_source[f"s3://{BUCKET}/{uniq}/src/"] == 10


def test_near_duplicates_are_dropped_and_counted(store, storage, tmp_path):
    base = (
        "please write a python function that reads a csv file from disk, removes empty rows, "
        "converts every numeric column to floats and returns the cleaned table as a list of dicts"
    )
    rows = [
        {"messages": [{"role": "user", "content": base}]},
        {"messages": [{"role": "user", "content": base.replace("csv file", "CSV file") + " please"}]},
        {"messages": [{"role": "user", "content": "Please, " + base + "!"}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": "explain how a bloom filter trades memory for false "
                    "positives, with an example in python",
                }
            ]
        },
    ]
    source = tmp_path / "near.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows))
    data = tiny_config_dict(storage)
    data["prompts"] = {"sources": [{"kind": "jsonl", "path": str(source)}], "max_prompt_tokens": 400}
    counts = published(store, run_stage("prompts", load_config(data=data), "near", store))["counts"]
    assert counts["kept"] == 2 and counts["rejected.near_duplicate"] == 2
    data["prompts"]["near_dedup"] = False
    assert (
        published(store, run_stage("prompts", load_config(data=data), "near-off", store))["counts"]["kept"]
        == 4
    )


def put_objects(s3_endpoint, bodies: dict[str, bytes]) -> None:
    """Upload small objects in parallel: one PUT at a time would dominate a test with a thousand of them."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    from tests.conftest import BUCKET

    client = boto3.client("s3", endpoint_url=s3_endpoint, config=Config(max_pool_connections=16))
    with ThreadPoolExecutor(16) as pool:
        list(
            pool.map(lambda item: client.put_object(Bucket=BUCKET, Key=item[0], Body=item[1]), bodies.items())
        )


def s3_source_run(s3_endpoint, tmp_path, tiny_target_dir, source_uri, **settings):
    """The prompts stage over one jsonl source on S3, downloading into this test's own cache."""
    from pipeline.storage import open_store
    from tests.conftest import storage_config

    storage = storage_config("file", tmp_path, None)
    storage.update(endpoint_url=s3_endpoint, local_cache=str(tmp_path / "cache"))
    data = tiny_config_dict(storage)
    data["target"] = {"name": "tiny-test", "source": "hf", "model_path": str(tiny_target_dir)}
    data["prompts"] = {
        "sources": [{"kind": "jsonl", "path": source_uri}],
        "max_prompt_tokens": 200,
        "eval_fraction": 0.1,
        **settings,
    }
    config = load_config(data=data)
    store = open_store(config.storage)
    return published(store, run_stage("prompts", config, "s3-source", store))


def test_an_s3_prefix_is_read_whole_past_one_listing_page(s3_endpoint, tmp_path, tiny_target_dir):
    from tests.conftest import BUCKET

    objects = 1005  # a listing page holds at most 1,000 keys
    prefix = f"many-{uuid.uuid4().hex[:8]}"
    put_objects(
        s3_endpoint,
        {
            f"{prefix}/part-{i:04d}.jsonl": json.dumps(conversation(i, "def many_")).encode()
            for i in range(objects)
        },
    )
    source = f"s3://{BUCKET}/{prefix}/"
    manifest = s3_source_run(
        s3_endpoint,
        tmp_path,
        tiny_target_dir,
        source,
        num_samples=2 * objects,
        shard_size=2 * objects,
        near_dedup=False,
    )
    assert manifest["counts"]["read"] == manifest["counts"]["kept"] == objects
    assert manifest["kept_per_source"] == {source: objects}
    assert len(list((tmp_path / "cache" / "sources").iterdir())) == objects  # no partial download left behind


def test_unparseable_lines_under_the_limit_are_skipped_and_named_by_s3_uri(
    s3_endpoint, tmp_path, tiny_target_dir
):
    from tests.conftest import BUCKET

    good = [json.dumps(conversation(i, "def bad_neighbour_")) for i in range(30)]
    broken = [f'{{"messages": [{{"role": "user", "content": "cut off {i}' for i in range(12)]
    key = f"bad-{uuid.uuid4().hex[:8]}/part-0.jsonl"
    put_objects(s3_endpoint, {key: "\n".join(good[:2] + broken + good[2:]).encode()})
    manifest = s3_source_run(
        s3_endpoint, tmp_path, tiny_target_dir, f"s3://{BUCKET}/{key}", max_bad_fraction=0.5
    )
    counts = manifest["counts"]
    assert counts["kept"] == 30 and counts["rejected.malformed_json"] == 12
    assert sum(v for k, v in counts.items() if k != "read") == counts["read"]
    examples = manifest["rejected_examples"]["malformed_json"]
    broken_lines = [f"s3://{BUCKET}/{key}:{line}" for line in range(3, 3 + len(broken))]
    assert (
        0 < len(examples) < len(broken) and examples == broken_lines[: len(examples)]
    )  # the first few, by URI
