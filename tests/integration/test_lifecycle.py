"""Server lifecycle under Snakemake with real vLLM: failures, --keep-going, Ctrl-C, SIGTERM, SIGKILL.

After every scenario the whole server process tree (API server, engine core,
workers: one process group) must be gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import REPO, copy_workflow, leftovers, snakemake, write_yaml

pytestmark = [pytest.mark.vllm, pytest.mark.pipeline]


def demo_config(**workloads) -> dict:  # type: ignore[no-untyped-def]
    raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw["workloads"] = workloads
    raw["operations"]["shutdown_timeout_s"] = 15
    return raw


def wait_for(predicate, timeout: float, step: float = 0.5) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


@pytest.fixture
def workdir(tmp_path):  # type: ignore[no-untyped-def]
    path = copy_workflow(tmp_path / "wf")
    yield path
    # Whatever a failed assertion left behind must not outlive the test.
    for pid in leftovers(path):
        os.kill(pid, signal.SIGKILL)


def test_keep_going_past_a_broken_server_and_a_failed_cell(workdir):
    raw = demo_config(decode={"contexts": [256, 9000], "concurrency": [1], "output_tokens": 16})
    raw["configurations"] = {
        "broken": {"label": "broken", "prefix_caching": True, "args": ["--no-such-flag"]},
        "prefix_cache": raw["configurations"]["prefix_cache"],
    }
    write_yaml(workdir / "kg.yaml", raw)
    result = snakemake(workdir, "--cores", "1", "--keep-going", "report", "--configfile", "kg.yaml")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    cells = workdir / "results" / "cells"
    # The healthy configuration still ran; the 9000-token cell exceeds max-model-len 8192: every request failed.
    assert (cells / "prefix_cache" / "decode" / "ctx256_c1.parquet").exists()
    assert not (cells / "prefix_cache" / "decode" / "ctx9000_c1.parquet").exists()
    assert not list(cells.glob("broken/**/*.parquet"))
    first_log = (workdir / "results/logs/cells/broken/decode/ctx256_c1.log").read_text()
    second_log = (workdir / "results/logs/cells/broken/decode/ctx9000_c1.log").read_text()
    assert "exited during start-up" in first_log
    assert "unrecognized arguments: --no-such-flag" in first_log  # the server log's tail
    assert "results/servers/broken/logs/" in first_log
    seconds = float(re.search(r"after ([\d.]+) s\)", first_log)[1])
    assert seconds < 60
    assert "failed earlier in this run, not retried" in second_log
    too_long_log = (workdir / "results/logs/cells/prefix_cache/decode/ctx9000_c1.log").read_text()
    assert "all 1 measured requests failed; the first: HTTP 400" in too_long_log
    assert "Error in rule cell" in output
    assert wait_for(lambda: not leftovers(workdir), 30)


def test_a_server_that_is_not_healthy_in_time_is_stopped(workdir):
    raw = demo_config(decode={"contexts": [256], "concurrency": [1], "output_tokens": 16})
    raw["operations"]["startup_timeout_s"] = 3
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    write_yaml(workdir / "slow.yaml", raw)
    result = snakemake(workdir, "--cores", "1", "report", "--configfile", "slow.yaml")
    assert result.returncode != 0
    log = (workdir / "results/logs/cells/prefix_cache/decode/ctx256_c1.log").read_text()
    assert "did not become healthy within 3 s (operations.startup_timeout_s); it was stopped" in log
    assert wait_for(lambda: not leftovers(workdir), 30)


def long_running(workdir: Path) -> list[str]:
    raw = demo_config(decode={"contexts": [256], "concurrency": [1], "output_tokens": 64, "requests_per_session": 500})
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    write_yaml(workdir / "long.yaml", raw)
    return [sys.executable, "-m", "snakemake", "--cores", "1", "report", "--configfile", "long.yaml"]


def start_and_wait_for_measuring(workdir: Path) -> subprocess.Popen:
    """Snakemake in its own session (as in a terminal), returned once a cell measures on a live server."""
    with open(workdir / "snakemake.out", "wb") as out:  # a file, not a pipe that could fill up and block
        proc = subprocess.Popen(
            long_running(workdir), cwd=workdir, start_new_session=True, stdout=out, stderr=subprocess.STDOUT
        )
    cell_log = workdir / "results/logs/cells/prefix_cache/decode/ctx256_c1.log"
    assert wait_for(lambda: cell_log.exists() and " on http://" in cell_log.read_text(), 600), "no cell started"
    assert leftovers(workdir), "no live server"
    return proc


@pytest.mark.parametrize(
    ("how", "sig"),
    [("ctrl-c", signal.SIGINT), ("kill", signal.SIGTERM), ("kill -9", signal.SIGKILL)],
)
def test_no_server_outlives_snakemake(workdir, how, sig):
    proc = start_and_wait_for_measuring(workdir)
    try:
        if how == "ctrl-c":
            os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole foreground group
        else:
            os.kill(proc.pid, sig)  # only Snakemake itself
        proc.wait(timeout=120)
        # SIGKILL leaves no onerror handler: the supervisor must notice its owner is gone.
        assert wait_for(lambda: not leftovers(workdir), 45), f"server still running after {how}"
        assert not (workdir / "results/cells/prefix_cache/decode/ctx256_c1.parquet").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the orphaned cell job after kill -9
