"""Snakemake script job: see servegrid.jobs.aggregate."""

from servegrid import jobs

jobs.aggregate(snakemake)  # noqa: F821 - injected by Snakemake
