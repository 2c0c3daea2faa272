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


def test_the_gateway_is_pinned_exactly_with_hashes_and_never_to_a_compromised_release():
    """envs/litellm.txt pins one exact version; the lock has that version and a hash for every package; the
    demo's proxy.version names it; 1.82.7 and 1.82.8 (malicious uploads) appear nowhere."""
    from servegrid.config.checks import COMPROMISED_LITELLM

    spec = [line for line in (REPO / "envs" / "litellm.txt").read_text().splitlines() if line and line[0] != "#"]
    assert len(spec) == 1 and re.fullmatch(r"litellm\[proxy\]==\d+\.\d+\.\d+", spec[0]), spec
    version = spec[0].split("==")[1]
    assert version not in COMPROMISED_LITELLM
    lock = (REPO / "envs" / "litellm.lock.txt").read_text()
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock.split("\n", 4)[-1])
    pinned = [e for e in entries if "==" in e.split("\n")[0]]
    assert pinned and all("--hash=sha256:" in e for e in pinned), "a package without its hash"
    assert all(" \\" in e.split("\n")[0] and "==" in e.split("\n")[0] for e in pinned)  # exact pins only
    assert f"litellm[proxy]=={version} " in lock
    assert not re.search(r"^litellm(\[proxy\])?==1\.82\.[78]\b", lock, re.M)
    demo = yaml.safe_load((REPO / "config" / "proxy-demo.yaml").read_text())
    assert demo["proxy"]["version"] == version
