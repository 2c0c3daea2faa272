"""The calibration pass through Snakemake (target ``calibrate``): one calibration per configuration, kept with its
server spec and redone when that spec changes, and only then; ``servegrid estimate`` prices from it. Served by the
calibration stand-in (what is measured on real vLLM: tests/integration/test_top_ups_on_vllm.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import copy_workflow, leftovers, snakemake, write_yaml
from helpers.faults import calibration_config
from servegrid import paths
from servegrid.records import calibration_file

pytestmark = pytest.mark.pipeline


def two_configurations(interval: str = "0.01") -> dict:  # type: ignore[type-arg]
    config = calibration_config()
    config["configurations"]["other"] = {"label": "other", "prefix_caching": True, "args": ["--interval", interval]}
    config["sampling"] = {"target_rel_ci": 0.05, "min_samples": 8, "max_samples": 32, "max_duration_s": 10}
    config["workloads"] = {"decode": {"contexts": [32, 64], "concurrency": [1, 2], "output_tokens": 8}}
    return config


def planned(workdir, configfile: str) -> str:  # type: ignore[no-untyped-def]
    dry = snakemake(workdir, "-n", "--cores", "1", "calibrate", "--configfile", configfile)
    assert dry.returncode == 0, dry.stderr[-3000:]
    return dry.stdout + dry.stderr


def test_a_calibration_is_kept_with_its_server_spec(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    write_yaml(workdir / "x.yaml", two_configurations())
    result = snakemake(workdir, "--cores", "1", "calibrate", "--configfile", "x.yaml")
    assert result.returncode == 0, result.stderr[-4000:]
    written = {name: calibration_file.read(workdir / paths.calibration_path(name)) for name in ("only", "other")}
    assert all(len(c.probes) == 2 for c in written.values())  # decode's (32, 1) and (64, 2)
    assert leftovers(workdir) == []  # each calibration's server session ended with it
    assert "Nothing to be done" in planned(workdir, "x.yaml")
    # Another grid, the same servers: nothing to calibrate again.
    grid = two_configurations()
    grid["workloads"]["decode"]["contexts"] = [32, 64, 128]
    write_yaml(workdir / "grid.yaml", grid)
    assert "Nothing to be done" in planned(workdir, "grid.yaml")
    # One server's flags changed: its spec and its calibration, and nothing of the other's.
    write_yaml(workdir / "flags.yaml", two_configurations(interval="0.02"))
    output = planned(workdir, "flags.yaml")
    assert "output: results/servers/other/calibration.json" in output
    assert "output: results/servers/only/calibration.json" not in output
    # The estimate prices both configurations from their calibrations.
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "servegrid"), "--config", "x.yaml", "estimate"],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    assert "only: calibrated" in shown.stdout and "other: calibrated" in shown.stdout, shown.stdout
    assert "basis" in shown.stdout and "assumed\n" not in shown.stdout
