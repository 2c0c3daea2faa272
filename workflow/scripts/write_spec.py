"""Snakemake script job: see servegrid.jobs.write_spec."""

from servegrid import jobs

jobs.write_spec(snakemake)  # noqa: F821 - injected by Snakemake
