"""An image as its Dockerfile builds it, made on this machine without a Docker engine: the files its COPY
lines put under its WORKDIR (and nothing else of the repository), and the project installed as its `pip
install` lines install it (from those copied files, not editable) into a Python environment of its own.

What decides whether a pod of the built image works, and how each is modelled here:
- the files present: only the COPY lines' sources, at their destinations (Docker's rules: a directory's
  contents are copied into the destination; a destination ending in `/` or one of several sources is a
  directory); a path the code reads that no COPY line brings is missing in the pod, as in the image;
- where the code finds its own files: the package is installed into the environment's site-packages, so
  `pipeline.config_base.PROJECT_ROOT` is what it is in the image (DRAFTER_HOME, else site-packages);
- the environment: a virtualenv of its own whose site-packages hold the installed project first; the
  third-party packages the Dockerfile's pip installs come from this machine's `.venv` (one directory on
  the path, its .pth files not run, so the checkout's editable install of the project is not seen), and
  their console scripts (torchrun, deepspeed) are in the environment's bin, run by its Python, as pip
  puts them there;
- an image whose Dockerfile installs the project editable (`pip install -e`) is refused: its pods would run
  the build context, which no registry holds.

Not modelled: the base image's own files (the container's system directories are this machine's) and
versions the Dockerfile pins differently from `.venv` (docker/sglang.Dockerfile's torch; issue-tracked).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEPENDENCIES = PROJECT_ROOT / ".venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
# copied trees leave out what a build context's .dockerignore leaves out
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache", ".pytest_cache")


class ImageBuildFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]  # relative to the build context (the repository root)
    destination: str  # absolute, in the image


@dataclass(frozen=True)
class DockerfileSteps:
    workdir: str  # the last WORKDIR: the image's working directory, where the project is installed from
    copies: tuple[Copy, ...]
    installs_project: bool  # a `pip install` of the build context's project (`.` or `.[extras]`)
    env: dict[str, str]  # its ENV lines


@dataclass(frozen=True)
class BuiltImage:
    """`files`: path in the container -> path here, for LocalImage; `bin`: the environment's scripts;
    `steps`: what its Dockerfile says (its ENV, its WORKDIR)."""

    files: dict[str, str]
    venv: Path
    steps: DockerfileSteps

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def make_mount_points(self, extra_files: dict[str, str]) -> None:
        """Empty directories (or files) where `extra_files` land inside this image's read-only trees, which a
        container cannot create once they are mounted."""
        for inside, host in extra_files.items():
            for mounted, source in self.files.items():
                if PurePosixPath(inside).is_relative_to(mounted) and inside != mounted:
                    point = Path(source) / PurePosixPath(inside).relative_to(mounted)
                    if Path(host).is_dir():
                        point.mkdir(parents=True, exist_ok=True)
                    else:
                        point.parent.mkdir(parents=True, exist_ok=True)
                        point.touch()


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _commands(run: str) -> list[list[str]]:
    """The words of each command of a RUN line's shell form, split at `&&`, `||` and `;` outside quotes."""
    commands: list[list[str]] = [[]]
    lexer = shlex.shlex(run, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    for word in lexer:
        if word in {"&&", "||", ";", "|"}:
            commands.append([])
        else:
            commands[-1].append(word)
    return [words for words in commands if words]


def read_steps(dockerfile: Path) -> DockerfileSteps:
    """The WORKDIR, COPY and project-install steps of `dockerfile`, in order."""
    workdir, copies, installs, env = "/", [], False, {}
    for keyword, rest in _instructions(dockerfile.read_text()):
        if keyword == "ENV":
            words = shlex.split(rest)
            pairs = [word.partition("=") for word in words]
            if all(sep for _, sep, _ in pairs):
                env.update({key: value for key, _, value in pairs})
            else:  # the legacy form: ENV KEY value
                env[words[0]] = " ".join(words[1:])
        elif keyword == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / rest)
        elif keyword == "COPY":
            words = [word for word in shlex.split(rest) if not word.startswith("--")]
            if len(words) < 2:
                raise ImageBuildFailed(f"{dockerfile.name}: COPY {rest!r} names no destination")
            *sources, destination = words
            target = PurePosixPath(workdir) / destination
            directory = destination.endswith("/") or len(sources) > 1
            copies.append(Copy(tuple(sources), str(target) + ("/" if directory else "")))
        elif keyword == "RUN":
            for words in _commands(rest):
                command = " ".join(words)
                if "pip" in " ".join(words[:3]) and "install" in words:
                    if "-e" in words or "--editable" in words:
                        raise ImageBuildFailed(f"{dockerfile.name} installs the project editable: {command}")
                    installs |= any(word == "." or word.startswith(".[") for word in words)
    return DockerfileSteps(workdir, tuple(copies), installs, env)


