"""The benchmark's engines (ENGINES: the engine each name runs, pipeline.benchmark) and the benchmark section
of a run config (`benchmark:`): what every engine measures (prompts, rounds, intervals, thresholds, batch
sizes, sampling) and each engine's own settings (`benchmark.sglang`, `benchmark.vllm`; the reference
decoder's calibration and n-gram settings).

Imported by pipeline.config, so it imports nothing of the engines themselves: their modules are loaded when
one measures (pipeline.benchmark.job.run_engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from pipeline.config_base import Strict, refuse_replaced_keys, unique_labels
from pipeline.engine_settings import VllmEngineConfig
from pipeline.sglang_ngram_rules import launch_from_args, refusals, silent_changes


@dataclass(frozen=True)
class Engine:
    """One benchmark engine: its name in benchmark.engine and in the records, and the module that measures
    with it (imported when it measures, so reading the table loads no engine)."""

    name: str
    module: str
    help: str
    # it drafts every position of its chain in every step, needed or not, and counts every draft accepted
    # (vLLM): the reference decoder beside it counts its own drafts the same way
    drafts_whole_chain: bool = False


ENGINES: tuple[Engine, ...] = (
    Engine("reference", "pipeline.benchmark.reference", "the project's reference speculative decoder, here"),
    Engine("vllm", "pipeline.benchmark.vllm", "vLLM engines, one per method", drafts_whole_chain=True),
    Engine("sglang", "pipeline.benchmark.sglang", "SGLang servers, one per method in turn"),
)
ENGINE_NAMES = tuple(engine.name for engine in ENGINES)


def engine(name: str) -> Engine:
    for entry in ENGINES:
        if entry.name == name:
            return entry
    raise ValueError(f"unknown benchmark engine {name!r}; engines: {', '.join(ENGINE_NAMES)}")


class NgramServerSetting(Strict):
    """One NGRAM server the SGLang benchmark measures: SGLang 0.5.23's n-gram flags. A setting SGLang would
    refuse or run otherwise than written is refused here (pipeline.sglang_ngram_rules)."""

    draft_tokens: int = Field(ge=2, description="--speculative-num-draft-tokens: the draft tree's nodes + 1")
    min_bfs_breadth: int = Field(1, ge=1, description="--speculative-ngram-min-bfs-breadth (longest matches)")
    max_bfs_breadth: int = Field(
        10, ge=1, description="--speculative-ngram-max-bfs-breadth (shortest matches); SGLang's topk"
    )
    max_trie_depth: int = Field(
        18, ge=2, description="--speculative-ngram-max-trie-depth: matches suffixes of up to depth - 1 tokens"
    )
    match_type: Literal["BFS", "PROB"] = Field("BFS", description="--speculative-ngram-match-type")
    capacity: PositiveInt = Field(10_000_000, description="--speculative-ngram-capacity (trie nodes)")

    @property
    def label(self) -> str:
        kind = "" if self.match_type == "BFS" else f"-{self.match_type.lower()}"
        return (
            f"tokens{self.draft_tokens}-bfs{self.min_bfs_breadth}-{self.max_bfs_breadth}"
            f"-depth{self.max_trie_depth}{kind}"
        )

    def launch_args(self) -> list[str]:
        """The NGRAM server's speculative flags."""
        return [
            "--speculative-algorithm",
            "NGRAM",
            "--speculative-num-draft-tokens",
            str(self.draft_tokens),
            "--speculative-ngram-min-bfs-breadth",
            str(self.min_bfs_breadth),
            "--speculative-ngram-max-bfs-breadth",
            str(self.max_bfs_breadth),
            "--speculative-ngram-match-type",
            self.match_type,
            "--speculative-ngram-max-trie-depth",
            str(self.max_trie_depth),
            "--speculative-ngram-capacity",
            str(self.capacity),
        ]

    def serving_problems(self, extra_args: list[str]) -> list[str]:
        """What SGLang 0.5.23 would refuse or change in this setting, served with `extra_args`."""
        launch = launch_from_args([*extra_args, *self.launch_args()])
        return refusals(launch) + silent_changes(launch)

    @model_validator(mode="after")
    def _served_as_written(self) -> NgramServerSetting:
        problems = self.serving_problems([])
        if problems:
            raise ValueError(f"n-gram setting {self.label}:\n  - " + "\n  - ".join(problems))
        return self


