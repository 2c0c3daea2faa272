"""The fault-injection suite: each fault provoked for real, four checks each (see helpers.faults).

Where the fault is the server's, the server is real vLLM (CPU build); where it is the wire's or the
host's, the calibration server stands in for the engine *process* (it answers in vLLM's dialect), since
what is checked there is servegrid's own handling. Every test records its time to a clear error; the
table is printed at the end of the run and written to results/fault-matrix.md, from which the README's
"How reliable is it?" table is copied.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import REPO, copy_workflow, free_port_range
from helpers.faults import Matrix, kill_survivors

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


def vllm_config(**workloads: Any) -> dict[str, Any]:
    """The CPU demo's config with one configuration (prefix caching) and the given workloads."""
    raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    raw["workloads"] = workloads or {
        "decode": {"contexts": [256], "concurrency": [1], "output_tokens": 16, "requests_per_session": 2}
    }
    raw["operations"]["shutdown_timeout_s"] = 10
    raw["operations"]["port_range"] = list(free_port_range(40))
    return raw


def calibration_config(*server_args: str, **workloads: Any) -> dict[str, Any]:
    """A one-configuration grid served by the calibration server in vLLM's dialect (fast, no model)."""
    return {
        "experiment": {"title": "fault suite"},
        "model": {"path": "none", "served_name": "calibration"},
        "engine": {"command": [sys.executable, "-m", "servegrid.testing.calibration", "--model", "{model}"]},
        "configurations": {"only": {"label": "only", "prefix_caching": True, "args": list(server_args)}},
        "workloads": workloads
        or {"decode": {"contexts": [32, 64], "concurrency": [2], "output_tokens": 8, "requests_per_session": 2}},
        "operations": {
            "port_range": list(free_port_range(40)),
            "startup_timeout_s": 60,
            "shutdown_timeout_s": 5,
            "request_timeout_s": 120,
        },
    }
