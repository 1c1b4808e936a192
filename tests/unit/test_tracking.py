"""Training curves (pipeline.training.tracking): the scalars each metrics record becomes, the tracking
settings a run config refuses, and the report's links to the trackers. The trackers themselves are
exercised in tests/integration/test_trainer.py (TensorBoard's reader, a local MLflow server)."""

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.ops.report import RunRecord, render_html
from pipeline.training.tracking import scalars
from tests.conftest import storage_config, tiny_config_dict

SUMMARY = {"loss": [2.5, 3.0], "cond_acc": [0.5, 0.25], "tau_simulated": 1.6}


def test_a_records_scalars_are_its_loss_acceptance_learning_rate_and_throughput():
    interval = {"kind": "interval", "global_step": 20, "lr": 0.001, "tokens_per_s": 950.5, **SUMMARY}
    assert scalars(interval) == {
        "train/tau_simulated": 1.6,
        "train/loss_0": 2.5,
        "train/loss_1": 3.0,
        "train/cond_acc_0": 0.5,
        "train/cond_acc_1": 0.25,
        "train/lr": 0.001,
        "train/tokens_per_s": 950.5,
    }
    heldout = {"loss": [2.0, 2.5], "cond_acc": [0.6, 0.3], "tau_simulated": 1.8}
    epoch = {"kind": "epoch", "global_step": 40, "epoch": 1, **SUMMARY, "heldout": heldout}
    values = scalars(epoch)
    assert values["epoch/cond_acc_1"] == 0.25 and values["heldout/cond_acc_1"] == 0.3
    assert values["heldout/tau_simulated"] == 1.8 and "train/lr" not in values


@pytest.mark.parametrize(
    "uri, message",
    [
        ("https://alice:secret@mlflow.example.com", "must not hold credentials"),
        ("file:///tmp/mlruns", "should match pattern"),
    ],
)
def test_tracking_settings_refuse_credentials_and_non_http_servers(tmp_path, uri, message):
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(data={**data, "tracking": {"mlflow_uri": uri}})
    assert "secret" not in str(refused.value)  # the refused value is not echoed


def test_the_report_links_the_runs_training_curves():
    tracking = {
        "tensorboard": "s3://bucket/kimi/runs/r1/train/tensorboard",
        "mlflow": {"run_id": "abc", "url": "http://mlflow.example.com/#/experiments/1/runs/abc"},
    }
    page = render_html(RunRecord(run_id="r1", train={"tracking": tracking}), {}, ([], ""))
    assert "<code id=tensorboard>s3://bucket/kimi/runs/r1/train/tensorboard</code>" in page
    assert "aws s3 sync s3://bucket/kimi/runs/r1/train/tensorboard ./tensorboard/r1" in page
    assert "<a id=mlflow href='http://mlflow.example.com/#/experiments/1/runs/abc'>" in page
    untracked = render_html(RunRecord(run_id="r2", train={}), {}, ([], ""))
    assert "No tracker recorded this run's training." in untracked


def test_a_failed_copy_of_the_event_files_is_logged_and_training_goes_on(tmp_path, caplog):
    from pipeline.config import TrackingConfig
    from pipeline.training.tracking import TrainingCurves

    class Unreachable:
        def uri(self, key: str) -> str:
            return f"s3://bucket/{key}"

        def put_file(self, key, path):
            raise OSError("S3 did not answer")

    curves = TrainingCurves(TrackingConfig(), tmp_path, Unreachable(), "runs/r/train", "r", 0, True)
    curves.write({"kind": "interval", "global_step": 1, "lr": 0.1, "tokens_per_s": 1.0, **SUMMARY})
    curves.close()
    assert "were not copied to runs/r/train (training goes on): S3 did not answer" in caplog.text
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