def _ngram_server_sweep() -> list[NgramServerSetting]:
    """A chain, two narrow trees and SGLang's own defaults (12 draft tokens, breadth 10)."""
    return [
        NgramServerSetting(draft_tokens=4, max_bfs_breadth=1),
        NgramServerSetting(draft_tokens=4, max_bfs_breadth=4),
        NgramServerSetting(draft_tokens=8, max_bfs_breadth=4, max_trie_depth=8),
        NgramServerSetting(draft_tokens=12, max_bfs_breadth=10),
    ]


class EagleServerSetting(Strict):
    """One EAGLE3 serving setting: SGLang's --speculative-num-steps, --speculative-eagle-topk and
    --speculative-num-draft-tokens."""

    steps: PositiveInt
    topk: PositiveInt
    draft_tokens: int = Field(ge=2)

    def shape(self) -> tuple[int, int, int]:
        return (self.steps, self.topk, self.draft_tokens)

    @model_validator(mode="after")
    def _a_draft_sglang_serves(self) -> EagleServerSetting:
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise ValueError(f"with topk 1 SGLang requires draft_tokens == steps + 1, got {self.shape()}")
        drafted = self.topk + (self.steps - 1) * self.topk**2  # SGLang's rerank pool (eagle_utils.py:110)
        if self.draft_tokens > 1 + drafted:
            raise ValueError(
                f"draft_tokens {self.draft_tokens} exceeds the {1 + drafted} nodes a tree of {self.steps} "
                f"steps and topk {self.topk} drafts (root included)"
            )
        return self


MAX_RUNNING_FLAG = "--max-running-requests"


