"""The fault-injection suite: each fault provoked for real, four checks each (see helpers.faults).

Where the fault is the server's, the server is real vLLM (CPU build); where it is the wire's or the
host's, the calibration server stands in for the engine *process* (it answers in vLLM's dialect), since
what is checked there is servegrid's own handling. Every test records its time to a clear error; the
table is printed at the end of the run and written to results/fault-matrix.md (helpers.fault_matrix), from which the
fault matrix of docs/reliability.md is copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import copy_workflow
from helpers.fault_matrix import MATRIX
from helpers.faults import Matrix, calibration_config, kill_survivors, vllm_config

__all__ = ["calibration_config", "vllm_config"]  # the grids the fault tests start from (helpers.faults)


@pytest.fixture(scope="session")
def matrix() -> Matrix:
    return MATRIX


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A copy of the workflow to run Snakemake in; whatever a failed assertion left running is killed."""
    path = copy_workflow(tmp_path / "wf")
    yield path
    kill_survivors(path)
