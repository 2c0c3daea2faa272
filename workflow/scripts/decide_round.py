"""Snakemake script job: see servegrid.pipeline.snakemake_jobs.decide_round."""

import sys
from pathlib import Path

# servegrid lives in workflow/, beside this folder; importable without installing
# (as under --sdm conda) and, when installed, the same code.
sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 - injected by Snakemake

from servegrid.pipeline import snakemake_jobs

snakemake_jobs.decide_round(snakemake)  # noqa: F821
