"""The in-process capture engine (pipeline.engines.inprocess) over the local runner and the tiny target: the
same contract checks as the HTTP path (parity with an independent forward, the layer ids the contract
states, sample checks), one process or a job of two ranks in which rank 0 alone stores shards."""

import pytest
import torch

from pipeline.config import load_config
from pipeline.data.capture_shards import ShardReader, store_range_reader
from pipeline.engines import EngineError, TeacherRequest
from pipeline.manifest import read_manifest
from pipeline.stages import run_stage
from pipeline.storage import open_store
from tests.conftest import storage_config, tiny_config_dict

BASE = ["prompts.num_samples=12", "prompts.eval_fraction=0", "prompts.shard_size=6", "capture.batch_size=4"]
INPROCESS = ["capture.engine=inprocess", "capture.inprocess.runner=local", "capture.inprocess.tp_size=1"]


def stage_config(tmp_path, overrides):
    return load_config(
        data=tiny_config_dict(storage_config("file", tmp_path, None)), overrides=BASE + overrides
    )


@pytest.fixture(scope="module")
def responses(tmp_path_factory):
    """A store holding this snapshot's prompts and the tiny target's responses."""
    root = tmp_path_factory.mktemp("inprocess")
    config = stage_config(root, [])
    store = open_store(config.storage)
    run_stage("prompts", config, "snap", store)
    return root, store, run_stage("generate", config, "snap", store).uri


def capture(root, store, responses_uri, overrides, snapshot):
    """The capture stage over the fixture's responses, into a capture snapshot of its own."""
    config = stage_config(root, overrides)
    return run_stage("capture", config, "snap", store, responses_uri=responses_uri, snapshot=snapshot)


def captured(store, output):
    manifest = read_manifest(store, store.key_for(output.uri))
    prefix = store.key_for(output.uri)
    samples = {}
    for shard in manifest["shards"]:
        reader = ShardReader(store_range_reader(store, f"{prefix}/{shard['name']}"))
        for index in range(len(reader)):
            sample = reader.sample(index)
            samples[sample.sample_id] = sample
    return manifest, samples


def test_in_process_capture_passes_the_contract_checks_and_matches_the_hf_engine(responses):
    hf = capture(*responses, [], "hf")
    output = capture(*responses, INPROCESS, "inprocess")
    store = responses[1]
    manifest, samples = captured(store, output)
    assert manifest["contract"]["engine"]["name"] == "inprocess"
    assert manifest["parity"]["passed"] and manifest["parity"]["samples"] > 0
    _, reference = captured(store, hf)
    assert samples.keys() == reference.keys() and len(samples) > 0
    for sample_id, sample in samples.items():
        assert torch.equal(sample.aux, reference[sample_id].aux)
        assert torch.equal(sample.topk_ids, reference[sample_id].topk_ids)


def test_a_runner_capturing_other_layers_than_the_contract_fails_parity(responses, monkeypatch):
    from pipeline.engines import inprocess
    from pipeline.engines.parity import ParityFailed

    shifted = inprocess.sglang_layer_ids
    monkeypatch.setattr(
        inprocess, "sglang_layer_ids", lambda ids, family, n: [k + 1 for k in shifted(ids, family, n)]
    )
    with pytest.raises(ParityFailed, match="aux layer"):
        capture(*responses, INPROCESS, "shifted")


def test_the_engine_refuses_layers_it_was_not_started_for(tiny_target_dir):
    from pipeline.engines.inprocess import InProcessEngine, LocalPrefillRunner

    runner = LocalPrefillRunner(tiny_target_dir, [2, 4, 5], "llama", trust_remote_code=False)
    engine = InProcessEngine(runner, [1, 3, 4])
    assert engine.version.startswith("local:transformers-") and engine.stores_shards
    [capture] = engine.capture([[3, 10, 11, 4]], [1, 3, 4], TeacherRequest(("topk",), 3))
    assert capture.aux.shape == (4, 3 * 64)
    with pytest.raises(EngineError, match="started for aux layers"):
        engine.capture([[3, 10]], [1, 2, 3], TeacherRequest(("topk",), 3))


def test_a_job_of_two_ranks_stores_each_shard_once_as_one_process_does(responses):
    store = responses[1]
    single = capture(*responses, INPROCESS, "one-rank")
    output = capture(*responses, [*INPROCESS[:2], "capture.inprocess.tp_size=2"], "two-ranks")
    manifest, samples = captured(store, output)
    one_manifest, one_samples = captured(store, single)
    assert manifest["totals"] == one_manifest["totals"] and manifest["counts"] == one_manifest["counts"]
    assert [s["name"] for s in manifest["shards"]] == [s["name"] for s in one_manifest["shards"]]
    for sample_id, sample in samples.items():
        assert torch.equal(sample.aux, one_samples[sample_id].aux)


