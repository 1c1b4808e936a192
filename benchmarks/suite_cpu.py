"""Where the test suite's time goes: wall and CPU seconds of every test module, as a pytest plugin.

    DRAFTER_SUITE_CPU=/tmp/suite-cpu python -m pytest -p benchmarks.suite_cpu -n 2 --dist loadfile tests
    python benchmarks/suite_cpu.py /tmp/suite-cpu [--top 12]

The plugin appends one JSON line per test to <DRAFTER_SUITE_CPU>/<xdist worker>.jsonl: its wall seconds
and the CPU seconds its worker process used in that time, its reaped children's included (the stage CLIs,
torchrun ranks, servers, pods and Airflow components a test starts count when they are waited for, so a
module-scoped server counts at its module's teardown; a process nobody waits for is missed). The script
prints, per module, wall seconds, CPU seconds and their ratio (below 1: the module mostly waits), largest
wall first, after the totals over all modules. Without DRAFTER_SUITE_CPU the plugin records nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

OUT_ENV = "DRAFTER_SUITE_CPU"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_out: IO[str] | None = None


def process_tree_cpu_s() -> float:
    """This process's user and system CPU seconds, its waited-for children's included (/proc/self/stat
    fields utime, stime, cutime and cstime)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) / _CLOCK_TICKS


def _record(line: dict[str, Any]) -> None:
    global _out
    if _out is None:
        directory = Path(os.environ[OUT_ENV])
        directory.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out = open(directory / f"{worker}.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (kept open)
    _out.write(json.dumps(line) + "\n")
    _out.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not os.environ.get(OUT_ENV):
        yield
        return
    cpu, started = process_tree_cpu_s(), time.monotonic()
    yield
    _record({"test": item.nodeid, "wall_s": time.monotonic() - started, "cpu_s": process_tree_cpu_s() - cpu})


def module_table(directory: Path) -> list[tuple[str, float, float]]:
    """(module, wall seconds, CPU seconds) of every module recorded in `directory`, largest wall first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            module = totals[entry["test"].split("::")[0]]
            module[0] += entry["wall_s"]
            module[1] += entry["cpu_s"]
    return sorted(((name, wall, cpu) for name, (wall, cpu) in totals.items()), key=lambda row: -row[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help=f"what the plugin wrote ({OUT_ENV})")
    parser.add_argument("--top", type=int, default=12, help="modules listed")
    args = parser.parse_args(argv)
    rows = module_table(args.directory)
    if not rows:
        print(f"no test was recorded in {args.directory}", file=sys.stderr)
        return 1
    wall, cpu = sum(row[1] for row in rows), sum(row[2] for row in rows)
    print(f"all {len(rows)} modules: wall_s={wall:.0f} cpu_s={cpu:.0f} cpu_per_wall={cpu / wall:.2f}")
    for name, module_wall, module_cpu in rows[: args.top]:
        ratio = module_cpu / module_wall
        print(f"{name}: wall_s={module_wall:.0f} cpu_s={module_cpu:.0f} cpu_per_wall={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
