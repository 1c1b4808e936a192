"""Typed records: what the stages write to the object store and read back, one pydantic model each.

    DatasetRecord datasets/<target>/<dataset>/manifest.json (dataset; the dataset is its manifest)
    EvalRecord    runs/<run_id>/eval/eval.json       (evaluate)
    GateRecord    runs/<run_id>/gate/gate.json       (gate)
    BenchRecord   runs/<run_id>/bench/bench.json     (benchmark; the local or the SGLang engine)
    PromoteRecord runs/<run_id>/promote/promote.json (promote)
    RunSummary    runs/<run_id>/summary.json         (`drafter run`)
    WorkerSpec    runs/<run_id>/train/worker_spec.json (train -> every training rank)

A stage record is written with `write_record` (or `publish_record`, which also publishes the stage's
manifest) and read with `read_record`, which verifies it against the manifest and validates it: a missing,
renamed or unexpected field is an error where the record is read, naming the record and its URI.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.config import DEFAULT_DOMAIN, GateConfig, RunConfig
from pipeline.data.capture_contract import CaptureContract
from pipeline.manifest import publish, read_listed, read_manifest
from pipeline.storage import ObjectInfo, ObjectStore


class RecordError(ValueError):
    """A stored record that does not match its model (a missing, renamed or unexpected field)."""


class Record(BaseModel):
    """A typed record: unknown fields are errors, and so are missing ones without a default."""

    model_config = ConfigDict(extra="forbid")


class FileRecord(Record):
    """A record stored as one JSON object named FILE_NAME."""

    FILE_NAME: ClassVar[str]

    def to_json(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), indent=2).encode()


class StageRecord(FileRecord):
    """A stage's record, listed in the stage's manifest (of kind KIND) beside it, as <KIND>.json."""

    KIND: ClassVar[str]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if "KIND" in cls.__dict__:
            cls.FILE_NAME = f"{cls.KIND}.json"


# ---------------------------------------------------------------- dataset


class DatasetShard(Record):
    """One capture shard of a dataset (pipeline.data.capture_shards), where it is and what it holds."""

    key: str  # object key of the shard
    name: str
    split: Literal["train", "eval"]
    domain: str = DEFAULT_DOMAIN  # the prompts' domain (prompts.sources[].domain or the record's own)
    bytes: int
    sha256: str
    samples: int
    tokens: int
    assistant_tokens: int
    teacher: list[str]  # the teacher signals stored: "topk", "last_hidden"
    encoding: str  # the aux states' encoding: fp8 or bf16


class SplitTotals(Record):
    samples: int
    tokens: int
    assistant_tokens: int


class DatasetContent(Record):
    """What the dataset stage publishes: the capture shards a training run reads, one contract."""

    dataset: str
    target: str
    captures: list[str]  # URIs of the captures it was made of
    contract: CaptureContract
    train_shards: list[DatasetShard]
    eval_shards: list[DatasetShard]
    totals: dict[Literal["train", "eval"], SplitTotals]


class DatasetRecord(DatasetContent):
    """A published dataset: its manifest (pipeline.manifest.publish adds the envelope fields)."""

    KIND: ClassVar[str] = "dataset"

    kind: Literal["dataset"]
    schema_version: int
    created_at: str
    code_version: str
    uri: str
    objects: list[dict[str, Any]]


def read_dataset(store: ObjectStore, uri_or_prefix: str) -> DatasetRecord:
    """The dataset published at `uri_or_prefix`, validated (RecordError names what does not match)."""
    prefix = store.key_for(uri_or_prefix)
    manifest = read_manifest(store, prefix, kind=DatasetRecord.KIND)
    try:
        return DatasetRecord.model_validate(manifest)
    except ValidationError as err:
        raise RecordError(f"DatasetRecord at {store.uri(prefix)} does not match its model: {err}") from err


# ---------------------------------------------------------------- evaluate


class AcceptanceMetrics(Record):
    """Acceptance of a drafter on the held-out captures, per draft step k (from summed counts)."""

    acc: list[float]  # the draft token at step k is the teacher's, given a correct prefix of targets
    full_acc: list[float]  # P(drafts 0..k all accepted), a chain
    cond_acc: list[float]  # P(draft k accepted | drafts 0..k-1 accepted)
    tau_simulated: float  # 1 + sum(full_acc): tokens per verify step of a chain of every step
    full_acc_at: dict[str, list[float]]  # full_acc of a draft tree of width "k" (str: a JSON key)


class DomainAcceptance(AcceptanceMetrics):
    """Acceptance on the held-out samples of one domain."""

    samples: int


class EvalSummary(Record):
    """The headline of an evaluation: the eval manifest's summary and a promoted version's lineage."""

    samples: int
    acc: list[float]
    full_acc: list[float]
    cond_acc: list[float]
    tau_simulated: float


class IncumbentEval(AcceptanceMetrics):
    """The incumbent drafter on the same eval set."""

    version: str
    domains: dict[str, DomainAcceptance] = Field(default_factory=dict)
    # an incumbent trained for another target (its config, tokenizer or chat template differ), scored here
    target_differs: list[str] = Field(default_factory=list)


class IncumbentSkipped(Record):
    """The incumbent could not be compared (it reads other features: other layers or widths)."""

    version: str
    skipped: str


class InitProbe(Record):
    """The incumbent drafter scored on the new dataset's held-out split before training (train.init auto)."""

    cond_acc: list[float]
    tau_simulated: float
    bar: float  # the held-out cond_acc_0 a warm start from another target needs


