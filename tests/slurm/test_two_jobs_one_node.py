"""Two configurations' Slurm jobs packed on the localhost Slurm's one node at once, with /tmp shared by the jobs and
with a /tmp of each job's own (the cluster's task prolog sets TMPDIR where tools/slurm_localhost.py's flag file is).

Before each job kept its own state folder (results/.servegrid/<host>-job<id>/), the two jobs met in the host's: with
/tmp shared, each took the other's server for a rival and stopped it between cells (a server start per cell); with
/tmp per job, nothing was locked and one stopped the other's server mid-cell. The calibration server stands in for
the engine process (what is checked is servegrid's own state, claims and locks); the two configurations are CPU-only,
one CPU each, and `--resources cpu_server=4` (without the workflow profile, whose cpu_server=1 would win) lets
Snakemake submit both at once.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import copy_workflow, write_yaml
from helpers.fault_matrix import MATRIX
from helpers.faults import calibration_config, half_written, kill_survivors, wait_no_survivors
from servegrid.records import cell_file

pytestmark = [pytest.mark.pipeline, pytest.mark.slurm]

CONFIGURATIONS = ("one", "two")


def grid() -> dict:  # type: ignore[type-arg]
    # Two cells a configuration of a few seconds each: long enough for the jobs to overlap.
    raw = calibration_config(
        decode={"contexts": [32, 64], "concurrency": [2], "output_tokens": 8, "requests_per_session": 60}
    )
    raw["configurations"] = {name: {"label": name, "prefix_caching": True} for name in CONFIGURATIONS}
    return raw


def job_spans(slurm_cluster, jobs: set[str]) -> dict[str, tuple[float, float]]:  # type: ignore[no-untyped-def]
    """Each job's start and end, as Slurm accounted them (epoch seconds)."""
    spans = {}
    for job in jobs:
        start, end = slurm_cluster.sacct("-j", job, "-X", "-n", "-P", "-o", "Start,End").strip().split("|")
        spans[job] = tuple(time.mktime(time.strptime(t, "%Y-%m-%dT%H:%M:%S")) for t in (start, end))
    return spans


@pytest.mark.parametrize("tmp_per_job", [False, True], ids=["tmp-shared", "tmp-per-job"])
def test_two_configurations_jobs_on_one_node_each_measure_on_their_own_server(tmp_path, slurm_cluster, tmp_per_job):
    workdir = copy_workflow(tmp_path / "wf")
    write_yaml(workdir / "config" / "two-jobs.yaml", grid())
    flag = slurm_cluster.dir / "per-job-tmp"
    flag.touch() if tmp_per_job else flag.unlink(missing_ok=True)
    # The workflow profile's cpu_server=1 would replace the command line's (docs/slurm.md): without it, four (a
    # group job books its two cells, side by side in the DAG, as two: GroupResources.basic_layered).
    argv = [
        sys.executable,
        "-m",
        "snakemake",
        "aggregate",
        "--profile",
        "profiles/slurm",
        "--workflow-profile",
        "none",
        "--configfile",
        "config/two-jobs.yaml",
        "--resources",
        "cpu_server=4",
        "--default-resources",
        "mem_mb=2000",
    ]
    started = time.monotonic()
    try:
        result = subprocess.run(argv, cwd=workdir, env=slurm_cluster.env, capture_output=True, text=True, timeout=900)
    finally:
        flag.unlink(missing_ok=True)
        kill_survivors(workdir)
    took = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # Each configuration measured all its cells in one Slurm job, on one server started once in that job.
    jobs, logs = {}, ""
    for name in CONFIGURATIONS:
        metas = [cell_file.read_cell(p)[1] for p in sorted((workdir / "results" / "cells" / name).rglob("*.parquet"))]
        assert len(metas) == 2
        assert len({m.server["session"] for m in metas}) == 1, f"{name}: its server was started more than once"
        (jobs[name],) = {m.slurm_job for m in metas}
        logs += "".join(p.read_text() for p in (workdir / "results" / "logs" / "cells" / name).rglob("*.log"))
    assert jobs["one"] != jobs["two"] and None not in jobs.values()
    assert "devices needed by" not in logs and "replaced" not in logs  # neither stopped the other's server
    # ... at once: the two jobs' times overlap on the one node.
    spans = job_spans(slurm_cluster, set(jobs.values()))
    (a_start, a_end), (b_start, b_end) = spans.values()
    accounted = slurm_cluster.sacct("-j", ",".join(jobs.values()), "-X", "-P", "-o", "JobID,AllocCPUS,Start,End")
    assert max(a_start, b_start) < min(a_end, b_end), accounted
    for job in jobs.values():  # the task prolog's per-job /tmp, where it made one
        shutil.rmtree(f"/tmp/servegrid-slurm-job-{job}", ignore_errors=True)
    # Each job its own state folder.
    folders = {p.name for p in (workdir / "results" / ".servegrid").iterdir() if p.is_dir()}
    assert {f"-job{job}" for job in jobs.values()} <= {name[name.rfind("-job") :] for name in folders}, folders
    assert half_written(workdir) == []
    assert wait_no_survivors(workdir, 30) == []
    assert Path(workdir / "results" / "tables" / "summary.parquet").exists()
    seen = MATRIX.rows.get("two-jobs-one-node")
    if seen is None or seen.seconds is None or took >= seen.seconds:  # one row for both: the slower run's time
        MATRIX.record(
            "two-jobs-one-node", took, f"the whole run to the tables, /tmp {'per job' if tmp_per_job else 'shared'}"
        )
