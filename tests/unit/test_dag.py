"""What Snakemake plans, without running anything (dry runs in a copy of the workflow)."""

from __future__ import annotations

import re

import pytest

from helpers import copy_workflow, snakemake, with_changes, write_yaml


@pytest.fixture
def workdir(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("wf"))


def planned(result) -> dict[str, int]:
    """Job counts from a dry run's 'Job stats' table."""
    assert result.returncode == 0, result.stdout + result.stderr
    counts = {}
    block = (result.stdout + result.stderr).split("Job stats:")[1].split("\n\n")[0]
    for line in block.splitlines():
        match = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if match and match[1] != "total":
            counts[match[1]] = int(match[2])
    return counts


def test_seed_config_plans_every_cell_of_the_grid(workdir):
    counts = planned(snakemake(workdir, "-n", "report"))
    assert counts["cell"] == 3 * 41  # the seed's two configurations and the two together
    assert counts["server_spec"] == counts["server_stop"] == 3
    assert counts["report_html"] == counts["report_pdf"] == 2
    assert "tiny_model" not in counts


def test_configfile_replaces_config_yaml_instead_of_merging(workdir):
    result = snakemake(workdir, "-n", "--profile", "profiles/cpu-demo", "report")
    counts = planned(result)
    assert counts["cell"] == 3 * 10 and counts["tiny_model"] == 1  # three configurations × 10 cells
    assert counts["server_spec"] == counts["server_stop"] == 3
    assert "results/cells/mtp/" not in result.stdout  # the GPU config's configuration is not inherited


def test_invalid_config_fails_before_anything_runs_naming_the_key(workdir, demo_raw):
    bad = with_changes(demo_raw, **{"workloads.decode.concurrency": [1, -4]})
    write_yaml(workdir / "bad.yaml", bad)
    result = snakemake(workdir, "--cores", "1", "report", "--configfile", "bad.yaml")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "concurrency" in output and "-4" in output
    assert "Building DAG" not in output or "cell" not in output.split("Building DAG")[1]
    assert not (workdir / "results").exists()  # no server, no model, nothing written


def test_rates_plan_open_loop_cells_beside_the_closed_loop_ones(workdir, demo_raw):
    raw = with_changes(demo_raw, **{"workloads.decode.rates": [0.5, 2]})
    write_yaml(workdir / "rates.yaml", raw)
    before = planned(snakemake(workdir, "report", "-n", "--configfile", "config/cpu-demo.yaml"))
    result = snakemake(workdir, "report", "-n", "--configfile", "rates.yaml")
    contexts = len(demo_raw["workloads"]["decode"]["contexts"])
    assert planned(result)["cell"] == before["cell"] + 3 * 2 * contexts  # three configurations × two rates
    assert re.search(r"results/cells/\w+/decode/ctx\d+_r0\.5\.parquet", result.stdout)
    assert not (workdir / "results" / ".plans").exists()  # a dry run submits nothing: no plan written


def test_the_traffic_demo_plans_rate_cells_and_trace_cells_by_speedup(workdir):
    result = snakemake(workdir, "-n", "--profile", "profiles/cpu-traffic-demo", "report")
    counts = planned(result)
    assert counts["cell"] == 3 * (3 + 2)  # three configurations × (three rates + two speedups of the trace)
    assert re.search(r"results/cells/both/trace/ctx0_x2\.parquet", result.stdout)
    assert re.search(r"results/cells/ngram/single_turn/ctx1024_r8\.parquet", result.stdout)
    assert counts["report_html"] == counts["report_pdf"] == 2