class VocabularyCoverage(Record):
    """Shares of the new data's held-out assistant tokens a draft vocabulary cannot emit: the incumbent's
    (what a warm start keeps) and one built from the new data (what scratch gets)."""

    incumbent_outside: float
    fresh_outside: float


class WarmRestartBar(Record):
    """Under what training cond_acc_0 a warm start auto chose that stops improving is restarted from scratch,
    and where that figure comes from (pipeline.training.init_choice.warm_restart_bar)."""

    cond_acc0: float
    reason: str


class InitChoice(Record):
    """Which drafter a training attempt started from, and why (pipeline.training.init_choice)."""

    requested: Literal["scratch", "warm", "auto"]
    chosen: Literal["scratch", "warm"]
    reason: str
    # what was (or would have been) warm-started from: a drafter directory or registry:<alias or version>
    source: str | None = None
    version: str | None = None  # the registry version behind `source`, when it names one
    probe: InitProbe | None = None
    vocabulary: VocabularyCoverage | None = None  # measured for an incumbent of another target
    restart_under: WarmRestartBar | None = None  # set when auto chose the warm start


class ShapeAcceptance(Record):
    """Acceptance of one draft shape (steps, topk, draft tokens) simulated on held-out captures with the
    decoder's own tree expansion and pruning (pipeline.decoding.tree_acceptance): what the speed model
    predicts a tree's (and a chain's) acceptance length from."""

    steps: int
    topk: int
    draft_tokens: int
    full_acc: list[float]  # per depth: P(at least d drafts accepted)
    tau: float  # 1 + sum(full_acc): tokens per verify cycle, bonus included
    anchors: int  # held-out anchors simulated


class EvalRecord(AcceptanceMetrics, StageRecord):
    KIND: ClassVar[str] = "eval"

    samples: int
    ttt_steps: int
    teacher: str
    counts: list[list[float]]  # MetricCounts rows, summed over every eval sample
    domains: dict[str, DomainAcceptance] = Field(default_factory=dict)  # the same, per held-out domain
    loss: list[float]
    masked_tokens: list[int]
    chain_anchors: list[int]
    # per step: the share of masked positions whose target top-1 is outside the draft vocabulary (counted
    # as misses above, trained on nowhere); empty in records written before it was measured
    inexpressible_fraction: list[float] = Field(default_factory=list)
    drafter: str  # the train artifact's URI
    dataset: str  # the dataset's URI
    incumbent: IncumbentEval | IncumbentSkipped | None = None
    # the draft shapes the benchmark may choose, simulated (empty in records written before)
    shapes: list[ShapeAcceptance] = Field(default_factory=list)
    # how each training attempt of the drafter began (the train manifest's attempts; empty before)
    init: list[InitChoice] = Field(default_factory=list)

    def shape(self, steps: int, topk: int, draft_tokens: int) -> ShapeAcceptance | None:
        return next(
            (s for s in self.shapes if (s.steps, s.topk, s.draft_tokens) == (steps, topk, draft_tokens)), None
        )

    def summary(self) -> EvalSummary:
        return EvalSummary.model_validate(self.model_dump(include=set(EvalSummary.model_fields)))


