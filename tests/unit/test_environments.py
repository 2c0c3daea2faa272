"""The conda spec (envs/pipeline.yaml, for ``snakemake --sdm conda``) provides what pyproject.toml requires.

Snakemake's script jobs import servegrid from workflow/ without installing it, so the conda environment
must hold every package servegrid imports, at the versions pyproject.toml asks for. conda itself is not
reachable on this project's machines: this compares the two lists, it does not build the environment.
"""

from __future__ import annotations

import re
import tomllib

import yaml

from helpers import REPO

# What runs the jobs, not what they import.
NOT_IN_JOBS = {"snakemake", "snakemake-executor-plugin-slurm"}
# conda-forge's name where it differs from PyPI's.
CONDA_NAME = {"matplotlib": "matplotlib-base", "prometheus-client": "prometheus_client"}


def _requirement(text: str) -> tuple[str, str]:
    """(normalised name, version specifier without spaces) of ``name>=1.0,<2`` (markers and comments dropped)."""
    text = text.split(";")[0].split("#")[0].strip()
    match = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", text)
    assert match, text
    return match[1].lower().replace("_", "-"), match[2].replace(" ", "")


def test_the_conda_spec_holds_every_package_the_jobs_import_at_pyprojects_versions():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {name: spec for name, spec in map(_requirement, project["dependencies"]) if name not in NOT_IN_JOBS}
    conda = yaml.safe_load((REPO / "envs" / "pipeline.yaml").read_text())["dependencies"]
    provided: dict[str, str] = {}
    for entry in conda:
        for text in entry["pip"] if isinstance(entry, dict) else [entry]:
            name, spec = _requirement(text)
            provided[name] = spec
    for name, spec in wanted.items():
        conda_name = CONDA_NAME.get(name, name).lower().replace("_", "-")
        assert conda_name in provided, f"envs/pipeline.yaml lacks {name} ({conda_name}), which pyproject.toml requires"
        assert provided[conda_name] == spec, (
            f"{name}: pyproject.toml asks {spec!r}, envs/pipeline.yaml {provided[conda_name]!r}"
        )
