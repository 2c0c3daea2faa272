"""Snakemake script job: see servegrid.jobs.run_cell."""

from servegrid import jobs

jobs.run_cell(snakemake)  # noqa: F821 - injected by Snakemake