# ---------------------------------------------------------------- gate


class GateCheck(Record):
    check: str
    value: float
    threshold: float
    passed: bool
    incumbent_version: str | None = None  # only on the check against the incumbent


class GateRecord(StageRecord):
    KIND: ClassVar[str] = "gate"

    run_id: str
    thresholds: GateConfig
    passed: bool
    checks: list[GateCheck]
    reasons: list[str]
    # how each training attempt of the candidate began (EvalRecord.init): a warm start that stalled and
    # the scratch attempt that followed both show here
    init: list[InitChoice] = Field(default_factory=list)


# ---------------------------------------------------------------- benchmark


class MethodResult(Record):
    """One decoding method over the benchmark prompts."""

    tokens: int
    seconds: float
    tok_s: float
    round_tok_s: list[float]  # tokens/s of each measured round (one prompt locally, a batch on SGLang)
    requests: int | None = None  # SGLang engine only
    tau_measured: float | None = None  # tokens per verify step; speculative methods only
    accepted_histogram: list[int] | None = None  # verify steps by draft tokens accepted
    # P(the draft at position i of a chain is accepted), over every verify step (vLLM's own counters on the
    # vLLM engine); speculative methods only
    acceptance_per_position: list[float] | None = None
    # sha256 of the outputs of one round (the token ids of every prompt, as JSON): the same for every method
    # when their outputs all equal greedy decoding, and comparable across engines
    outputs_sha256: str | None = None


class MeasuredAcceptance(Record):
    """One method's acceptance on part of the benchmark prompts, without a speed of its own (SGLang: from
    each request's meta_info, the prompts of every domain sent in the same rounds)."""

    requests: int
    tokens: int
    tau_measured: float | None = None
    accepted_histogram: list[int] | None = None
    acceptance_per_position: list[float] | None = None


class NgramSettingResult(Record):
    """One n-gram setting of the benchmark's sweep and what it measured."""

    setting: str  # its label (pipeline.benchmark_settings.NgramLocalSetting / NgramServerSetting .label)
    knobs: dict[str, int | str]  # the setting's fields
    result: MethodResult


class NgramSweep(Record):
    """Every n-gram setting the benchmark measured; `best` (the highest tokens/s) is the n-gram the candidate
    is compared with (BenchMethods.ngram, speedups["ngram"])."""

    measured_on: str  # which prompts the sweep ran on
    settings: list[NgramSettingResult]
    best: str  # the label of the fastest setting


class BenchMethods(Record):
    baseline: MethodResult
    ngram: MethodResult  # n-gram at its best setting (BenchRecord.ngram_sweep.best)
    candidate: MethodResult
    incumbent: MethodResult | None = None

    def present(self) -> dict[str, MethodResult]:
        """The methods that ran, by name, in the order the report shows them."""
        return {
            name: result
            for name, result in (
                ("baseline", self.baseline),
                ("ngram", self.ngram),
                ("candidate", self.candidate),
                ("incumbent", self.incumbent),
            )
            if result is not None
        }


class RatioInterval(Record):
    """A ratio of two measured speeds with its confidence interval (pipeline.spread): the candidate's
    tokens/s over another method's, paired round by round."""

    ratio: float
    ci_low: float
    ci_high: float
    confidence: float
    rounds: int


class DraftSetting(Record):
    """A draft setting with the speedup model's prediction for it (pipeline.decoding.speedup.Setting)."""

    steps: int
    topk: int
    draft_tokens: int
    tau: float
    tok_s: float
    speedup: float


class MeasuredCosts(Record):
    """Seconds per forward (pipeline.decoding.speedup.StepCosts), keyed by token count / width."""

    target_step: float
    verify_chain: dict[str, float]
    verify_tree: dict[str, float]
    draft: dict[str, float]


