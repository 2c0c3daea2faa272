"""Snakemake script job: see servegrid.jobs.stop_server."""

from servegrid import jobs

jobs.stop_server(snakemake)  # noqa: F821 - injected by Snakemake
