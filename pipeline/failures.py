"""The one table from a failure to its exit code, and how a task process reports it to its scheduler.

`drafter run`, every `drafter <stage>` subcommand and every task pod end a failure with `exit_code_for`:

    1  anything a retry may fix: servers down, throttling, a preempted node, a failed stage
    2  bad input no retry can fix: a config, capture contract, id, parity check, target, checkpoint, a
       malformed file or record (a ValueError), a Kubernetes request refused for good
    3  a rejected candidate: the gate failed, or the promotion was refused (slower, not measurably faster,
       an acceptance that differs from the reference decoder's)
    4  an inconclusive benchmark: it could not tell whether the candidate is faster; nothing promoted

Codes 2-4 fail the same way however often they are retried, so schedulers fail them at once and retry only
what can pass on a second try. A task that runs as its own process (a Kubernetes pod) says which kind it
was through its exit code (`report_permanent_failures_by_exit_code`).
"""

from __future__ import annotations

import os
import sys

from pipeline.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_GATE,
    EXIT_INCONCLUSIVE,
    PERMANENT_EXIT_CODES,
    POD_EXIT_CODES_ENV,
)


def failure_table() -> tuple[tuple[tuple[type[BaseException], ...], int], ...]:
    """Each kind of failure and its exit code, the first row that matches wins; anything else is
    EXIT_FAILED. (The types are imported here, when a failure is looked up, not when a task module loads.)"""
    from pipeline.config import ConfigError
    from pipeline.data.capture_contract import ContractMismatch
    from pipeline.engines.parity import ParityFailed
    from pipeline.engines.target import TargetError
    from pipeline.ids import InvalidIdError
    from pipeline.promotion import BenchmarkInconclusive, GateFailed, PromotionRefused
    from pipeline.training.checkpoint_digests import CheckpointRefused

    return (
        ((BenchmarkInconclusive,), EXIT_INCONCLUSIVE),
        ((GateFailed, PromotionRefused), EXIT_GATE),
        (
            (ConfigError, ContractMismatch, InvalidIdError, ParityFailed, TargetError, CheckpointRefused),
            EXIT_BAD_INPUT,
        ),
        # malformed files or records handed in (pydantic's ValidationError, JSON, encodings): the message
        # names the problem
        ((ValueError,), EXIT_BAD_INPUT),
    )


def exit_code_for(error: BaseException) -> int:
    """The exit code of a failure: its row of `failure_table`, a Kubernetes request refused for good (RBAC,
    no such object) as bad input, else EXIT_FAILED."""
    for kinds, code in failure_table():
        if isinstance(error, kinds):
            return code
    from pipeline.ops.kube_api import KubernetesApiError

    if isinstance(error, KubernetesApiError) and not error.transient:
        return EXIT_BAD_INPUT
    return EXIT_FAILED


def is_permanent(error: BaseException) -> bool:
    return exit_code_for(error) in PERMANENT_EXIT_CODES


def report_permanent_failures_by_exit_code() -> None:
    """In a task process whose scheduler reads exit codes (a pod: the deployment sets
    DRAFTER_PERMANENT_EXIT_CODES=1), end an uncaught failure with its exit code (`exit_code_for`) instead of
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
