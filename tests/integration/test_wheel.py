"""The wheel pyproject.toml builds holds what ships (pipeline/, drafter_triggers/) and no module of the
harness or the tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.conftest import REPO

# a copy of the checkout's sources, harness and tests included, so the build leaves nothing in the checkout
SOURCES = ("pyproject.toml", "README.md", "pipeline", "drafter_triggers", "harness", "tests", "dags")


def test_the_built_wheel_holds_the_pipeline_and_no_harness(tmp_path):
    source = tmp_path / "source"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    # no build isolation: the virtualenv's setuptools builds it, offline
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    out = subprocess.run(
        [*command, "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("drafter_pipeline-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert packages == {"pipeline", "drafter_triggers"}, sorted(packages)
    assert "pipeline/stages/train.py" in names and "pipeline/ops/templates/report.html.j2" in names
    assert not [name for name in names if "harness" in name or name.startswith("pipeline/dev/")]
