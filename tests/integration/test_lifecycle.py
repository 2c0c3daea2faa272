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
    raw = demo_config(decode={"contexts": [256, 40000], "concurrency": [1], "output_tokens": 16})
    # No --max-model-len in the config, so that only the running server can tell that 40,000 tokens do not
    # fit (the tiny model's 32,768 positions); with it in the config, the config itself is refused.
    raw["engine"]["args"] = ["--load-format", "dummy"]
    raw["configurations"] = {
        "broken": {"label": "broken", "prefix_caching": True, "args": ["--no-such-flag"]},
        "prefix_cache": raw["configurations"]["prefix_cache"],
    }
    write_yaml(workdir / "kg.yaml", raw)
    result = snakemake(workdir, "--cores", "1", "--keep-going", "report", "--configfile", "kg.yaml")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    cells = workdir / "results" / "cells"
    # The healthy configuration still ran; the 40,000-token cell exceeds the server's context: refused unmeasured.
    assert (cells / "prefix_cache" / "decode" / "ctx256_c1.parquet").exists()
    assert not (cells / "prefix_cache" / "decode" / "ctx40000_c1.parquet").exists()
    assert not list(cells.glob("broken/**/*.parquet"))
    logs = [(workdir / f"results/logs/cells/broken/decode/ctx{c}_c1.log").read_text() for c in (256, 40000)]
    for log in logs:  # whichever cell ran first started the server; the other did not retry
        assert "exited during start-up" in log
        assert "unrecognized arguments: --no-such-flag" in log  # the server log's tail
        assert "results/servers/broken/logs/" in log
    assert sum("failed earlier in this run, not retried" in log for log in logs) == 1
    seconds = float(re.search(r"after ([\d.]+) s\)", logs[0])[1])
    assert seconds < 60  # vLLM parses its arguments after importing torch: about 10 s here
    too_long_log = (workdir / "results/logs/cells/prefix_cache/decode/ctx40000_c1.log").read_text()
    assert re.search(r"at context 40000 a request holds about 40016 tokens, more than the 32768 the running "
                     r"server accepts", too_long_log)  # fmt: skip
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
    raw = demo_config(decode={"contexts": [256], "concurrency": [1], "output_tokens": 64, "requests_per_session": 80})
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    write_yaml(workdir / "long.yaml", raw)
    return [sys.executable, "-m", "snakemake", "--cores", "1", "report", "--configfile", "long.yaml"]


def start_and_wait_for_measuring(workdir: Path) -> subprocess.Popen:
    """Snakemake in its own session (as in a terminal), returned once a cell measures on a live server."""
    with open(workdir / "snakemake.out", "wb") as out:  # a file, not a pipe that could fill up and block
        proc = subprocess.Popen(
            long_running(workdir),
            cwd=workdir,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
            # As in a terminal: a test runner started in the background inherits SIGINT ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
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
    cell = workdir / "results/cells/prefix_cache/decode/ctx256_c1.parquet"
    try:
        if how == "ctrl-c":
            os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole foreground group
        else:
            os.kill(proc.pid, sig)  # only Snakemake itself
        # SIGTERM is Snakemake's graceful stop: it lets the running cell finish (here ~40 s), then exits.
        proc.wait(timeout=300)
        # After kill -9 no handler runs in Snakemake: the supervisor must notice its owner is gone.
        assert wait_for(lambda: not leftovers(workdir), 45), f"server still running after {how}"
        if how != "kill":
            assert not cell.exists()  # interrupted: no file that looks complete
        assert not list(cell.parent.glob(".*.partial"))  # and no half-written one either
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the orphaned cell job after kill -9
