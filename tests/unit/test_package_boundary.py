"""What ships is `pipeline/` (and the triggers the triggerer imports): none of its modules imports the
harness, the test servers or the DAG files, and the harness's cluster modules import each other one way."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

SHIPPED = ("pipeline", "drafter_triggers")
# the harness, what the tests start (moto's S3 server, the SMTP sink's aiosmtpd) and the DAG files' modules
NEVER_IMPORTED = {
    "harness",
    "tests",
    "moto",
    "aiosmtpd",
    *(path.stem for path in (REPO / "dags").glob("*.py")),
}


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of the file names (absolute imports; relative ones stay inside)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def shipped_files() -> list[Path]:
    return sorted(path for package in SHIPPED for path in (REPO / package).rglob("*.py"))


def test_no_shipped_module_imports_the_harness_the_test_servers_or_the_dags():
    files = shipped_files()
    assert len(files) > 50  # the whole package was read
    offending = {
        str(path.relative_to(REPO)): sorted(
            name for name in imported_modules(path) if name.split(".")[0] in NEVER_IMPORTED
        )
        for path in files
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_package_holds_no_harness_folder():
    assert not (REPO / "pipeline" / "dev").exists()
    assert (REPO / "harness" / "__init__.py").is_file()


def test_the_cluster_api_does_not_import_the_cluster_it_serves():
    imports = imported_modules(REPO / "harness" / "cluster_api.py")
    assert "harness.cluster" not in imports
    assert "harness.cluster_api" in imported_modules(REPO / "harness" / "cluster.py")
