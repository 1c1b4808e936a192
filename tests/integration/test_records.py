"""Stage records are written and read through their models: a round trip keeps every field, a missing or
renamed field is refused where the record is read, and the report escapes whatever a record holds."""

import json

import pytest

from pipeline.manifest import ManifestError, publish
from pipeline.ops.report import RunRecord, render_html
from pipeline.records import (
    BenchRecord,
    BenchSummary,
    EvalRecord,
    GateRecord,
    PromoteRecord,
    RecordError,
    StageRecord,
    publish_record,
    read_record,
    write_record,
)
from tests.builders import bench_record, eval_record, gate_record

PREFIX = "runs/r1"


def promote_record() -> PromoteRecord:
    return PromoteRecord(promoted=False, reason="registry.promote is false")


@pytest.mark.parametrize("make", [eval_record, gate_record, bench_record, promote_record])
def test_a_record_round_trips_through_the_store(store, make):
    record: StageRecord = make()
    prefix = f"{PREFIX}/{record.KIND}"
    manifest = publish_record(store, prefix, record, {"run_id": "r1"})
    assert manifest["kind"] == record.KIND
    assert [o["name"] for o in manifest["objects"]] == [record.FILE_NAME]
    assert read_record(store, store.uri(prefix), type(record)) == record
    assert read_record(store, prefix, type(record)) == record  # a key works as well as a URI
    # the file is plain JSON with the record's field names
    assert set(json.loads(store.get_bytes(f"{prefix}/{record.FILE_NAME}"))) == set(type(record).model_fields)


def test_bench_and_eval_summaries_come_from_the_records():
    bench = bench_record()
    assert bench.summary().model_dump() == bench.model_dump(include=set(BenchSummary.model_fields))
    assert bench.summary().speedups["baseline"].ci_low == 1.5
    assert eval_record().summary().tau_simulated == 2.3


def _publish_raw(store, record: StageRecord, data: dict) -> str:
    """Store a record file as someone else wrote it, bypassing the model (an older or a broken writer)."""
    prefix = f"{PREFIX}/{record.KIND}"
    info = store.put_bytes(f"{prefix}/{record.FILE_NAME}", json.dumps(data).encode())
    publish(store, prefix, record.KIND, [info], {"run_id": "r1"})
    return prefix


def test_a_missing_field_is_refused_where_the_record_is_read(store):
    data = gate_record().model_dump(mode="json")
    del data["passed"]
    prefix = _publish_raw(store, gate_record(), data)
    with pytest.raises(RecordError, match=r"GateRecord at \S+/runs/r1/gate/gate.json") as refused:
        read_record(store, prefix, GateRecord)
    assert isinstance(refused.value, ValueError)
    assert "passed\n  Field required" in str(refused.value)


def test_a_renamed_field_is_refused_naming_both_names(store):
    data = eval_record().model_dump(mode="json")
    data["tau_sim"] = data.pop("tau_simulated")
    prefix = _publish_raw(store, eval_record(), data)
    with pytest.raises(ValueError, match="EvalRecord at") as refused:
        read_record(store, prefix, EvalRecord)
    message = str(refused.value)
    assert (
        "tau_simulated\n  Field required" in message
        and "tau_sim\n  Extra inputs are not permitted" in message
    )


def test_a_nested_field_of_the_wrong_type_is_refused(store):
    data = bench_record().model_dump(mode="json")
    data["methods"]["candidate"]["tok_s"] = "fast"
    prefix = _publish_raw(store, bench_record(), data)
    with pytest.raises(RecordError, match=r"methods\.candidate\.tok_s"):
        read_record(store, prefix, BenchRecord)


def test_a_record_of_another_kind_is_refused(store):
    write_record(store, f"{PREFIX}/gate", gate_record())
    publish(store, f"{PREFIX}/gate", "bench", [], {})
    with pytest.raises(ManifestError, match="expected 'gate'"):
        read_record(store, f"{PREFIX}/gate", GateRecord)


def test_the_report_escapes_html_from_a_record():
    attack = "<script>alert('x')</script>"
    gate = gate_record([f"cond_acc_0 fine {attack}"])
    gate.checks[0].check = f"cond_acc_0{attack}"
    bench = bench_record()
    bench.decision.reasons = [attack]
    run = RunRecord(
        "r1<b>",
        config={"target": {"name": attack}},
        eval=eval_record(),
        gate=gate,
        bench=bench,
        stages=["eval", "gate", "bench"],
    )
    page = render_html(run, {}, (["--speculative-draft-model-path", "<drafter-dir>"], f"source {attack}"))
    assert "<script" not in page and "<b>" not in page
    # the check, the bench reason, the target (summary and config) and the flags' source
    assert page.count("&lt;script&gt;") == 5
    assert "<td>cond_acc_0&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;</td>" in page
    assert "Run r1&lt;b&gt;" in page and "&lt;drafter-dir&gt;" in page
    assert "<tr><th>tau predicted (bench)</th><td>2.3</td></tr>" in page
    assert "<tr><th>promoted version</th><td>&ndash;</td></tr>" in page
    assert "Not available: no training history." in page and "FAIL" not in page


def test_the_worker_spec_round_trips_and_a_broken_one_is_refused(tmp_path):
    from pipeline.config import RunConfig
    from pipeline.data.capture_contract import build_contract
    from pipeline.records import WorkerSpec
    from pipeline.training.worker import read_worker_spec
    from tests.conftest import storage_config, tiny_config_dict

    spec = WorkerSpec(
        config=RunConfig(**tiny_config_dict(storage_config("file", tmp_path, None))),
        run_id="r1",
        workdir=str(tmp_path / "work"),
        train_shards=[
            {
                "key": "captures/t/s/train-00000.safetensors",
                "name": "train-00000.safetensors",
                "split": "train",
                "sha256": "0" * 64,
                "bytes": 1,
                "samples": 1,
                "tokens": 8,
                "assistant_tokens": 4,
                "teacher": ["topk"],
                "encoding": "fp8",
            }
        ],
        shard_cache=str(tmp_path / "cache"),
        target_dir=str(tmp_path / "target"),
        contract=build_contract([0, 1, 2], 4, 16, 64, {"name": "t"}, {"name": "hf"}),
        draft_vocab=[0, 3, 5],
    )
    path = tmp_path / WorkerSpec.FILE_NAME
    path.write_bytes(spec.to_json())
    assert read_worker_spec(str(path)) == spec
    assert read_worker_spec(f"file://{path}") == spec
    data = json.loads(path.read_text())
    data["draft_vocabulary"] = data.pop("draft_vocab")
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=f"WorkerSpec at {path}") as refused:
        read_worker_spec(str(path))
    assert "draft_vocab\n  Field required" in str(refused.value)
