"""The pipeline's requirements for the SGLang image, printed one per line (docker/sglang.Dockerfile runs
this after SGLang is installed). SGLang's environment decides every package it already holds:
- what it decides outright (the SGLANG_DECIDES names: torch, transformers, tokenizers, deepspeed) is left
  out;
- every other requirement it already has is printed by name alone, and the install runs under a
  constraints file of that environment (`pip list --format=freeze`), so its version stays. A pin of the
  pipeline's would make pip move it past a bound of one of SGLang's own dependencies (numpy did), and pip
  only warns;
- the rest are printed as pyproject.toml pins them.

    python sglang_requirements.py pyproject.toml > requirements.txt
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from importlib import metadata


def requirements(dependencies: list[str], decided: set[str], installed: set[str]) -> list[str]:
    lines = []
    for requirement in dependencies:
        name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
        key = name.lower().replace("_", "-")
        if key in decided:
            continue
        lines.append(name if key in installed else requirement)
    return lines


def main() -> None:
    with open(sys.argv[1], "rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    decided = {name.lower() for name in os.environ["SGLANG_DECIDES"].split()}
    installed = {dist.metadata["Name"].lower().replace("_", "-") for dist in metadata.distributions()}
    print("\n".join(requirements(dependencies, decided, installed)))


if __name__ == "__main__":
    main()
