"""A run that published nothing gets a clear error from the report."""

import pytest

from pipeline.ops.report import render


def test_a_run_without_artifacts_is_refused(store):
    with pytest.raises(ValueError, match="has published nothing"):
        render(store, "never-ran", "tiny-test")
    assert store.list("runs/never-ran") == []  # nothing written for it
