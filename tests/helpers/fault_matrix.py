"""The fault matrix as a pytest plugin (loaded by tests/conftest.py): the rows the fault tests record, printed at the
end of the run and written to results/fault-matrix.md, from which the fault matrix of docs/reliability.md is copied.

make test runs the fault tests on two pytest-xdist workers: a row is recorded in a worker, travels to the controller on
its test's report (``user_properties``), and the controller prints the table. A plugin of tests/conftest.py, not of
tests/faults/conftest.py, because xdist's controller loads no conftest of a subfolder.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import pytest

from helpers import REPO
from helpers.faults import Matrix, Measured

MATRIX = Matrix()
MATRIX_FILE = REPO / "results" / "fault-matrix.md"
PROPERTY = "fault-matrix"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    MATRIX.fresh.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]):  # type: ignore[no-untyped-def]
    outcome = yield
    if call.when == "teardown" and MATRIX.fresh:
        rows = [asdict(row) for row in MATRIX.fresh]
        outcome.get_result().user_properties.append((PROPERTY, json.dumps(rows)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == PROPERTY:
            for row in json.loads(value):
                MATRIX.merge(Measured(**row))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not MATRIX.rows:  # an xdist worker: the controller prints
        return
    table = MATRIX.markdown()
    MATRIX_FILE.parent.mkdir(parents=True, exist_ok=True)
    MATRIX_FILE.write_text(table, encoding="utf-8")
    terminalreporter.write_sep("=", f"fault matrix (also in {MATRIX_FILE.relative_to(REPO)})")
    terminalreporter.write(table)