class Calibration(Record):
    """One setting timed in calibration, beside plain decoding and the other settings, prompt by prompt:
    `setting` holds the forwards-only prediction, `predicted_speedup` the prediction with the bookkeeping
    fitted on every timed setting (in-sample), `speedup` the measured one with its interval."""

    setting: DraftSetting
    tok_s: float
    tau_measured: float | None
    speedup: RatioInterval | None = None  # its tokens/s over plain decoding's, paired by prompt
    vs_fastest: RatioInterval | None = None  # its tokens/s over the fastest setting's (None: the fastest)
    predicted_speedup: float | None = None
    seconds_per_cycle: float | None = None
    phase: int = 1  # the calibration phase it was last timed in (figures relative to that phase's fastest)


class SettingChoice(Record):
    """How the setting was chosen from the calibration (pipeline.decoding.choice)."""

    chosen: str
    fastest: str
    tied: list[str]  # the fastest and every setting within its noise; the simplest of them is chosen
    reason: str
    prompts: int  # calibration prompts, decoded in turn
    rounds: int  # prompts decoded by every setting (and plain decoding), interleaved
    stopped_by: str  # decided (every pair settled), budget or max_rounds
    # calibration phases: the model's shortlist, then (when the model refitted with the bookkeeping ranks
    # other settings among the best) those against the first phase's fastest and its ties; the choice is
    # the last phase's
    phases: int = 1


class PredictedVsMeasured(Record):
    tau: tuple[float, float | None]  # (predicted, measured)
    speedup: tuple[float, float]  # (predicted, measured)


class SpeedModel(Record):
    """How the local benchmark chose its setting: measured costs, the ranking, the calibration runs."""

    costs: MeasuredCosts
    chosen: DraftSetting
    calibration: list[Calibration]
    predicted_vs_measured: PredictedVsMeasured
    ranked: list[DraftSetting]
    # the fitted bookkeeping per cycle (pipeline.decoding.speedup.Overhead) and the choice; None in records
    # written before settings were chosen by measurement
    overhead: dict[str, float] | None = None
    choice: SettingChoice | None = None


class TimedSetting(Record):
    """A serving setting the SGLang benchmark timed before choosing (benchmark.sglang.candidates): its
    figures, its speed over plain decoding and over the fastest setting's, paired by round."""

    steps: int
    topk: int
    draft_tokens: int
    tau_predicted: float | None  # the evaluation's (a chain's TTT counts, a tree's simulated shape)
    tau_measured: float | None
    tok_s: float
    round_tok_s: list[float]
    speedup: RatioInterval  # over the baseline server's, paired by round
    vs_fastest: RatioInterval | None = None  # over the fastest setting's (None: the fastest)


class UndecidedSpeedup(Record):
    """A speedup whose interval holds its threshold and is wider than benchmark.ci_rel_width: the benchmark
    stopped (its budget or rounds spent) before it could tell. Widths are relative, (ci_high - ci_low) /
    ratio, as benchmark.ci_rel_width is; `width_needed` is the widest interval around the same ratio on
    which the promotion rule decides (pipeline.stages.benchmark.width_to_decide)."""

    comparison: str  # as the decision's reasons name it: "candidate/baseline", "... at batch 4"
    method: str
    batch_size: int
    ratio: float
    ci_low: float
    ci_high: float
    rounds: int
    required: float
    width_reached: float
    width_needed: float


# faster: promotable; slower: some interval under its threshold (or behind the incumbent); inconclusive:
# none decided against, some too wide to tell; refused: otherwise (a batch size the rule needs was not
# measured, or an interval as narrow as benchmark.ci_rel_width still holds its threshold); mismatch: the
# serving engine's acceptance differs from the reference decoder's past benchmark.acceptance_tolerance.
# What each means to a person: pipeline.promotion.BENCH_OUTCOMES
BenchVerdict = Literal["faster", "slower", "inconclusive", "refused", "mismatch"]


class BenchDecision(Record):
    promotable: bool
    reasons: list[str]
    verdict: BenchVerdict
    undecided: list[UndecidedSpeedup] = Field(default_factory=list)  # when inconclusive
    next_step: str | None = None  # when inconclusive: how a rerun can decide

    @model_validator(mode="before")
    @classmethod
    def _verdict_of_earlier_records(cls, data: Any) -> Any:
        """A decision recorded before verdicts were: promotable, or refused."""
        if isinstance(data, dict) and "verdict" not in data:
            return {**data, "verdict": "faster" if data.get("promotable") else "refused"}
        return data


