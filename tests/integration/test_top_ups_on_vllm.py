"""Sampling that serves the verdict through Snakemake on real vLLM: a first pass, a round of decisions, top-ups of
only the open groups' cells, the last round's word per group in the tables, and reruns that measure nothing again;
then a calibration of one configuration (servegrid calibrate) on the same vLLM, and the estimate it prices.

Every group's first pass is open by construction: a time limit of 0.2 s stops each cell after a request or two
(16 tokens each), and fewer than three values per configuration have no interval (stats.group_decision.MIN_VALUES).
Two configurations with the same flags were not enough: two server sessions of one spec differed by 1.36× (interval
1.28-1.47) in a run of 2026-12-07, so that group was decided at its first look.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from helpers import REPO, copy_workflow, engine_for_tests, leftovers, placed, snakemake, write_yaml
from servegrid import paths
from servegrid.records import calibration_file

pytestmark = [pytest.mark.vllm, pytest.mark.pipeline]


def twin_grid(rounds: int):  # type: ignore[no-untyped-def]
    demo_raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw = dict(demo_raw)
    same = dict(demo_raw["configurations"]["prefix_cache"])
    raw["configurations"] = {"first": dict(same), "twin": dict(same)}
    raw["engine"] = engine_for_tests(demo_raw["engine"])
    raw["sampling"] = {
        **demo_raw["sampling"],
        "min_samples": 8,
        "max_duration_s": 0.2,
        "policy": "verdict",
        "top_up_rounds": rounds,
    }
    # One group: what a round does with a group is the same for every mode (tests/unit/test_top_ups.py).
    raw["workloads"] = {"decode": {"contexts": [256], "concurrency": [1], "output_tokens": 16}}
    raw["slo"] = {}
    raw.pop("cost", None)
    raw["verdict"] = {"min_factor": 1.001}
    # A slow shared host must not invalidate the cells (as tests/integration/test_pipeline.py says why).
    raw["validity"] = {**raw.get("validity", {}), "max_loop_lag_s": 0.25, "max_client_cpu": 0.95}
    return placed(raw)


def server_sessions(workdir, configuration: str) -> list[str]:  # type: ignore[no-untyped-def]
    """The server sessions the pipeline started for ``configuration``: one log each."""
    logs = workdir / paths.server_log_dir(configuration)
    return [p.name for p in logs.glob("*.log") if not p.name.endswith(".supervisor.log")]


def job_counts(output: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    if "Job stats:" in output:
        for line in output.split("Job stats:")[1].split("\n\n")[0].splitlines():
            name, _, count = line.strip().partition(" ")
            if count.strip().isdigit() and name != "total":
                counts[name] = int(count.strip())
    return counts


@pytest.fixture(scope="module")
def verdict_run(tmp_path_factory):  # type: ignore[no-untyped-def]
    workdir = copy_workflow(tmp_path_factory.mktemp("top-ups"))
    write_yaml(workdir / "test.yaml", twin_grid(rounds=1))
    # The tables only: the report's words for it are rendered from synthetic cells (tests/unit/test_top_ups.py).
    result = snakemake(workdir, "--cores", "1", "aggregate", "--configfile", "test.yaml")
    return workdir, result


def test_only_the_open_groups_cells_are_topped_up_and_pooled_as_later_repeats(verdict_run):
    workdir, result = verdict_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    results = workdir / "results"
    first = json.loads((results / "decisions" / "round1.json").read_text())
    opened = {(g["mode"], g["context"], g["concurrency"]) for g in first["groups"] if g["state"] == "open"}
    assert opened, f"no group open after the first pass: {first['groups']}"
    # Round 1 tops up exactly the open groups' cells, each one file of its own.
    listed = set(first["top_up"])
    written = {
        str(p.relative_to(results / "top-ups" / "round1"))[: -len(".parquet")]
        for p in results.glob("top-ups/round1/**/*.parquet")
    }
    assert written == listed
    # Round 1 runs the configurations in the first pass's reverse order: 'twin', whose server the first pass left
    # up, is topped up on it first, and only 'first' starts again (servers take turns on a CPU): three starts, not four.
    assert {cell.split("/")[0] for cell in listed} == {"first", "twin"}, listed
    starts = {name: len(server_sessions(workdir, name)) for name in ("first", "twin")}
    assert starts == {"first": 2, "twin": 1}, starts
    summary = pd.read_parquet(results / "tables" / "summary.parquet").set_index("cell_id")
    requests = pd.read_parquet(results / "tables" / "requests.parquet")
    measured = requests[requests["phase"] == "measured"]
    for cell_id, row in summary.iterrows():
        cell_requests = measured[
            (
                measured["configuration"]
                + "/"
                + measured["mode"]
                + "/ctx"
                + measured["context"].astype(str)
                + "_c"
                + measured["concurrency"].astype(str)
            )
            == cell_id
        ]
        if cell_id in listed:
            # The first pass's repeat 0, the top-up's repeat 1, no request measured twice.
            assert row["top_ups"] == 1
            assert sorted(cell_requests["repeat"].unique()) == [0, 1]
            assert cell_requests["request_id"].is_unique
        else:
            assert row["top_ups"] == 0
            assert sorted(cell_requests["repeat"].unique()) == [0]
    # The last round (2) tops nothing up and says per group how its sampling stopped; the comparisons carry it.
    last = json.loads((results / "decisions" / "round2.json").read_text())
    assert last["last"] and last["top_up"] == []
    comparisons = pd.read_parquet(results / "tables" / "comparisons.parquet")
    stopped = {(g["mode"], g["context"], g["concurrency"]): g["state"] for g in last["groups"]}
    for row in comparisons.itertuples():
        assert row.sampling_stop == stopped[(row.mode, row.context, row.concurrency)]
        assert row.sampling_stop in ("decided", "tie", "budget")
        assert row.top_up_rounds == (1 if (row.mode, row.context, row.concurrency) in opened else 0)
    assert leftovers(workdir) == []


def test_a_rerun_measures_nothing_and_more_rounds_measure_no_earlier_repeat(verdict_run):
    workdir, result = verdict_run
    assert result.returncode == 0
    dry = snakemake(workdir, "-n", "--cores", "1", "aggregate", "--configfile", "test.yaml")
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-3000:]
    # A second round: round 2 (the last one so far) decides again and may top up; round 1's decision, its top-ups
    # and the cells stay as they are.
    write_yaml(workdir / "more.yaml", twin_grid(rounds=2))
    more = snakemake(workdir, "-n", "--cores", "1", "aggregate", "--configfile", "more.yaml")
    output = more.stdout + more.stderr
    assert more.returncode == 0, output[-3000:]
    counts = job_counts(output)
    assert counts.get("decide_round", 0) >= 1, counts  # round 2 (no longer the last), and the new last, round 3
    assert "cell" not in counts and "top_up" not in counts and "server_spec" not in counts, counts
    assert "output: results/decisions/round1.json" not in output
    assert "output: results/decisions/round2.json" in output


def test_a_calibration_on_vllm_prices_its_configuration(verdict_run):
    # After the run (its servers stopped), one configuration calibrated by hand: one more server session.
    workdir, _ = verdict_run
    servegrid = str(Path(sys.executable).parent / "servegrid")
    calibrated = subprocess.run(
        [servegrid, "--config", "test.yaml", "calibrate", "first"], cwd=workdir, capture_output=True, text=True
    )
    assert calibrated.returncode == 0, calibrated.stderr[-3000:]
    done = calibration_file.read(workdir / paths.calibration_path("first"))
    (probe,) = done.probes  # the grid's one cell is its lightest and its heaviest
    assert (probe.mode, probe.context, probe.concurrency) == ("decode", 256, 1)
    assert probe.values and all(v > 0 for v in probe.values)  # decode tokens/s per session, as vLLM served them
    assert done.startup_s > 0 and probe.job_s > probe.measuring_s > 0
    assert leftovers(workdir) == []  # the calibration's session ended with it
    shown = subprocess.run(
        [servegrid, "--config", "test.yaml", "estimate"], cwd=workdir, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    rows = {line.split()[0]: line for line in shown.stdout.splitlines() if line.startswith(("first ", "twin "))}
    assert "calibration (decode ctx256 c1)" in rows["first"] and "calibration" not in rows["twin"], shown.stdout
