"""The grid through `--profile profiles/slurm` on a real one-node Slurm (tests/slurm/conftest.py), serving real
vLLM (CPU build): a configuration is one Slurm job with one server start; an `scancel` mid-cell leaves no vLLM
process and no cell file, and the next run measures what is left and builds both reports.

The tests run in order on one working copy: the first cancels the configuration's job mid-cell, the second reruns
and checks the finished grid. One configuration, not the demo's three: that each configuration is a job of its own
is the Slurm profile's plan, checked by a dry run (tests/unit/test_cluster.py); a second configuration here would
cost a second Slurm job with its own vLLM start (80-125 s a run, the plugin's status checks included) and check
nothing that plan does not.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import copy_workflow, write_yaml
from helpers.faults import kill_survivors, vllm_config, wait_for, wait_no_survivors
from servegrid import paths
from servegrid.records import cell_file
from servegrid.serving import state

pytestmark = [pytest.mark.pipeline, pytest.mark.vllm, pytest.mark.slurm]

CONFIGURATION = "prefix_cache"


def grid() -> dict[str, Any]:
    raw = vllm_config(
        # 10 requests of 48 tokens: a cell of about 10 s, long enough to be cancelled in the middle (the scancel
        # follows the cell's first log line within a second)
        decode={"contexts": [256], "concurrency": [1], "output_tokens": 48, "requests_per_session": 10},
        single_turn={
            "contexts": [1024],
            "concurrency": [1],
            "suffix_tokens": 32,
            "output_tokens": 8,
            "requests_per_session": 3,
        },
    )
    raw.pop("slo", None)
    return raw


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, slurm_cluster):  # type: ignore[no-untyped-def]
    root = copy_workflow(tmp_path_factory.mktemp("slurm-grid"))
    write_yaml(root / "config" / "slurm-test.yaml", grid())
    yield root
    kill_survivors(root)


def snakemake_args(*extra: str) -> list[str]:
    # Targets before the options that take several values (--default-resources would swallow them).
    return [
        sys.executable,
        "-m",
        "snakemake",
        *extra,
        "--profile",
        "profiles/slurm",
        "--configfile",
        "config/slurm-test.yaml",
        "--default-resources",
        "mem_mb=4000",
    ]


def run(workdir: Path, env: dict[str, str], *extra: str, timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    return subprocess.run(snakemake_args(*extra), cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


def measuring_cell(workdir: Path) -> Path | None:
    """The log of a cell that is measuring now (its server is up and it sends)."""
    for log in (workdir / "results" / "logs" / "cells").rglob("*.log"):
        if " on http://" in log.read_text(errors="replace"):
            return log
    return None


def session_processes(session: str) -> list[psutil.Process]:
    """Live processes of a server session (the supervisor puts SERVEGRID_SESSION in its server's environment)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get("SERVEGRID_SESSION") == session:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_an_scancel_mid_cell_leaves_no_server_and_no_cell_file(workdir, slurm_cluster):
    process = subprocess.Popen(
        snakemake_args("report"),
        cwd=workdir,
        env=slurm_cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        started = wait_for(lambda: measuring_cell(workdir) is not None or process.poll() is not None, 900, 0.5)
        assert started and process.poll() is None, process.communicate()[0][-3000:] if started else "no cell started"
        log = measuring_cell(workdir)
        assert log is not None
        configuration = log.relative_to(workdir / "results" / "logs" / "cells").parts[0]
        running = subprocess.run(
            ["squeue", "-h", "-t", "R", "-o", "%i"], env=slurm_cluster.env, capture_output=True, text=True, check=True
        ).stdout.split()
        assert len(running) == 1, running
        assert configuration == CONFIGURATION
        # The job keeps its servers in its own state folder (state.scope: <host>-job<id>), not the host's.
        job_state = state.host_directory(workdir / paths.STATE_DIR, f"{state.this_host()}-job{running[0]}")
        record = json.loads((job_state / f"{configuration}.json").read_text())
        cancelled_at = time.monotonic()
        subprocess.run(["scancel", running[0]], env=slurm_cluster.env, check=True)
        assert wait_for(lambda: not session_processes(record["session"]), 60), "the cancelled job's server lives on"
        gone_after_s = time.monotonic() - cancelled_at
        output, _ = process.communicate(timeout=1200)
    finally:
        if process.poll() is None:  # a failed assertion above: end Snakemake as a user would, so it unlocks
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
    assert process.returncode != 0, output[-3000:]
    cell_file = workdir / "results" / "cells" / log.relative_to(workdir / "results" / "logs" / "cells")
    assert not cell_file.with_suffix(".parquet").exists()  # cancelled mid-cell: nothing half-measured kept
    assert not list((workdir / "results").rglob("*.partial*"))
    print(f"scancel of job {running[0]} ({configuration}): its server gone after {gone_after_s:.1f} s")
    assert "CANCELLED" in slurm_cluster.sacct("-j", running[0], "-X", "-n", "-o", "State")
    assert wait_no_survivors(workdir, 30) == []


def test_the_rerun_measures_the_grid_in_one_job_on_one_server(workdir, slurm_cluster):
    cancelled = set(slurm_cluster.sacct("-X", "-n", "-o", "JobID", "--state", "CANCELLED").split())
    result = run(workdir, slurm_cluster.env, "report")
    assert result.returncode == 0, result.stderr[-4000:]
    for lang in ("pt", "hu"):
        for kind in ("html", "pdf"):
            assert (workdir / "results" / "report" / f"servegrid-{lang}.{kind}").stat().st_size > 0
    cells = sorted((workdir / "results" / "cells" / CONFIGURATION).rglob("*.parquet"))
    metas = [cell_file.read_cell(path)[1] for path in cells]
    assert len(metas) == 2
    slurm_jobs = {m.slurm_job for m in metas}
    sessions = {m.server["session"] for m in metas}
    # every cell of the configuration measured in one Slurm job, not the cancelled one, on one server started once
    assert len(slurm_jobs) == 1 and None not in slurm_jobs, slurm_jobs
    assert len(sessions) == 1, sessions
    (job,) = slurm_jobs
    assert job not in cancelled
    assert slurm_cluster.sacct("-j", job, "-X", "-n", "-o", "State").split() == ["COMPLETED"]
    # nothing left to do, and nothing left running
    dry = run(workdir, slurm_cluster.env, "-n", "report", timeout=300)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-2000:]
    assert wait_no_survivors(workdir, 30) == []
    squeue = subprocess.run(["squeue", "-h"], env=slurm_cluster.env, capture_output=True, text=True, check=True)
    assert squeue.stdout.strip() == ""