class SampledBench(Record):
    """The benchmark at the serving temperature (benchmark.serving_sampling): each method's figures, its
    outputs draws from the target's own distribution (pipeline.decoding.sampling), and the candidate's
    speedups over the others, paired round by round."""

    temperature: float
    top_p: float
    top_k: int
    methods: dict[str, MethodResult]
    speedups: dict[str, RatioInterval]


class RealEngineFigures(Record):
    """Records written before the serving engine decided (benchmark.vllm_beside_reference): the reference
    decoder's candidate also served by vLLM, its acceptance beside the reference decoder's and vLLM's own
    speedup. Read, never written now (BenchSummary.acceptance and BenchRecord.beside took its place)."""

    engine: Literal["vllm"]
    engine_version: str
    draft_steps: int
    tau: float
    reference_tau: float
    tau_rel_diff: float
    acceptance_per_position: list[float]
    reference_acceptance_per_position: list[float]
    baseline_tok_s: float
    drafter_tok_s: float
    speedup_vs_baseline: RatioInterval


class AcceptanceCheck(Record):
    """The serving engine's acceptance against the reference decoder's, on the same prompts, drafter and
    chain, the reference decoder's drafts counted as the serving engine counts them: a relative difference of
    tau past `tolerance` (benchmark.acceptance_tolerance) refuses the candidate, as the engine would then
    serve other drafts than the ones the evaluation and the reference decoder judged."""

    engine: str
    draft_steps: int
    tau: float  # the serving engine's, of the candidate
    reference_tau: float
    rel_diff: float  # |tau - reference_tau| / reference_tau
    tolerance: float
    passed: bool
    acceptance_per_position: list[float]
    reference_acceptance_per_position: list[float]


class DraftedAt(Record):
    """The draft setting figures were measured at (SGLang's --speculative-num-steps, --speculative-eagle-topk,
    --speculative-num-draft-tokens)."""

    draft_steps: int
    topk: int
    draft_tokens: int


class BatchFigures(DraftedAt):
    """The candidate's speedups at one batch size beside the headline's (benchmark.batch_sizes): local, the
    reference decoder's batched decoding of that many held-out prompts at once, with the speed model's chain
    for this size and its prediction; SGLang, that many requests in flight; vLLM, that many prompts per
    generate call."""

    batch_size: int
    speedups: dict[str, RatioInterval]
    tau_measured: float | None = None
    predicted_tau: float | None = None  # the speed model's (local)
    predicted_speedup: float | None = None  # the speed model's, from costs measured at this batch size


class BatchBench(BatchFigures):
    """BatchFigures with every method's figures at that batch size and (local) the step costs measured
    at it and the chains it ranked."""

    methods: BenchMethods
    costs: MeasuredCosts | None = None
    ranked: list[DraftSetting] = Field(default_factory=list)


# records written before the reference decoder's engine was named "reference"
LEGACY_ENGINE_NAMES = {"local": "reference"}


class BenchSummary(DraftedAt):
    """The headline of a benchmark: in the bench manifest and in a promoted version's lineage; the figures
    of the engine whose speed decided (`engine`). `speedup_vs_*` are the point estimates of `speedups` (the
    candidate over baseline, ngram, incumbent)."""

    engine: str  # a name of pipeline.benchmark_settings.ENGINES
    engine_version: str | None = None  # a real engine's version (vLLM's, SGLang's)
    tau_simulated: float
    tau_measured: float | None
    baseline_tok_s: float
    drafter_tok_s: float
    speedup_vs_baseline: float
    speedup_vs_ngram: float
    speedups: dict[str, RatioInterval]
    # the serving engine's acceptance against the reference decoder's (benchmark.reference_beside)
    acceptance: AcceptanceCheck | None = None
    real_engine: RealEngineFigures | None = None  # records written before the serving engine decided
    batch_size: int = 1  # of the figures above: requests in flight on SGLang
    # SGLang: every server's --max-running-requests, which the serving pods run with (None: not set, or
    # another engine)
    max_running_requests: int | None = None
    batch_figures: list[BatchFigures] = Field(default_factory=list)  # at the other measured batch sizes

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_of_earlier_records(cls, engine: Any) -> Any:
        return LEGACY_ENGINE_NAMES.get(engine, engine) if isinstance(engine, str) else engine


