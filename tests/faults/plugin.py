"""The fault-injection suite's fixtures, for its modules in every tier (each marked `fault`): every case
records the fault it injected and the outcome it observed. `make faults` runs the marked modules in one
process and writes the records to docs/FAULTS.md (tests/faults/report.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.faults.proxy import FaultProxy

_records: list[dict] = []


@pytest.fixture
def record(request):
    """record(kind, fault, outcome, tried=1, lost=0, duplicated=0) after the case's assertions hold."""

    def add(kind: str, fault: str, outcome: str, tried: int = 1, lost: int = 0, duplicated: int = 0) -> None:
        _records.append(
            {
                "case": request.node.nodeid.split("::")[-1].split("[")[0],
                "kind": kind,
                "fault": fault,
                "outcome": outcome,
                "tried": tried,
                "samples_lost": lost,
                "samples_duplicated": duplicated,
            }
        )

    return add


def pytest_sessionfinish(session, exitstatus):
    """`make faults` (DRAFTER_WRITE_FAULTS_DOC=1, one process, every case passed) rewrites docs/FAULTS.md."""
    if _records and exitstatus == 0 and os.environ.get("DRAFTER_WRITE_FAULTS_DOC") == "1":
        from tests.faults.report import write_doc

        write_doc(_records, REPO / "docs" / "FAULTS.md")


@pytest.fixture
def s3_proxy(s3_endpoint):
    host, port = s3_endpoint[len("http://") :].split(":")
    proxy = FaultProxy(host, int(port)).start()
    yield proxy
    proxy.stop()


def proxied_storage(proxy: FaultProxy, tmp_path: Path) -> dict:
    import uuid

    from tests.conftest import BUCKET, TEST_CACHE

    return {
        "root": f"s3://{BUCKET}/faults-{uuid.uuid4().hex[:10]}",
        "endpoint_url": proxy.url,
        "local_cache": str(TEST_CACHE),
        "multipart_threshold_mb": 5,
        "max_attempts": 6,
    }