def _copy(source: Path, destination: Path, into_directory: bool) -> None:
    if not source.exists():
        raise ImageBuildFailed(f"COPY {source.relative_to(PROJECT_ROOT)}: not in the build context")
    if source.is_dir():
        shutil.copytree(source, destination, ignore=IGNORED, dirs_exist_ok=True)
        return
    target = destination / source.name if into_directory else destination
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)


def _environment(venv: Path) -> None:
    """A virtualenv without pip whose site-packages end with `.venv`'s (the third-party packages)."""
    base_python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(base_python), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / DEPENDENCIES.name / "site-packages"
    (site / "image-dependencies.pth").write_text(f"{DEPENDENCIES / 'site-packages'}\n")


def _dependency_scripts(venv: Path) -> None:
    """The console scripts of the third-party packages (torchrun, deepspeed, airflow), as their installs put
    them in the image's environment's bin: `.venv`'s, each run by the image's own Python. The project's
    own scripts come from its install."""
    source = DEPENDENCIES.parents[1] / "bin"
    python = venv / "bin" / "python"
    for script in sorted(source.iterdir()):
        target = venv / "bin" / script.name
        if target.exists() or not script.is_file() or script.is_symlink():
            continue
        text = script.read_bytes()
        first, _, rest = text.partition(b"\n")
        if not first.startswith(b"#!") or b"python" not in first:
            continue
        target.write_bytes(b"#!" + str(python).encode() + b"\n" + rest)
        target.chmod(0o755)


def build(name: str, into: Path, dockerfile: Path | None = None) -> BuiltImage:
    """docker/<name>.Dockerfile's (or `dockerfile`'s) files under `into`/root and its project installed into
    `into`/venv (mounted at their own paths: a virtualenv's scripts name its interpreter by absolute path)."""
    dockerfile = dockerfile or PROJECT_ROOT / "docker" / f"{name}.Dockerfile"
    steps = read_steps(dockerfile)
    root, venv = into / "root", into / "venv"
    shutil.rmtree(into, ignore_errors=True)
    root.mkdir(parents=True)
    (root / steps.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
    mounts = {steps.workdir}  # the WORKDIR, and each destination outside it (COPY dags /opt/airflow/dags)
    for copy in steps.copies:
        destination = root / copy.destination.lstrip("/")
        into_directory = copy.destination.endswith("/")
        for source in copy.sources:
            _copy(PROJECT_ROOT / source, destination, into_directory)
        if not PurePosixPath(copy.destination).is_relative_to(steps.workdir):
            mounts.add(copy.destination.rstrip("/"))
    _environment(venv)
    if steps.installs_project:
        context = root / steps.workdir.lstrip("/")
        done = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
            + ["--no-index", "--disable-pip-version-check", str(context)],
            capture_output=True,
            text=True,
            cwd=into,
        )
        if done.returncode != 0:
            raise ImageBuildFailed(f"{dockerfile.name}: pip install of {context}: {done.stderr[-2000:]}")
    _dependency_scripts(venv)
    files = {inside: str(root / inside.lstrip("/")) for inside in sorted(mounts)}
    files[str(venv)] = str(venv)
    files[str(DEPENDENCIES)] = str(DEPENDENCIES)
    return BuiltImage(files, venv, steps)
