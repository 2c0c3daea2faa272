"""`config.yaml` edited while the run's Slurm job waits in the queue, on the localhost Slurm.

A blocker job holds the one node, so the configuration's job stays PENDING; the test edits the workload's output
length in the config file, then cancels the blocker. Before the plan (servegrid.config.plan) the job parsed the
edited file and measured 12-token requests while the submitting Snakemake's params said 8; now the job measures
the plan (8) and its log names the edited key, and a dry run afterwards shows the cell as stale (its params
changed), so the next run measures the edit.

The calibration server stands in for the engine process: what is checked is which config a queued job reads.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import pandas as pd
import pytest

from helpers import copy_workflow, write_yaml
from helpers.fault_matrix import MATRIX
from helpers.faults import calibration_config, half_written, kill_survivors, wait_for, wait_no_survivors
from servegrid.records import cell_file

pytestmark = [pytest.mark.pipeline, pytest.mark.slurm]

PLANNED_TOKENS, EDITED_TOKENS = 8, 12


def grid(output_tokens: int) -> dict:  # type: ignore[type-arg]
    return calibration_config(
        decode={"contexts": [32], "concurrency": [1], "output_tokens": output_tokens, "requests_per_session": 4}
    )


def queue(slurm_cluster, state: str) -> list[str]:  # type: ignore[no-untyped-def]
    done = subprocess.run(
        ["squeue", "-h", "-t", state, "-o", "%i"], env=slurm_cluster.env, capture_output=True, text=True, check=True
    )
    return done.stdout.split()


def test_a_job_queued_before_an_edit_measures_what_its_run_planned(tmp_path, slurm_cluster):
    workdir = copy_workflow(tmp_path / "wf")
    config = workdir / "config" / "queued.yaml"
    planned = grid(PLANNED_TOKENS)
    write_yaml(config, planned)
    # Every CPU of the node, little memory (--exclusive would book all memory too, more than DefMemPerCPU allows).
    cpus = subprocess.run(
        ["sinfo", "-h", "-o", "%c"], env=slurm_cluster.env, capture_output=True, text=True, check=True
    ).stdout.split()[0]
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-c", cpus, "--mem", "100", "--wrap", "sleep 600"],
        env=slurm_cluster.env,
        capture_output=True,
        text=True,
    )
    assert submitted.returncode == 0, submitted.stderr
    blocker = submitted.stdout.strip()
    argv = [
        sys.executable,
        "-m",
        "snakemake",
        "aggregate",
        "--profile",
        "profiles/slurm",
        "--configfile",
        "config/queued.yaml",
        "--default-resources",
        "mem_mb=2000",
    ]
    process = subprocess.Popen(
        argv, cwd=workdir, env=slurm_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    started = time.monotonic()
    try:
        assert wait_for(lambda: blocker in queue(slurm_cluster, "R"), 60), "the blocker never ran"
        queued = wait_for(lambda: [j for j in queue(slurm_cluster, "PD") if j != blocker] or process.poll(), 300)
        assert queued and process.poll() is None, process.communicate()[0][-3000:]
        (job,) = [j for j in queue(slurm_cluster, "PD") if j != blocker]
        edited_config = copy.deepcopy(planned)  # the user edits one key while the job waits
        edited_config["workloads"]["decode"]["output_tokens"] = EDITED_TOKENS
        write_yaml(config, edited_config)
        subprocess.run(["scancel", blocker], env=slurm_cluster.env, check=True)
        output, _ = process.communicate(timeout=600)
    finally:
        subprocess.run(["scancel", blocker], env=slurm_cluster.env, check=False)
        if process.poll() is None:
            process.kill()
            process.wait()
        kill_survivors(workdir)
    took = time.monotonic() - started
    assert process.returncode == 0, output[-4000:]

    # The cell measured what was planned, and says so in its settings and its requests.
    (path,) = sorted((workdir / "results" / "cells").rglob("*.parquet"))
    table, meta = cell_file.read_cell(path)
    frame = table.to_pandas()
    assert meta.slurm_job == job
    assert meta.settings["workload"]["output_tokens"] == PLANNED_TOKENS
    measured = frame[frame["phase"] == "measured"]
    assert len(measured) == 4
    assert set(measured["output_tokens_requested"]) == set(measured["output_tokens_reported"]) == {PLANNED_TOKENS}
    summary = pd.read_parquet(workdir / "results" / "tables" / "summary.parquet")
    assert len(summary) == 1 and summary["valid"].all(), summary["invalid_reasons"].tolist()
    # The cell's log names the key edited since the run planned it.
    cell_log = (workdir / "results" / "logs" / path.relative_to(workdir / "results")).with_suffix(".log").read_text()
    edited = f"(workloads.decode.output_tokens: planned {PLANNED_TOKENS}, now {EDITED_TOKENS});"
    assert edited in cell_log, cell_log[-3000:]
    assert half_written(workdir) == []
    assert wait_no_survivors(workdir, 30) == []

    # The next run sees the edit: the cell is stale by its params.
    dry = subprocess.run([*argv, "-n"], cwd=workdir, env=slurm_cluster.env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert str(path.relative_to(workdir)) in dry.stdout + dry.stderr
    assert "params" in (dry.stdout + dry.stderr).lower()
    MATRIX.record("config-edited-while-queued", took, "submission to the tables, the queue wait included")
