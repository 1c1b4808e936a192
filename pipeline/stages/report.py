"""report: what a run's stages published -> runs/<run_id>/report/, PNG plots and one self-contained
report.html (pipeline.ops.report). It reads whatever the run got to, so it also runs after a failure."""

from __future__ import annotations

from pipeline import layout
from pipeline.config import RunConfig
from pipeline.ops.report import render
from pipeline.stages import StageInputs, StageOutput
from pipeline.storage import ObjectStore


class Inputs(StageInputs):
    pass


class Output(StageOutput):
    link: str  # where a browser opens report.html (a file path, or the object's S3 address)
    outcome: str
    plots: list[str]


def run(config: RunConfig, inputs: Inputs, run_id: str, store: ObjectStore) -> Output:
    manifest = render(store, run_id, config.target.name)
    return Output(
        uri=store.uri(layout.run_stage_prefix(run_id, "report")),
        kind=manifest["kind"],
        link=manifest["link"],
        outcome=manifest["outcome"],
        plots=manifest["plots"],
    )
