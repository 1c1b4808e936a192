"""The exit codes a failed `drafter` command or task pod ends with, and what each says to a scheduler. Which
failure gets which: pipeline.failures (the one table)."""

from __future__ import annotations

EXIT_FAILED = 1  # a retry may fix it
EXIT_BAD_INPUT = 2
EXIT_GATE = 3  # a rejected candidate: the gate, or a refused promotion
# the benchmark could not tell whether the candidate is faster: nothing promoted, and not a refusal
EXIT_INCONCLUSIVE = 4
PERMANENT_EXIT_CODES = frozenset({EXIT_BAD_INPUT, EXIT_GATE, EXIT_INCONCLUSIVE})
# set to 1 on task pods (pipeline.ops.deployment): their failures end with these codes, not Python's 1
POD_EXIT_CODES_ENV = "DRAFTER_PERMANENT_EXIT_CODES"


def exit_code_meaning(code: int) -> str:
    """What a task process's exit code says about its failure (for a scheduler's message)."""
    if code == EXIT_BAD_INPUT:
        return "bad input (a config, capture contract, id, parity check or target that no retry can fix)"
    if code == EXIT_GATE:
        return "a rejected candidate (the gate, or a refused promotion)"
    if code == EXIT_INCONCLUSIVE:
        return (
            "an inconclusive benchmark (it could not tell whether the candidate is faster; nothing "
            "promoted: rerun on a quiet machine or with a larger benchmark budget)"
        )
    return "a failure a retry may fix"
