"""What a configuration's Slurm job asks for (servegrid.pipeline.slurm, profiles/slurm), without a Slurm: the numbers
from the config, and Snakemake's dry run of the profile grouping each configuration into one job.

The same profile on a real Slurm runs in tests/slurm/test_slurm_pipeline.py.
"""

from __future__ import annotations

import contextlib
import re

import pytest

from helpers import copy_workflow, snakemake, with_changes
from servegrid.config import Experiment
from servegrid.pipeline import slurm


def test_a_sequential_cell_books_its_measuring_ceiling_its_warm_up_and_its_overhead(demo_raw):
    demo = Experiment(demo_raw)
    cell = demo.cell("ngram", "decode", 512, 4)  # max_duration_s 4 (the mode's own), one warm-up request
    timeout = demo.operations.request_timeout_s
    assert slurm.cell_time_limit_s(demo, cell) == pytest.approx(1.25 * 4 + timeout + slurm.CELL_OVERHEAD_S)


def test_a_fixed_count_cell_books_every_request_at_its_timeout(demo_raw):
    raw = with_changes(demo_raw, sampling={"temperature": 0.0})
    raw["workloads"] = {
        "decode": {
            "contexts": [512],
            "concurrency": [2],
            "output_tokens": 8,
            "requests_per_session": 3,
            "warmup_requests": 0,
        }
    }
    fixed = Experiment(raw)
    (cell, *_) = fixed.cells("ngram")
    assert slurm.cell_time_limit_s(fixed, cell) == 3 * fixed.operations.request_timeout_s + slurm.CELL_OVERHEAD_S
    assert slurm.minutes(slurm.cell_time_limit_s(fixed, cell)) == 16  # 960 s, rounded up to whole minutes


def test_a_job_asks_for_the_configurations_devices_by_count(seed_raw, demo_raw):
    seed, demo = Experiment(seed_raw), Experiment(demo_raw)
    assert [slurm.gpus(seed, name) for name in seed.configurations] == [1, 1, 1]
    assert slurm.cpus_per_task(demo, "ngram") == 2  # the server's core and the client's
    assert slurm.cpus_per_task(seed, "mtp") == 1  # neither pinned: at least one


def test_the_slurm_profile_makes_each_configuration_one_job(tmp_path_factory):
    """A dry run needs no Slurm: three group jobs for the demo's three configurations, each cell carrying the
    resources the Slurm executor reads, and the cells marked to run in the job's batch step."""
    workdir = copy_workflow(tmp_path_factory.mktemp("wf"))
    result = snakemake(workdir, "-n", "report", "--profile", "profiles/slurm", "--configfile", "config/cpu-demo.yaml")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert out.count("Group job configuration_job") == 3
    cells = re.findall(r"rule cell:.*?resources: ([^\n]*)", out, flags=re.S)
    assert len(cells) == 30
    for resources in cells:
        assert "gpu=0" in resources and "cpus_per_task=2" in resources and re.search(r"runtime=\d+", resources)
        assert resources.rstrip().endswith("mpi=")  # the empty mpi resource: no srun step of its own


def test_two_slurm_jobs_on_one_node_keep_their_state_and_gpu_claims_apart(tmp_path, monkeypatch):
    """Slurm packs jobs: two configurations' jobs on one node, a shared /tmp, each seeing its GPU as index 0. Each
    keeps its own state folder (records, leases, gateway) and claims its GPU 0 as its own; outside Slurm, one
    pipeline's GPU 0 is still refused to another."""
    from servegrid.errors import ServerError
    from servegrid.serving import hostlocks, state

    monkeypatch.setenv("SERVEGRID_LOCK_DIR", str(tmp_path / "claims"))
    host = state.this_host()
    folders, claimed = {}, []
    with contextlib.ExitStack() as held:
        for job, port in (("101", 1), ("102", 2)):
            monkeypatch.setenv("SLURM_JOB_ID", job)
            folders[job] = state.host_directory(tmp_path / "state")
            # both claim "GPU 0" on one node and one claims folder: each gets its own (ports stay the node's)
            claimed.append(held.enter_context(hostlocks.claims([0], [port], lambda port: True, f"job {job}")))
    assert folders == {"101": tmp_path / "state" / f"{host}-job101", "102": tmp_path / "state" / f"{host}-job102"}
    assert len(claimed) == 2
    monkeypatch.delenv("SLURM_JOB_ID")
    assert state.host_directory(tmp_path / "state") == tmp_path / "state" / host
    refused = r"GPU 0 is in use by another servegrid pipeline's server \(pipeline a"
    with hostlocks.claims([0], [1], lambda port: True, "pipeline a"), pytest.raises(ServerError, match=refused):  # noqa: SIM117
        with hostlocks.claims([0], [2], lambda port: True, "pipeline b"):
            pass