class SGLangBenchConfig(Strict):
    """Servers the SGLang benchmark starts, one method at a time, on this machine's GPUs."""

    launch: list[str] = Field(default_factory=lambda: ["python", "-m", "sglang.launch_server"])
    model_path: str
    extra_args: list[str] = Field(default_factory=list, description="e.g. --tp 8 --trust-remote-code")
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    startup_timeout_s: float = Field(1800.0, gt=0)
    concurrency: PositiveInt = Field(8, description="requests in flight")
    max_running_requests: PositiveInt | None = Field(
        None,
        description="--max-running-requests of every server the benchmark starts (the baseline's too) and "
        "of the serving pods (the promotion records it with the setting; `drafter pull --flags-file` "
        "writes it): the requests one replica runs at once, its load at capacity. Required: unset, SGLang "
        "0.5.23 runs an EAGLE server at 48 (arg_groups/speculative_hook.py:1086-1095) and a plain one at "
        "what its memory holds, so the baseline and the drafter would not serve the same load. The "
        "benchmark measures at it (one of the measured batch sizes) and at no more (a level above it "
        "only queues)",
    )
    rounds: int = Field(4, ge=2, description="batches the prompts are sent in, one tokens/s sample each")
    steps: PositiveInt = Field(3, description="--speculative-num-steps for EAGLE3")
    topk: PositiveInt = Field(1, description="--speculative-eagle-topk")
    draft_tokens: int = Field(4, ge=2, description="--speculative-num-draft-tokens")
    candidates: list[EagleServerSetting] = Field(
        default_factory=list,
        description="EAGLE3 settings timed first, one candidate server each, on the benchmark prompts at the "
        "headline concurrency: the fastest measured, or the simplest within its noise "
        "(pipeline.decoding.choice), is then benchmarked and promoted with its flags. Empty: steps/topk/"
        "draft_tokens above",
    )
    ngram_settings: list[NgramServerSetting] = Field(
        default_factory=_ngram_server_sweep,
        min_length=1,
        description="NGRAM servers measured, one launch each; the candidate is compared with the fastest",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_removed_ngram_keys(cls, data: Any) -> Any:
        return refuse_replaced_keys(
            data,
            {"ngram_draft_tokens", "ngram_args"},
            "benchmark.sglang",
            "benchmark.sglang.ngram_settings: a list of {draft_tokens, min_bfs_breadth, max_bfs_breadth, "
            "max_trie_depth, match_type, capacity}, one NGRAM server per setting",
        )

    def load_args(self) -> list[str]:
        """The flags that set every server's load: --max-running-requests, when set."""
        if self.max_running_requests is None:
            return []
        return [MAX_RUNNING_FLAG, str(self.max_running_requests)]

    def setting(self) -> tuple[int, int, int]:
        """(--speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens)"""
        return (self.steps, self.topk, self.draft_tokens)

    def candidate_settings(self) -> list[tuple[int, int, int]]:
        return [candidate.shape() for candidate in self.candidates]

    def serving(self, shape: tuple[int, int, int]) -> SGLangBenchConfig:
        """These settings with the drafters served at `shape` (steps, topk, draft tokens)."""
        steps, topk, draft_tokens = shape
        return self.model_copy(update={"steps": steps, "topk": topk, "draft_tokens": draft_tokens})

    @model_validator(mode="after")
    def _chain_tokens(self) -> SGLangBenchConfig:
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise ValueError("with topk 1 SGLang requires draft_tokens == steps + 1")
        if len(set(self.candidate_settings())) != len(self.candidates):
            raise ValueError(
                f"benchmark.sglang.candidates lists a setting twice: {self.candidate_settings()}"
            )
        return self

    @model_validator(mode="after")
    def _ngram_served_as_configured(self) -> SGLangBenchConfig:
        speculative = [arg for arg in self.extra_args if arg.startswith("--speculative")]
        if any(arg.split("=")[0] == MAX_RUNNING_FLAG for arg in self.extra_args):
            raise ValueError(
                f"benchmark.sglang.extra_args: {MAX_RUNNING_FLAG} is benchmark.sglang.max_running_requests, "
                "which the promotion records for the serving pods"
            )
        if speculative:
            raise ValueError(
                f"benchmark.sglang.extra_args go to every server, the baseline's too: {speculative} belong "
                "in the method's own settings (steps/topk/draft_tokens, ngram_settings)"
            )
        unique_labels(self.ngram_settings, "benchmark.sglang.ngram_settings")
        problems = [
            f"n-gram setting {setting.label}: {problem}"
            for setting in self.ngram_settings
            for problem in setting.serving_problems(self.extra_args)
        ]
        if problems:
            raise ValueError("with benchmark.sglang.extra_args:\n  - " + "\n  - ".join(problems))
        return self


class VllmBenchConfig(VllmEngineConfig):
    """The vLLM benchmark (benchmark.engine 'vllm'): one vLLM engine per method, the measured ones alive at
    once or one at a time (engines_at_once). vLLM's n-gram runs benchmark.ngram_settings
    (min_match/max_match/steps as vLLM's prompt_lookup_min/prompt_lookup_max/num_speculative_tokens)."""

    num_speculative_tokens: PositiveInt | None = Field(
        None, description="the candidate's and incumbent's draft chain; default: benchmark.draft_steps"
    )
    engines_at_once: bool = Field(
        True,
        description="the measured engines alive at once, their passes interleaved round by round; false: one "
        "engine at a time, each decoding a warm-up pass then max(3, benchmark.repeats) timed passes, paired "
        "by index (a GPU node holds one Kimi-K2.5 engine, as the SGLang runner's servers run in turn)",
    )


class NgramLocalSetting(Strict):
    """One setting of the reference decoder's n-gram (prompt-lookup) proposer. It drafts a chain, not a
    tree: SGLang's BFS breadth has no counterpart here."""

    min_match: PositiveInt = Field(1, description="shortest context suffix looked up")
    max_match: PositiveInt = Field(4, description="longest context suffix looked up (tried first)")
    steps: PositiveInt = Field(4, description="tokens drafted per verify forward (SGLang's draft tokens - 1)")

    @property
    def label(self) -> str:
        return f"match{self.min_match}-{self.max_match}-steps{self.steps}"

    @model_validator(mode="after")
    def _window(self) -> NgramLocalSetting:
        if self.min_match > self.max_match:
            raise ValueError(f"n-gram min_match {self.min_match} exceeds max_match {self.max_match}")
        return self


def _ngram_local_sweep() -> list[NgramLocalSetting]:
    """Short, medium and long matches and drafts: three settings keep the local sweep to seconds."""
    return [
        NgramLocalSetting(min_match=1, max_match=2, steps=2),
        NgramLocalSetting(min_match=1, max_match=4, steps=4),
        NgramLocalSetting(min_match=2, max_match=8, steps=6),
    ]


class ServingSampling(Strict):
    """How production samples (the serving engine's request defaults): the benchmark measures acceptance
    and speed at these too, besides greedy decoding."""

    temperature: float = Field(gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0: every token")


# engine names a run config may still hold, and what they are now
RENAMED_ENGINES = {"local": "reference"}


class BenchmarkConfig(Strict):
    engine: str = Field(
        "reference",
        description="the engine the drafter will be served with, whose speed decides (pipeline.benchmark."
        "ENGINES): reference (the project's reference decoder, where no real engine serves), vllm, sglang",
    )
    num_prompts: PositiveInt = 16
    max_new_tokens: PositiveInt = 96
    draft_steps: PositiveInt = Field(4, description="the candidate's chain when auto_select is off")
    auto_select: bool = Field(True, description="pick steps/topk/draft tokens with the speedup model")
    max_draft_steps: PositiveInt = 6
    tree_widths: list[int] = Field(default_factory=lambda: [1, 2, 4], description="topk values considered")
    max_draft_tokens: int = Field(16, ge=2)
    calibration_candidates: PositiveInt = Field(
        3,
        description="best predicted settings timed before choosing, besides the best predicted one of each "
        "tree width (the chain's included)",
    )
    calibration_prompts: PositiveInt = Field(
        8,
        description="held-out prompts the settings are timed on, prompt by prompt and interleaved with plain "
        "decoding, in turn until the choice is settled (pipeline.decoding.choice) or the budget is spent",
    )
    calibration_budget_s: float = Field(60.0, gt=0, description="seconds of calibration at most")
    calibration_resolution: float = Field(
        0.04,
        gt=0,
        description="a setting whose speed relative to the fastest is known to within this relative width "
        "is settled (a tie when its interval holds 1)",
    )
    ngram_settings: list[NgramLocalSetting] = Field(
        default_factory=_ngram_local_sweep,
        min_length=1,
        description="local and vLLM engines: n-gram settings timed on the calibration prompts; the fastest "
        "is measured against the candidate (SGLang engine: sglang.ngram_settings)",
    )
    repeats: PositiveInt = Field(1, description="passes over the prompts at least (all methods interleaved)")
    ci_rel_width: float = Field(
        0.1, gt=0, description="more passes until every speedup's interval is this narrow (relative)..."
    )
    budget_s: float = Field(120.0, gt=0, description="...or until this many seconds of timed decoding")
    reported_budget_s: float | None = Field(
        None,
        gt=0,
        description="budget_s of each measurement that is reported and does not decide: batch sizes outside "
        "promote_at_batch_sizes, the serving temperature, the reference decoder beside the serving engine "
        "(None: budget_s)",
    )
    confidence: float = Field(0.95, gt=0, lt=1, description="of the speedup intervals")
    min_speedup_vs_baseline: float = Field(1.0, ge=0)
    min_speedup_vs_ngram: float = Field(0.0, ge=0)
    min_speedup_vs_incumbent: float = Field(1.0, ge=0)
    serving_sampling: ServingSampling | None = Field(
        None,
        description="also measure baseline, candidate (and incumbent) sampled at the serving temperature/"
        "top_p/top_k, on every engine (the reference decoder verifies drafts by SGLang's rule); recorded "
        "beside the greedy figures, not gated (None: greedy only)",
    )
    batch_sizes: list[PositiveInt] | None = Field(
        None,
        description="batch sizes measured beside the headline's (local and vLLM: batch 1; SGLang: "
        "benchmark.sglang.concurrency). Local engine: batches of that many held-out prompts decoded "
        "together by the reference decoder (one target forward verifies every row; the drafter drafts the "
        "speed model's best chain at that size); SGLang: that many requests in flight; vLLM: that many "
        "prompts per generate call (None: the headline's only)",
    )
    promote_at_batch_sizes: list[PositiveInt] | None = Field(
        None,
        description="the measured batch sizes at which every speedup's lower bound must clear its "
        "min_speedup_* for the candidate to be promotable (None: the headline's)",
    )
    sglang: SGLangBenchConfig | None = None
    vllm: VllmBenchConfig | None = Field(
        None, description="engine 'vllm': its engines' settings (default: vLLM's CPU build, `make vllm-venv`)"
    )
    # engine 'vllm': the reference decoder on this machine beside vLLM, at vLLM's chain and fastest n-gram
    # setting. vLLM's greedy outputs must equal its own, and vLLM's acceptance of the candidate must match its
    # own (counted as vLLM counts) within acceptance_tolerance (relative, of tau), or the candidate is
    # refused; its own timing is recorded beside vLLM's, not decisive
    reference_beside: bool = Field(False, description="engine vllm: the reference decoder beside it")
    acceptance_tolerance: float = Field(
        0.02, gt=0, lt=1, description="with reference_beside: of tau, relative"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_removed_keys(cls, data: Any) -> Any:
        refuse_replaced_keys(
            data,
            {"ngram_max_match", "ngram_min_match"},
            "benchmark",
            "benchmark.ngram_settings: a list of {min_match, max_match, steps}, the fastest of which the "
            "candidate is compared with",
        )
        return refuse_replaced_keys(
            data,
            {"vllm_beside_reference"},
            "benchmark",
            "benchmark.engine vllm with benchmark.reference_beside true: vLLM's speed decides, and its "
            "acceptance must match the reference decoder's",
        )

    @field_validator("engine")
    @classmethod
    def _an_engine_of_the_table(cls, engine: str) -> str:
        if engine in RENAMED_ENGINES:
            raise ValueError(f"benchmark.engine {engine!r} is now {RENAMED_ENGINES[engine]!r}")
        if engine not in ENGINE_NAMES:
            raise ValueError(f"benchmark.engine {engine!r} is none of {', '.join(ENGINE_NAMES)}")
        return engine

    @model_validator(mode="after")
    def _engine_settings(self) -> BenchmarkConfig:
        unique_labels(self.ngram_settings, "benchmark.ngram_settings")
        if self.engine == "sglang" and self.sglang is None:
            raise ValueError(
                "benchmark.engine 'sglang' needs benchmark.sglang (launch command, model path, ...)"
            )
        if self.reference_beside and self.engine != "vllm":
            why = (
                "the reference decoder already decides"
                if self.engine == "reference"
                else "SGLang counts acceptance per request with the prefill token, and a production target "
                "does not fit the reference decoder"
            )
            raise ValueError(
                f"benchmark.reference_beside runs the reference decoder beside vLLM, not beside "
                f"benchmark.engine {self.engine!r}: {why}"
            )
        self._valid_batch_sizes()
        if self.engine == "sglang" and self.sglang is not None:
            self._measured_at_capacity(self.sglang.max_running_requests)
        return self

    def _measured_at_capacity(self, capacity: int | None) -> None:
        """The SGLang benchmark measures at the serving load, max_running_requests, and above it nowhere."""
        measured = self.measured_batch_sizes()
        if capacity is None:
            raise ValueError(
                "benchmark.sglang.max_running_requests is not set: the requests one serving replica runs at "
                "once (--max-running-requests, passed to every benchmark server and to the serving pods). "
                "Unset, SGLang 0.5.23 runs EAGLE at 48 and the baseline at what its memory holds "
                "(arg_groups/speculative_hook.py:1086-1095); set it, and add it to benchmark.batch_sizes "
                f"(measured: {measured})"
            )
        if capacity not in measured:
            raise ValueError(
                f"benchmark.sglang.max_running_requests {capacity} is not measured: add it to "
                f"benchmark.batch_sizes (measured: {measured}), so the drafter is timed at the load it serves"
            )
        above = [size for size in measured if size > capacity]
        if above:
            raise ValueError(
                f"benchmark batch sizes {above} exceed benchmark.sglang.max_running_requests {capacity}: "
                "a server runs that many at once and queues the rest, so those levels measure nothing more"
            )

    def _valid_batch_sizes(self) -> None:
        if self.batch_sizes is not None and len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError(f"benchmark.batch_sizes lists a size twice: {self.batch_sizes}")
        unmeasured = sorted(set(self.gated_batch_sizes()) - set(self.measured_batch_sizes()))
        if unmeasured:
            raise ValueError(
                f"benchmark.promote_at_batch_sizes {unmeasured} are not measured: add them to "
                f"benchmark.batch_sizes (measured: {self.measured_batch_sizes()})"
            )

    def budget_s_for(self, decides: bool) -> float:
        """The seconds of timed decoding a measurement may take: budget_s where the promotion rule reads it,
        reported_budget_s (when set) where it is only reported."""
        return self.budget_s if decides or self.reported_budget_s is None else self.reported_budget_s

    def decides_at(self, batch_size: int) -> bool:
        """Whether the promotion rule reads the speedups measured at `batch_size`."""
        return batch_size in self.gated_batch_sizes()

    def headline_batch_size(self) -> int:
        """The batch size of the headline figures: requests in flight on SGLang, 1 elsewhere."""
        return self.sglang.concurrency if self.engine == "sglang" and self.sglang is not None else 1

    def measured_batch_sizes(self) -> list[int]:
        return sorted({self.headline_batch_size(), *(self.batch_sizes or [])})

    def gated_batch_sizes(self) -> list[int]:
        return sorted(set(self.promote_at_batch_sizes or [self.headline_batch_size()]))
