"""The stage table: every stage is one module here with the same shape,

    Inputs(StageInputs)   the object-store URIs (and snapshot name) it reads
    Output(StageOutput)   what it hands on: the URI it published, its kind, a few small fields
    run(config, inputs, run_id, store) -> Output

and one entry in TABLE. `drafter run`, the CLI's per-stage commands and the scheduler's tasks
(pipeline.tasks.run_stage_task) all run stages through `run_stage`, which records what each held; inputs not
given default to the artifacts of the run (and of its data snapshot) in the object store (`default_inputs`,
keys from pipeline.layout).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, ConfigDict, Field

from pipeline import layout
from pipeline.ids import validate_id

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.ops.usage import Rates
    from pipeline.storage import ObjectStore


class StageInputs(BaseModel):
    """What a stage reads. Unknown fields are errors; a missing one is named where it is built."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class StageOutput(BaseModel):
    """What a stage hands on (XCom-sized): the URI of what it published and that artifact's kind, and
    the artifacts it read (its entry's `reads`; set by `Stage.run`), which its task reports as lineage."""

    model_config = ConfigDict(extra="forbid")
    uri: str
    kind: str
    read: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class Stage:
    """One table entry. The module is imported when the stage runs, so reading the table (a DAG file
    being parsed, `drafter --help`) loads no model code."""

    name: str
    module: str
    help: str
    reads: tuple[str, ...] = ()  # the artifact URIs among its inputs (the CLI's --options)
    in_run: bool = True  # `drafter run` runs it (the parity check runs inside capture there)

    def _load(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def inputs(self) -> type[StageInputs]:
        model = cast(type[StageInputs], self._load().Inputs)
        undeclared = set(model.model_fields) - {"snapshot", *self.reads}
        if undeclared:
            raise TypeError(
                f"stage {self.name}: inputs {sorted(undeclared)} are missing from its entry's reads"
            )
        return model

    @property
    def output(self) -> type[StageOutput]:
        return cast(type[StageOutput], self._load().Output)

    def run(self, config: RunConfig, inputs: StageInputs, run_id: str, store: ObjectStore) -> StageOutput:
        module = self._load()
        if not isinstance(inputs, module.Inputs):
            raise TypeError(f"stage {self.name} takes {module.Inputs.__name__}, not {type(inputs).__name__}")
        output = module.run(config, inputs, run_id, store)
        if not isinstance(output, module.Output):
            raise TypeError(
                f"stage {self.name} returned {type(output).__name__}, not {module.Output.__name__}"
            )
        return cast(StageOutput, output.model_copy(update={"read": self.read_uris(inputs)}))

    def read_uris(self, inputs: StageInputs) -> list[str]:
        """The artifact URIs among a stage's inputs, in its entry's order."""
        uris: list[str] = []
        for name in self.reads:
            value = getattr(inputs, name)
            uris += value if isinstance(value, list) else [value]
        return uris


TABLE: tuple[Stage, ...] = (
    Stage("prompts", "pipeline.stages.prompts", "prompt sources -> normalized conversation shards"),
    Stage("generate", "pipeline.stages.generate", "regenerate responses with the target", ("prompts_uri",)),
    Stage(
        "parity",
        "pipeline.stages.parity",
        "compare the capture engine with a reference forward on a few samples",
        ("responses_uri",),
        in_run=False,
    ),
    Stage(
        "capture", "pipeline.stages.capture", "capture aux hidden states and the teacher", ("responses_uri",)
    ),
    Stage("dataset", "pipeline.stages.dataset", "publish captures as a dataset snapshot", ("capture_uris",)),
    Stage("train", "pipeline.stages.train", "train a drafter on a dataset snapshot", ("dataset_uri",)),
    Stage(
        "evaluate",
        "pipeline.stages.evaluate",
        "evaluate the run's drafter (and the incumbent) on held-out captures",
        ("train_uri", "dataset_uri"),
    ),
    Stage("gate", "pipeline.stages.gate", "apply the config's thresholds to the evaluation", ("eval_uri",)),
    Stage(
        "benchmark",
        "pipeline.stages.benchmark",
        "measure baseline, n-gram, incumbent and candidate speed",
        ("train_uri", "eval_uri", "prompts_uri"),
    ),
    Stage(
        "promote",
        "pipeline.stages.promote",
        "publish the run's drafter to the registry",
        ("train_uri", "eval_uri", "gate_uri", "bench_uri"),
    ),
    Stage("report", "pipeline.stages.report", "render runs/<run_id>/report/: plots and report.html"),
)
STAGES = tuple(entry.name for entry in TABLE)


def already_published(store: ObjectStore, prefix: str, kind: str) -> StageOutput | None:
    """The output of a stage whose artifact is already published at `prefix` (checked to be of `kind`):
    a rerun reuses it instead of doing the work again."""
    from pipeline.manifest import manifest_exists, read_manifest

    if not manifest_exists(store, prefix):
        return None
    read_manifest(store, prefix, kind=kind)
    log.info("%s %s already published; reusing it", kind, store.uri(prefix))
    return StageOutput(uri=store.uri(prefix), kind=kind)


def stage(name: str) -> Stage:
    for entry in TABLE:
        if entry.name == name:
            return entry
    raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")


def default_inputs(config: RunConfig, store: ObjectStore, run_id: str, snapshot: str) -> dict[str, Any]:
    """Every input a stage can take, as the artifacts of `snapshot` (data) and `run_id` (the rest)."""
    target = config.target.name
    return {
        "snapshot": snapshot,
        "prompts_uri": store.uri(layout.prompts_prefix(snapshot)),
        "responses_uri": store.uri(layout.responses_prefix(target, snapshot)),
        "capture_uris": [store.uri(layout.captures_prefix(target, snapshot))],
        "dataset_uri": store.uri(layout.dataset_prefix(target, snapshot)),
        "train_uri": store.uri(layout.run_stage_prefix(run_id, "train")),
        "eval_uri": store.uri(layout.run_stage_prefix(run_id, "eval")),
        "gate_uri": store.uri(layout.run_stage_prefix(run_id, "gate")),
        "bench_uri": store.uri(layout.run_stage_prefix(run_id, "bench")),
    }


def resolve_inputs(
    entry: Stage, config: RunConfig, store: ObjectStore, run_id: str, snapshot: str, given: dict[str, Any]
) -> StageInputs:
    """The stage's inputs: those given (not None), the rest from `default_inputs`."""
    model = entry.inputs
    unknown = sorted(set(given) - set(model.model_fields))
    if unknown:
        raise ValueError(f"stage {entry.name} takes no input {', '.join(unknown)}")
    defaults = default_inputs(config, store, run_id, snapshot)
    values = {
        name: given[name] if given.get(name) is not None else defaults[name] for name in model.model_fields
    }
    return model.model_validate(values)


def run_stage(
    name: str,
    config: RunConfig,
    run_id: str,
    store: ObjectStore,
    snapshot: str | None = None,
    rates: Rates | None = None,
    **given: Any,
) -> StageOutput:
    """The one stage runner: stage `name` of the table with its inputs resolved (`resolve_inputs`), what its
    task held recorded under the run (pipeline.ops.usage; nothing without `rates`). `drafter run`, every
    `drafter <stage>` and the scheduler's tasks (pipeline.tasks.run_stage_task) run stages through it."""
    from pipeline.ops.usage import metered

    entry = stage(name)
    validate_id(run_id, "run id")
    inputs = resolve_inputs(entry, config, store, run_id, snapshot or run_id, given)
    with metered(store, run_id, name, name, rates):
        return entry.run(config, inputs, run_id, store)
