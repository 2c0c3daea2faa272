"""The localhost Slurm cluster runs a batch job end to end, accounting included (what the Snakemake plugin reads)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time "conftest" may name tests/conftest.py: pytest loads both under that name
    from conftest import SlurmCluster


def test_sbatch_job_completes_and_is_accounted(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--wrap", "hostname"],
        cwd=tmp_path,  # the job's working directory, where slurm-<id>.out lands
        env=slurm_cluster.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"

    assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED|0:0"
    assert (tmp_path / f"slurm-{job}.out").read_text().strip() == socket.gethostname()
