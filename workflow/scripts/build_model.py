"""Snakemake script job: see servegrid.jobs.build_model."""

from servegrid import jobs

jobs.build_model(snakemake)  # noqa: F821 - injected by Snakemake
