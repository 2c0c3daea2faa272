"""The gateway in the pipeline: Snakemake runs a calibration grid both ways through a real LiteLLM proxy
(.venv-litellm), which it starts once, reuses for every cell and stops at the end; after ``kill -9`` of
Snakemake mid-cell, neither the proxy nor the server outlives it. The calibration server stands in for the
engine process (fast, no model); the real vLLM behind the real proxy is tests/integration/test_gateway.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from helpers import REPO, copy_workflow, free_port_range, write_yaml
from helpers.faults import calibration_config, half_written, kill_survivors, wait_for, wait_no_survivors
from servegrid import paths
from servegrid.serving import state

pytestmark = pytest.mark.pipeline

CONFIG = "x.yaml"
KEY_ENV = "SERVEGRID_PROXY_KEY"
PINNED = next(
    line.split("==")[1].strip()
    for line in (REPO / "envs" / "litellm.txt").read_text().splitlines()
    if line.startswith("litellm")
)


def gateway_config(**workloads) -> dict:  # type: ignore[no-untyped-def,type-arg]
    config = calibration_config(**workloads)
    config["route"] = "both"
    config["proxy"] = {"version": PINNED, "port": free_port_range()[0]}
    return config


def snakemake(workdir: Path, key: str, **popen) -> subprocess.Popen:  # type: ignore[no-untyped-def,type-arg]
    argv = [sys.executable, "-m", "snakemake", "--cores", "1", "aggregate", "--configfile", CONFIG]
    return subprocess.Popen(argv, cwd=workdir, env={**os.environ, KEY_ENV: key}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)  # fmt: skip


def written_anywhere(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def gateway_sessions(workdir: Path) -> set[str]:
    logs = workdir / paths.server_log_dir(state.GATEWAY)
    return {p.name.removesuffix(".log") for p in logs.glob("*.log") if not p.name.endswith(".supervisor.log")}


@pytest.fixture
def workdir(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = copy_workflow(tmp_path / "wf")
    yield path
    kill_survivors(path)


def test_the_pipeline_starts_one_gateway_and_stops_it(workdir, matrix):
    # 8 requests a cell a side: enough for a median (servegrid.stats.sampling)
    grid = {"decode": {"contexts": [32, 64], "concurrency": [2], "output_tokens": 8, "requests_per_session": 4}}
    write_yaml(workdir / CONFIG, gateway_config(**grid))
    started = time.monotonic()
    key = "sk-" + os.urandom(8).hex()
    proc = snakemake(workdir, key)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    seconds = time.monotonic() - started
    assert len(gateway_sessions(workdir)) == 1  # lazily started once, reused by both cells
    added = pd.read_parquet(workdir / paths.GATEWAY_TABLE)
    assert len(added) == 2 and added["ttft_added_p50_s"].notna().all()
    assert "stopped server session" in out  # the pipeline's end took the gateway down with the server
    assert half_written(workdir) == [] and wait_no_survivors(workdir, 30) == []
    assert written_anywhere(workdir / "results", key) == [] and written_anywhere(workdir / ".snakemake", key) == []
    matrix.record("gateway-run", seconds, "a 2-cell grid both ways through LiteLLM, start to end")


def test_no_gateway_outlives_a_killed_snakemake(workdir, matrix):
    # One long cell, so that the kill strikes while it measures through the gateway.
    write_yaml(workdir / CONFIG, gateway_config(decode={"contexts": [32], "concurrency": [2], "output_tokens": 8,
                                                        "requests_per_session": 400}))  # fmt: skip
    proc = snakemake(workdir, "sk-" + os.urandom(8).hex(), start_new_session=True)
    try:
        record_path = state.host_directory(workdir / paths.STATE_DIR) / f"{state.GATEWAY}.json"
        assert wait_for(lambda: (state.read(record_path) or {}).get("status") == "running", 180), "no gateway started"
        time.sleep(4)  # its first proxied phase under way
        os.kill(proc.pid, signal.SIGKILL)  # only Snakemake itself: no handler runs
        killed = time.monotonic()
        proc.wait(timeout=60)
        # The supervisors notice their owner is gone and take the gateway and the server down.
        assert wait_no_survivors(workdir, 60) == [], "processes still running after kill -9 of Snakemake"
        seconds = time.monotonic() - killed
        assert list((workdir / "results").rglob("cells/**/*.parquet")) == []  # interrupted: no cell file
        assert half_written(workdir) == []
        matrix.record("snakemake-sigkill-gateway", seconds, "until no process (gateway, server) is left")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
