"""An open-loop cell against the real vLLM CPU server (the shared one, tests/integration/conftest.py): 4 requests/s
on a Poisson schedule, a 1 s ramp, 16 measured arrivals. Token-exact, sent on schedule, and summarised as a rate."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from servegrid.analysis import aggregation
from servegrid.paths import RunTables
from servegrid.pipeline.cell_job import run_cell
from servegrid.records import cell_file, per_request
from servegrid.records.cell_spec import Rate
from servegrid.serving import procs

pytestmark = pytest.mark.vllm


def test_an_open_loop_cell_on_vllm_is_token_exact_on_schedule_and_summarised_as_a_rate(vllm_server, tmp_path):
    experiment, facts, runtime = vllm_server
    (cell,) = [c for c in experiment.cells() if isinstance(c.load, Rate)]
    assert cell.id == "both/decode/ctx256_r4"
    out = tmp_path / "open.parquet"
    meta = run_cell(experiment, cell, out, owner=procs.ProcessRef.of(os.getpid()), runtime=runtime)
    assert meta.server["session"] == facts.session  # the shared server, reused
    frame = per_request.derive(cell_file.read_cell(out)[0].to_pandas())
    measured = frame[frame["phase"] == "measured"]
    assert len(measured) == 16 and measured["valid"].all(), measured[["error", "output_tokens_reported"]]
    assert (measured["prompt_tokens_reported"] == 256).all() and (measured["output_tokens_reported"] == 48).all()
    assert (frame["phase"] == "ramp").sum() >= 1  # the Poisson schedule's first second
    # Sent when due: the client kept the schedule (its own limit is validity.max_send_delay_s; here a wider one,
    # the shared host runs the server on the same cores).
    assert measured["send_delay_s"].max() < 0.1, measured["send_delay_s"].describe()
    (run,) = meta.open_loop
    assert not run["saturated"] and run["not_sent"] == 0
    summary = aggregation.aggregate(experiment, [str(out)], RunTables.under(tmp_path / "tables"))
    (row,) = summary.to_dict("records")
    assert (row["load"], row["offered_rate"], row["arrival_pattern"]) == ("r4", 4.0, "poisson")
    assert row["n_requests"] == 16 and row["primary_n_effective"] is not None
    assert 1.0 <= row["ramp_s"] < 3.0  # the first measured arrival: the first one due after the 1 s ramp
    assert not pd.isna(row["achieved_rate"]) and row["achieved_rate"] > 0
    assert row["primary_ci_low"] is None or pd.isna(row["primary_ci_low"])  # 16 samples: under 5 batches of 6
