"""Exports other tools read: each cell as a `vllm bench serve` result, checked with upstream's own reader."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pandas as pd
import pytest
from test_aggregate_verdict import demo_grid, run_aggregate  # noqa: F401 - the fixture is reused

from helpers import REPO
from servegrid.reporting import interchange

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def test_each_cell_reads_as_a_vllm_bench_result_in_upstreams_own_reader(demo_grid, tmp_path):  # noqa: F811
    if not VLLM_PYTHON.exists():
        pytest.skip("vLLM's environment (.venv-vllm) is not set up: run `make setup`")
    experiment, cells = demo_grid
    tables = run_aggregate(experiment, cells, tmp_path)
    out = tmp_path / "vllm-bench"
    interchange.write_bench_results(tables["requests"], tables["summary"], "tiny-qwen3", out)
    reader = REPO / "tests" / "helpers" / "read_bench_results.py"
    result = subprocess.run(
        [str(VLLM_PYTHON), str(reader), str(out), str(tmp_path / "figures")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Group: {'mode': 'decode'}" in result.stdout  # upstream grouped the runs it found
    runs = json.loads(result.stdout.split("RUNS ", 1)[1])
    summary = tables["summary"]
    assert sorted(runs) == sorted(summary["mode"].unique())
    for mode, mode_runs in runs.items():
        cells_of_mode = summary[summary["mode"] == mode].set_index(["configuration", "concurrency"])
        assert len(mode_runs) == len(cells_of_mode)
        for run in mode_runs:
            cell = cells_of_mode.loc[(run["configuration"], run["max_concurrency"])]
            assert run["label"] == cell["cell_id"] and run["model_id"] == "tiny-qwen3"
            assert run["completed"] == cell["n_valid"] and run["failed"] == 0
            assert run["request_throughput"] == pytest.approx(cell["n_valid"] / cell["duration_s"])
            assert run["median_ttft_ms"] == pytest.approx(cell["ttft_s_p50"] * 1000)
            assert run["median_e2el_ms"] == pytest.approx(cell["e2e_s_p50"] * 1000)
            # Upstream's ITL is the gap between chunks (servegrid's chunk_gap_s), not the per-token ITL.
            assert run["median_itl_ms"] == pytest.approx(cell["chunk_gap_s_p50"] * 1000)
            assert math.isinf(run["request_rate"])  # "inf" as upstream writes it, read back as a float
    ngram = next(r for r in runs["decode"] if r["configuration"] == "ngram")
    assert ngram["median_itl_ms"] > 3 * ngram["median_tpot_ms"]  # four tokens a chunk


def test_the_tables_as_csv_keep_every_column_and_the_chunk_lists(demo_grid, tmp_path):  # noqa: F811
    experiment, cells = demo_grid
    tables = run_aggregate(experiment, cells, tmp_path)
    interchange.write_csv(tables["requests"], tmp_path / "requests.csv")
    back = pd.read_csv(tmp_path / "requests.csv")
    assert list(back.columns) == list(tables["requests"].columns)
    first = tables["requests"].iloc[0]
    assert json.loads(back.loc[0, "chunk_tokens"]) == [int(t) for t in first["chunk_tokens"]]
    assert back["ttft_s"].tolist() == pytest.approx(tables["requests"]["ttft_s"].tolist(), nan_ok=True)
