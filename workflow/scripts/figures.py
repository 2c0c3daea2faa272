"""Snakemake script job: see servegrid.jobs.figures."""

from servegrid import jobs

jobs.figures(snakemake)  # noqa: F821 - injected by Snakemake
