"""Each image as its Dockerfile builds it (harness/image_build.py: the COPY lines' files, the project
installed non-editable into an environment of its own) does what its pods do with the project's files:
configure prices a Kimi-K2.5 run (reading the node Job's GPUs from train.kubernetes_job), the train stage's
pod loads that Job, a trainer node reads its DeepSpeed config. Run from the image's WORKDIR with the
Dockerfile's DRAFTER_HOME, as a pod runs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness.image_build import ImageBuildFailed, build, read_steps
from tests.conftest import REPO

KIMI = "configs/kimi-k2.5.yaml"
DEPLOYMENT = "configs/deployment/kubernetes.yaml"

CONFIGURE = f"""
import json, pipeline
from pipeline.ops.deployment import load_deployment
from pipeline.tasks import configure_run
deployment = load_deployment({DEPLOYMENT!r})
overrides = ["train.launcher=kubernetes", "train.nodes=2"]
plan = {{"config_path": {KIMI!r}, "overrides": overrides, "run_id": "r1"}}
run = configure_run(plan, None, deployment.usage_table())
print(json.dumps({{"package": pipeline.__file__, "train_gpus": run["rates"]["gpus"]["train"]}}))
"""

TRAIN_POD = f"""
import json
from pipeline.config import load_config
from pipeline.training.nodes import load_job_manifest, node_gpus
from pipeline.config_base import resolve_project_path
config = load_config({KIMI!r})
job = load_job_manifest(config.train.kubernetes_job)
deepspeed = json.loads(resolve_project_path(config.train.deepspeed_config).read_text())
print(json.dumps({{"node_gpus": node_gpus(job), "deepspeed_keys": len(deepspeed)}}))
"""


def _run_in(image_dir: Path, name: str, script: str) -> subprocess.CompletedProcess:
    image = build(name, image_dir)
    workdir = image.files[image.steps.workdir]
    env = {"PATH": f"{image.bin}:/usr/bin:/bin", "HOME": str(image_dir), "HF_HUB_OFFLINE": "1"}
    if "DRAFTER_HOME" in image.steps.env:  # the image's path, as this machine holds it
        env["DRAFTER_HOME"] = str(
            Path(workdir) / Path(image.steps.env["DRAFTER_HOME"]).relative_to(image.steps.workdir)
        )
    # a file, as @task.kubernetes runs its task (`python -c` would put the WORKDIR's copy first on sys.path)
    task = image_dir / "task.py"
    task.write_text(script)
    return subprocess.run(
        [str(image.bin / "python"), str(task)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_dockerfile_installs_the_project_from_its_copied_files_and_sets_drafter_home():
    for dockerfile in sorted((REPO / "docker").glob("*.Dockerfile")):
        steps = read_steps(dockerfile)
        assert steps.installs_project, dockerfile.name
        assert steps.env.get("DRAFTER_HOME") == steps.workdir, dockerfile.name


def test_the_pipeline_image_configures_a_multi_node_kimi_run(tmp_path):
    """configure runs in the pipeline image: with train.launcher kubernetes it reads the node pods' Job for
    their GPUs. Before the image copied infra/k8s/trainer-workers.yaml this was a FileNotFoundError under
    site-packages."""
    out = _run_in(tmp_path / "pipeline", "pipeline", CONFIGURE)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "/site-packages/pipeline/" in result["package"]  # the installed package, not the checkout
    assert result["train_gpus"] == 2 * 8


@pytest.mark.parametrize("name", ["pipeline", "trainer"])
def test_the_images_that_run_training_hold_its_job_and_deepspeed_config(tmp_path, name):
    out = _run_in(tmp_path / name, name, TRAIN_POD)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["node_gpus"] == 8 and result["deepspeed_keys"] > 0


def test_an_image_without_the_job_manifest_fails_with_where_it_looked(tmp_path):
    """The SGLang image copies no infra/: the train stage's manifest is refused there by name, not with
    a traceback from a path under site-packages."""
    out = _run_in(tmp_path / "sglang", "sglang", TRAIN_POD)
    assert out.returncode != 0
    assert "train.kubernetes_job infra/k8s/trainer-workers.yaml: no file at" in out.stderr
    assert "DRAFTER_HOME=" in out.stderr


def test_an_editable_install_or_a_missing_source_is_refused(tmp_path):
    editable = tmp_path / "editable.Dockerfile"
    editable.write_text("FROM python:3.11\nWORKDIR /app\nCOPY pipeline ./pipeline\nRUN pip install -e .\n")
    with pytest.raises(ImageBuildFailed, match="editable"):
        read_steps(editable)
    missing = tmp_path / "missing.Dockerfile"
    missing.write_text("FROM python:3.11\nWORKDIR /app\nCOPY infra/k8s/no-such.yaml ./infra/\n")
    with pytest.raises(ImageBuildFailed, match="infra/k8s/no-such.yaml: not in the build context"):
        build("missing", tmp_path / "image", missing)


def test_the_node_jobs_torchrun_is_on_the_trainer_images_path_and_runs_its_python(tmp_path):
    """The node Job runs `torchrun` by name: the trainer image's PATH must hold it (pip puts torch's console
    scripts in the image's environment), and it must run the image's Python, which imports the project as
    installed there, not the checkout."""
    import yaml

    job = yaml.safe_load((REPO / "infra/k8s/trainer-workers.yaml").read_text())
    command = job["spec"]["template"]["spec"]["containers"][0]["command"][0]
    image = build("trainer", tmp_path / "trainer")
    script = image.bin / command
    assert script.is_file(), f"{command} is not in the trainer image's {image.bin}"
    assert script.read_text().splitlines()[0] == f"#!{image.bin / 'python'}"
    done = subprocess.run(
        [str(script), "--help"],
        env={"PATH": f"{image.bin}:/usr/bin:/bin", "HOME": str(tmp_path)},
        cwd=image.files[image.steps.workdir],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "--nnodes" in done.stdout, done.stderr[-2000:]