class EngineBench(BenchSummary):
    """Everything one engine measured (pipeline.benchmark: each engine's `measure`): the headline, every
    method's figures, and what it measured beside them."""

    prompts: int
    max_new_tokens: int
    methods: BenchMethods
    speed_model: SpeedModel | None = None  # the reference decoder, when it chose the setting by timing
    ngram_sweep: NgramSweep | None = None  # None in records written before n-gram settings were swept
    # per held-out domain, every method's figures on that domain's prompts (the reference decoder)
    domains: dict[str, BenchMethods] = Field(default_factory=dict)
    sampled: SampledBench | None = None  # at the serving temperature (None: not measured)
    batches: list[BatchBench] = Field(default_factory=list)  # the batch sizes beside the headline's
    # per held-out domain, each method's measured acceptance (the SGLang engine, whose rounds mix domains)
    domain_acceptance: dict[str, dict[str, MeasuredAcceptance]] = Field(default_factory=dict)
    # the SGLang engine with benchmark.sglang.candidates: every setting timed, and how the served one was
    # chosen
    timed_settings: list[TimedSetting] = Field(default_factory=list)
    setting_choice: SettingChoice | None = None

    def summary(self) -> BenchSummary:
        summary = BenchSummary.model_validate(self.model_dump(include=set(BenchSummary.model_fields)))
        summary.batch_figures = [
            BatchFigures.model_validate(batch.model_dump(include=set(BatchFigures.model_fields)))
            for batch in self.batches
        ]
        return summary


class BenchRecord(EngineBench, StageRecord):
    """runs/<run_id>/bench/bench.json: the figures of the engine that decided (benchmark.engine), the
    decision made on them (pipeline.promotion), and what was measured beside them, reported, not decisive
    (`beside`: the reference decoder's own timing, by engine name)."""

    KIND: ClassVar[str] = "bench"

    run_id: str
    decision: BenchDecision
    beside: dict[str, EngineBench] = Field(default_factory=dict)


# ---------------------------------------------------------------- promote


class AliasRecord(Record):
    """drafters/<target>/aliases/<alias>.json (pipeline.ops.registry.move_alias)."""

    alias: str
    version: str
    previous_version: str | None
    updated_at: str
    reason: str


class GateSummary(Record):
    passed: bool
    reasons: list[str]


class Lineage(Record):
    """Where a promoted version came from; stored in its registry manifest and model card."""

    run_id: str
    dataset: str
    contract: CaptureContract
    train: str
    training_config: dict[str, Any]
    drafter_config: dict[str, Any]
    code_version: str
    eval: EvalSummary
    gate: GateSummary
    bench: BenchSummary


class PromoteRecord(StageRecord):
    KIND: ClassVar[str] = "promote"

    promoted: bool
    reason: str | None = None  # why not, when not promoted
    version: str | None = None
    alias: str | None = None
    registry_uri: str | None = None
    alias_record: AliasRecord | None = None


# ---------------------------------------------------------------- run summary


class StageCost(Record):
    """What a run's tasks of one stage held, every attempt counted (pipeline.ops.usage)."""

    stage: str
    attempts: int
    seconds: float
    gpu_hours: float
    cost_usd: float | None  # None: the deployment states no GPU price


class RunCost(Record):
    stages: list[StageCost]
    gpu_hours: float
    cost_usd: float | None
    # serving 1,000 generated tokens with the drafter costs this much less, on the benchmark's GPUs
    saved_usd_per_1k_tokens: float | None = None


