"""Training curves in the trackers users already run, written by rank 0 while the run trains.

- TensorBoard: event files written by torch's SummaryWriter in the work dir's `tensorboard/`, copied to
  `<run>/train/tensorboard/` every `tracking.upload_every_s` and when training ends, so
  `aws s3 sync` of that prefix and `tensorboard --logdir` show a run that is still going. A resumed
  attempt writes a file of its own that purges the steps it redoes.
- MLflow (`tracking.mlflow_uri`): the same scalars through MLflow's client, in one MLflow run per pipeline
  run, found again by its tag (a resumed attempt continues it). The train stage opens it before any node
  starts, so an unreachable server fails the stage at once (`open_mlflow_run`); a failure once training
  is under way is logged and training goes on. MLflow's own variables set its retries and credentials
  (MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_TRACKING_TOKEN, ...).

Each metrics.jsonl record becomes scalars at its global step: loss, conditional accuracy per TTT step,
simulated acceptance, learning rate and throughput per logging interval; the same per epoch, on
training and held-out data.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from pipeline.config import TrackingConfig
from pipeline.storage import ObjectStore

log = logging.getLogger("drafter.tracking")

TENSORBOARD_DIR = "tensorboard"
TRACKING_FILE = "tracking.json"  # where the trackers are, for the train manifest and the report
RUN_TAG = "drafter.run_id"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics.jsonl record, by TensorBoard tag."""
    kind = record["kind"]
    group = "train" if kind == "interval" else "epoch"
    values = _summary_scalars(group, record)
    if kind == "interval":
        values["train/lr"] = float(record["lr"])
        if record.get("tokens_per_s") is not None:
            values["train/tokens_per_s"] = float(record["tokens_per_s"])
    if record.get("heldout"):
        values.update(_summary_scalars("heldout", record["heldout"]))
    return values


def _summary_scalars(group: str, summary: dict[str, Any]) -> dict[str, float]:
    values = {f"{group}/tau_simulated": float(summary["tau_simulated"])}
    for name in ("loss", "cond_acc"):
        values.update({f"{group}/{name}_{k}": float(v) for k, v in enumerate(summary[name])})
    return values


class TrainingCurves:
    """Rank 0's curves (`enabled` False on other ranks: every call does nothing)."""

    def __init__(
        self,
        settings: TrackingConfig,
        workdir: Path,
        store: ObjectStore,
        prefix: str,
        run_id: str,
        resumed_at: int,
        enabled: bool,
    ):
        self.settings, self.store, self.prefix, self.enabled = settings, store, prefix, enabled
        self.directory = workdir / TENSORBOARD_DIR
        self.tracking_file = workdir / TRACKING_FILE
        self.writer = None
        self.mlflow: MlflowCurves | None = None
        self.uploaded_at = 0.0
        if not enabled:
            return
        where: dict[str, Any] = {}
        if settings.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.directory.mkdir(parents=True, exist_ok=True)
            # a resumed attempt hides the steps it redoes from the files of the attempts before it
            self.writer = SummaryWriter(
                str(self.directory), purge_step=resumed_at + 1 if resumed_at else None
            )
            where["tensorboard"] = store.uri(f"{prefix}/{TENSORBOARD_DIR}")
        if settings.mlflow_uri:
            self.mlflow = MlflowCurves(settings, run_id)
            where["mlflow"] = {"run_id": self.mlflow.run_id, "url": self.mlflow.url}
        self.tracking_file.write_text(json.dumps(where))

    def write(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl record, to every tracker."""
        if not self.enabled:
            return
        values, step = scalars(record), int(record["global_step"])
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
            if time.monotonic() - self.uploaded_at >= self.settings.upload_every_s:
                self.upload()
        if self.mlflow is not None:
            self.mlflow.log(values, step)

    def upload(self) -> None:
        """The event files as they are now, to the run's prefix. A failed copy is logged and training goes
        on: the next copy, or the train stage's when training ends, brings them up to date."""
        if self.writer is None:
            return
        self.writer.flush()
        self.uploaded_at = time.monotonic()
        try:
            for path in sorted(self.directory.glob("events.out.tfevents.*")):
                self.store.put_file(f"{self.prefix}/{TENSORBOARD_DIR}/{path.name}", path)
        except Exception as err:
            log.warning(
                "the TensorBoard event files were not copied to %s (training goes on): %s", self.prefix, err
            )

    def close(self, status: str = "FINISHED") -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            self.upload()
            self.writer.close()
            self.writer = None
        if self.mlflow is not None:
            self.mlflow.end(status)
            self.mlflow = None


class TrackingUnavailable(RuntimeError):
    pass


def open_mlflow_run(settings: TrackingConfig, run_id: str) -> tuple[Any, str, str]:
    """MLflow's client, and the experiment id and MLflow run id of this pipeline run (made on first use);
    TrackingUnavailable when the server does not answer."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as err:
        raise TrackingUnavailable("tracking.mlflow_uri is set, but MLflow's client is not installed") from err
    client = MlflowClient(tracking_uri=settings.mlflow_uri)
    try:
        experiment = client.get_experiment_by_name(settings.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(settings.mlflow_experiment)
        )
        earlier = client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1
        )
        if earlier:
            return client, experiment_id, earlier[0].info.run_id
        run = client.create_run(experiment_id, run_name=run_id, tags={RUN_TAG: run_id})
    except Exception as err:
        raise TrackingUnavailable(
            f"the MLflow tracking server {settings.mlflow_uri} (tracking.mlflow_uri) did not answer: {err}"
        ) from err
    return client, experiment_id, run.info.run_id


class MlflowCurves:
    """The scalars of one pipeline run, in its MLflow run."""

    def __init__(self, settings: TrackingConfig, run_id: str):
        self.client, experiment_id, self.run_id = open_mlflow_run(settings, run_id)
        uri = (settings.mlflow_uri or "").rstrip("/")
        self.url = f"{uri}/#/experiments/{experiment_id}/runs/{self.run_id}"
        self.failed = False
        log.info("training curves go to MLflow run %s", self.url)

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(tag, value, stamp, step) for tag, value in values.items()]
        try:
            self.client.log_batch(self.run_id, metrics=metrics)
        except Exception as err:  # training goes on; the curves have a gap
            if not self.failed:
                log.warning("MLflow did not take the metrics at step %d (training goes on): %s", step, err)
            self.failed = True
        else:
            self.failed = False

    def end(self, status: str) -> None:
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as err:
            log.warning("MLflow run %s was not marked %s: %s", self.run_id, status, err)
