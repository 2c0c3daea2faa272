"""The fault-injection suite: each fault provoked for real, four checks each (see helpers.faults).

Where the fault is the server's, the server is real vLLM (CPU build); where it is the wire's or the
host's, the calibration server stands in for the engine *process* (it answers in vLLM's dialect), since
what is checked there is servegrid's own handling. Every test records its time to a clear error; the
table is printed at the end of the run and written to results/fault-matrix.md, from which the fault matrix of
docs/reliability.md is copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import REPO, copy_workflow
from helpers.faults import Matrix, calibration_config, kill_survivors, vllm_config

__all__ = ["calibration_config", "vllm_config"]  # the grids the fault tests start from (helpers.faults)

MATRIX = Matrix()
MATRIX_FILE = REPO / "results" / "fault-matrix.md"


@pytest.fixture(scope="session")
def matrix() -> Matrix:
    return MATRIX


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not MATRIX.rows:
        return
    table = MATRIX.markdown()
    MATRIX_FILE.parent.mkdir(parents=True, exist_ok=True)
    MATRIX_FILE.write_text(table, encoding="utf-8")
    terminalreporter.write_sep("=", f"fault matrix (also in {MATRIX_FILE.relative_to(REPO)})")
    terminalreporter.write(table)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A copy of the workflow to run Snakemake in; whatever a failed assertion left running is killed."""
    path = copy_workflow(tmp_path / "wf")
    yield path
    kill_survivors(path)
