"""What a configuration's Slurm job asks for (servegrid.pipeline.slurm, profiles/slurm), without a Slurm: the numbers
from the config, and Snakemake's dry run of the profile grouping each configuration into one job.

The same profile on a real Slurm runs in tests/slurm/test_slurm_pipeline.py.
"""

from __future__ import annotations

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
    raw["workloads"] = {"decode": {"contexts": [512], "concurrency": [2], "output_tokens": 8,
                                   "requests_per_session": 3, "warmup_requests": 0}}  # fmt: skip
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
