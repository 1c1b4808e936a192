"""Which failures a retry cannot fix, and how a task process reports them to its scheduler.

A bad config, a capture-contract mismatch, a failed parity check, a rejected gate, a refused
promotion or a promotion an inconclusive benchmark stopped (its stored record decides) fail the same way
however often they are retried, so schedulers fail them at once and retry only what can pass on a
second try (servers down, throttling, a preempted node). A task that runs as its own process (a
Kubernetes pod) says which kind it was through its exit code.
"""

from __future__ import annotations

import os
import sys

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_GATE = 3
# the benchmark could not tell whether the candidate is faster: nothing promoted, and not a refusal
EXIT_INCONCLUSIVE = 4
PERMANENT_EXIT_CODES = frozenset({EXIT_BAD_INPUT, EXIT_GATE, EXIT_INCONCLUSIVE})
POD_EXIT_CODES_ENV = "DRAFTER_PERMANENT_EXIT_CODES"


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from pipeline.config import ConfigError
    from pipeline.data.capture_contract import ContractMismatch
    from pipeline.engines.parity import ParityFailed
    from pipeline.engines.target import TargetError
    from pipeline.ids import InvalidIdError
    from pipeline.training.checkpoint_digests import CheckpointRefused

    return ConfigError, ContractMismatch, InvalidIdError, ParityFailed, TargetError, CheckpointRefused


def _rejection_types() -> tuple[type[BaseException], ...]:
    from pipeline.stages.gate import GateFailed
    from pipeline.stages.promote import PromotionRefused

    return GateFailed, PromotionRefused


def exit_code_for(error: BaseException) -> int:
    """EXIT_BAD_INPUT for input no retry can fix, EXIT_GATE for a rejected candidate, EXIT_INCONCLUSIVE for
    a benchmark that could not tell, else EXIT_FAILED."""
    from pipeline.stages.promote import BenchmarkInconclusive

    if isinstance(error, BenchmarkInconclusive):
        return EXIT_INCONCLUSIVE
    if isinstance(error, _rejection_types()):
        return EXIT_GATE
    if isinstance(error, _bad_input_types()):
        return EXIT_BAD_INPUT
    from pipeline.ops.kube_api import KubernetesApiError

    if isinstance(error, KubernetesApiError) and not error.transient:  # RBAC refused, no such object
        return EXIT_BAD_INPUT
    return EXIT_FAILED


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


def is_permanent(error: BaseException) -> bool:
    return exit_code_for(error) in PERMANENT_EXIT_CODES


def report_permanent_failures_by_exit_code() -> None:
    """In a task process whose scheduler reads exit codes (a pod: the deployment sets
    DRAFTER_PERMANENT_EXIT_CODES=1), end an uncaught permanent failure with its exit code instead of
    Python's 1, after printing the traceback as usual."""
    if os.environ.get(POD_EXIT_CODES_ENV) != "1":
        return
    previous = sys.excepthook

    def hook(kind, error, traceback) -> None:
        previous(kind, error, traceback)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(exit_code_for(error))

    sys.excepthook = hook
