"""benchmarks/suite_cpu.py: per-module wall and CPU seconds from what its plugin recorded."""

from __future__ import annotations

import json

from benchmarks.suite_cpu import main, module_table, process_tree_cpu_s


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_tests_are_summed_per_module_over_every_worker_largest_wall_first(tmp_path, capsys):
    _write(
        tmp_path / "gw0.jsonl",
        [
            {"test": "tests/a.py::one", "wall_s": 10.0, "cpu_s": 2.0},
            {"test": "tests/b.py::one", "wall_s": 3.0, "cpu_s": 3.0},
        ],
    )
    _write(tmp_path / "gw1.jsonl", [{"test": "tests/b.py::two[x]", "wall_s": 9.0, "cpu_s": 12.0}])
    assert module_table(tmp_path) == [("tests/b.py", 12.0, 15.0), ("tests/a.py", 10.0, 2.0)]
    assert main([str(tmp_path), "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "all 2 modules: wall_s=22 cpu_s=17 cpu_per_wall=0.77",
        "tests/b.py: wall_s=12 cpu_s=15 cpu_per_wall=1.25",
    ]


def test_nothing_recorded_is_an_error(tmp_path):
    assert main([str(tmp_path)]) == 1


def test_the_process_cpu_clock_counts_this_process_working():
    """Work moves the clock: a fixed amount of it (about 0.2 s of one core here) is counted, however much of
    the machine other processes take."""
    before = process_tree_cpu_s()
    for _ in range(200):
        sum(range(100_000))
    assert process_tree_cpu_s() > before