class RunSummary(FileRecord):
    """`drafter run`'s summary.json (written beside the run's artifacts, not under a manifest)."""

    FILE_NAME: ClassVar[str] = "summary.json"

    run_id: str
    target: str
    samples: int
    tokens: int
    cond_acc: list[float]
    stop_reason: str
    outcome: str
    init: list[InitChoice] = Field(default_factory=list)  # how each training attempt began (train.init)
    chosen_epoch: int | None = None  # the exported epoch (best held-out tau_simulated), 0-based
    heldout_tau_by_epoch: list[float] | None = None  # held-out tau_simulated after each epoch
    report: str
    gate_passed: bool | None = None
    tau_simulated: float | None = None
    tau_measured: float | None = None
    baseline_tok_s: float | None = None
    ngram_tok_s: float | None = None
    ngram_best_setting: str | None = None  # the n-gram setting the candidate was compared with (the fastest)
    drafter_tok_s: float | None = None
    speedup_vs_baseline: float | None = None
    speedup_vs_ngram: float | None = None
    speedups: dict[str, RatioInterval] | None = None  # the speedups' intervals (BenchSummary.speedups)
    bench_engine: str | None = None  # the engine whose speed decided (BenchSummary.engine)
    bench_engine_version: str | None = None
    acceptance: AcceptanceCheck | None = None  # the serving engine's against the reference decoder's
    # the reference decoder's own speedups, measured beside the serving engine, not decisive
    reference_speedups: dict[str, RatioInterval] | None = None
    promoted_version: str | None = None
    registry_uri: str | None = None
    pulled_to: str | None = None
    failure: str | None = None
    next_step: str | None = (
        None  # an inconclusive benchmark: how a rerun can decide (BenchDecision.next_step)
    )
    cost: RunCost | None = None  # what the run's tasks held and cost, per stage


# ---------------------------------------------------------------- training worker


class DrafterSource(Record):
    """What building the drafter needs: the target, the capture contract, the draft vocabulary and an
    optional warm start."""

    target_dir: str
    contract: CaptureContract
    draft_vocab: list[int]  # target token ids of the draft vocabulary
    init_dir: str | None = None  # a local drafter directory to warm-start from
    # train.init auto chose the warm start: a plateau within auto_init.plateau_steps under this training
    # cond_acc_0 ends the attempt (stop_reason "warm_plateau") so the train stage restarts it from scratch
    warm_restart_bar: float | None = None


class WorkerSpec(DrafterSource, FileRecord):
    """What every training rank reads first (written by the train stage, read by `drafter train-worker`).
    Its local paths are the same on every node."""

    FILE_NAME: ClassVar[str] = "worker_spec.json"

    config: RunConfig
    run_id: str
    workdir: str
    train_shards: list[DatasetShard]
    # the held-out shards every epoch is evaluated on; the best epoch is exported (none: the last one)
    eval_shards: list[DatasetShard] = Field(default_factory=list)
    shard_cache: str


# ---------------------------------------------------------------- reading and writing

R = TypeVar("R", bound=FileRecord)
S = TypeVar("S", bound=StageRecord)


def parse_record(record_type: type[R], data: bytes, uri: str) -> R:
    """The record in `data`, read from `uri`; RecordError (a ValueError) names every field that does not
    match the model."""
    try:
        return record_type.model_validate_json(data)
    except ValidationError as err:
        raise RecordError(f"{record_type.__name__} at {uri} does not match its model: {err}") from err


def write_record(store: ObjectStore, prefix: str, record: FileRecord) -> ObjectInfo:
    """Store `record` as <prefix>/<its FILE_NAME> (JSON, indent 2)."""
    return store.put_bytes(f"{prefix}/{record.FILE_NAME}", record.to_json())


def publish_record(
    store: ObjectStore, prefix: str, record: StageRecord, fields: dict[str, Any]
) -> dict[str, Any]:
    """write_record, then the stage's manifest (of the record's KIND) listing it; returns the manifest."""
    return publish(store, prefix, record.KIND, [write_record(store, prefix, record)], fields)


def read_record(store: ObjectStore, uri_or_prefix: str, record_type: type[S]) -> S:
    """The record a stage published at `uri_or_prefix`, verified against the stage's manifest (its kind,
    and the record's sha256) and validated against `record_type`."""
    prefix = store.key_for(uri_or_prefix)
    manifest = read_manifest(store, prefix, kind=record_type.KIND)
    data = read_listed(store, prefix, manifest, record_type.FILE_NAME)
    return parse_record(record_type, data, store.uri(f"{prefix}/{record_type.FILE_NAME}"))
