"""Snakemake script job: see servegrid.jobs.render_report."""

from servegrid import jobs

jobs.render_report(snakemake)  # noqa: F821 - injected by Snakemake
