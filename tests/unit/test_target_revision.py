"""The target revision a run records (pipeline.engines.target.target_revision): a local model directory
downloaded from the Hub holds one commit, which the serving pods also pass SGLang; the config may only
name that one."""

import pytest

from pipeline.config import load_config
from pipeline.engines.target import DOWNLOAD_METADATA, TargetError, target_revision


def config(revision=None):
    target = {"name": "kimi", "source": "hf", "model_path": "/models/K"}
    if revision is not None:
        target["revision"] = revision
    return load_config(data={"storage": {"root": "/tmp/x"}, "target": target})


def test_a_downloaded_directory_records_the_commit_it_holds(tmp_path):
    assert target_revision(config(), tmp_path) is None  # made otherwise, nothing said: nothing recorded
    assert target_revision(config("r7"), tmp_path) == "r7"  # made otherwise: what the config says
    metadata = tmp_path / DOWNLOAD_METADATA
    metadata.parent.mkdir(parents=True)
    metadata.write_text('9e2c4b1d\n"etag"\n1764900000.0\n')  # as huggingface_hub writes it
    assert target_revision(config(), tmp_path) == "9e2c4b1d"
    assert target_revision(config("9e2c4b1d"), tmp_path) == "9e2c4b1d"
    with pytest.raises(TargetError, match="target.revision is 'main', but .* holds revision '9e2c4b1d'"):
        target_revision(config("main"), tmp_path)