def test_the_sglang_runner_fails_loudly_where_sglang_is_missing_and_bounds_its_prefills(tiny_target_dir):
    from pipeline.config import InProcessCaptureConfig
    from pipeline.engines.sglang_runner import SGLangPrefillRunner, _token_bounded

    with pytest.raises(EngineError, match="needs SGLang 0.5.23"):
        SGLangPrefillRunner(tiny_target_dir, [2, 4, 5], InProcessCaptureConfig(), 0, 1, False)
    sequences = [[1] * 5, [2] * 4, [3] * 9, [4] * 2, [5] * 1]
    assert _token_bounded(sequences, 9) == [[[1] * 5, [2] * 4], [[3] * 9], [[4] * 2, [5] * 1]]
    assert _token_bounded([[1] * 12], 9) == [[[1] * 12]]  # a sequence longer than the bound goes alone


def test_the_sglang_runner_splits_packed_states_by_sequence():
    from pipeline.engines.sglang_runner import SGLangPrefillRunner

    aux, last = torch.arange(5 * 6.0).view(5, 6), torch.arange(5 * 2.0).view(5, 2)
    topk = (torch.arange(5 * 3).view(5, 3), -torch.arange(5 * 3.0).view(5, 3))
    first, second = SGLangPrefillRunner._split([[7, 8], [9, 10, 11]], aux, last, topk)
    assert torch.equal(first.aux, aux[:2]) and torch.equal(second.aux, aux[2:])
    assert torch.equal(second.last_hidden, last[2:]) and torch.equal(second.topk_ids, topk[0][2:])


def test_a_rank_that_fails_fails_the_job_with_its_exit_code(tmp_path):
    from pipeline.engines.inprocess import launch_rank_job

    config = stage_config(tmp_path, [*INPROCESS[:2], "capture.inprocess.tp_size=2"])
    missing = ["--run-id", "r", "--responses", f"file://{tmp_path}/no-such-responses", "--snapshot", "s"]
    with pytest.raises(EngineError, match="job of 2 ranks failed with exit code"):
        launch_rank_job(2, missing, config.dump())


def test_the_parity_stage_checks_a_job_of_ranks_in_a_job_of_its_ranks(responses, monkeypatch):
    root, store, uri = responses
    config = stage_config(root, [*INPROCESS[:2], "capture.inprocess.tp_size=2"])
    report = run_stage("parity", config, "snap", store, responses_uri=uri).parity
    assert report["passed"] and report["samples"] == config.capture.parity.samples > 0
    # no samples to compare: an in-process engine has nothing else to check, so no job is started
    from pipeline.stages import parity

    monkeypatch.setattr(parity, "launch_rank_job", lambda *a: pytest.fail("a rank job was started"))
    no_samples = [*INPROCESS[:2], "capture.inprocess.tp_size=2", "capture.parity.samples=0"]
    unchecked = stage_config(root, no_samples)
    report = run_stage("parity", unchecked, "snap", store, responses_uri=uri).parity
    assert report["skipped"].startswith("capture.parity.samples is 0")


def test_a_pilots_capture_rate_is_used_only_for_the_same_capture_path():
    from pipeline.config import load_config as load
    from pipeline.ops.capacity import plan

    kimi = load("configs/kimi-k2.5.yaml")  # capture.engine sglang
    pilot = {
        "rates": {"capture_tok_s_per_server": 99.0},
        "source": {"run_id": "p", "capture_engine": "inprocess"},
    }
    other = plan(kimi, 1000, measured=pilot)
    assert other["rates"]["capture_tok_s_per_server"] != 99.0
    assert other["measured_from"]["capture_rate_not_used"] == "inprocess"
    same = plan(kimi, 1000, measured={**pilot, "source": {"run_id": "p", "capture_engine": "sglang"}})
    assert same["rates"]["capture_tok_s_per_server"] == 99.0


def test_a_mapped_capture_task_runs_its_shard_as_a_job_of_two_ranks(responses):
    """capture.run_shard (one mapped task per response shard) launches its ranks too; rank 0 stores the
    shard's part and marker once."""
    from pipeline import layout
    from pipeline.manifest import read_manifest as manifest_of
    from pipeline.stages import capture as capture_stage

    root, store, uri = responses
    config = stage_config(root, [*INPROCESS[:2], "capture.inprocess.tp_size=2"])
    shard = manifest_of(store, store.key_for(uri))["shards"][0]
    result = capture_stage.run_shard(config, uri, "mapped", shard["name"], store)
    prefix = layout.captures_prefix(config.target.name, "mapped")
    marker = capture_stage.store_marker(store, prefix, shard)
    assert marker is not None and result == {"shard": shard["name"], "counts": marker["counts"]}
    [part] = capture_stage.marker_parts(marker)
    assert store.exists(f"{prefix}/{part['shard']['name']}") and part["shard"]["samples"] > 0
