"""A replayed trace against the real vLLM CPU server (the shared one, tests/integration/conftest.py): a generated
trace with shared system prompts and conversations, at its own pace. Every request reaches the server with exactly
the trace's prompt length (the server's own count) and output, and the prefix-cache hit rate the server reports
is the trace's reuse counted in the server's 128-token blocks."""

from __future__ import annotations

import os

import pytest

from servegrid.analysis import aggregation
from servegrid.modes import trace_source
from servegrid.paths import RunTables
from servegrid.pipeline.cell_job import run_cell
from servegrid.records import cell_file, per_request
from servegrid.records.cell_spec import Replay
from servegrid.serving import procs

pytestmark = pytest.mark.vllm


def test_a_replayed_trace_on_vllm_is_token_exact_and_hits_the_cache_as_the_trace_reuses(vllm_server, tmp_path):
    experiment, _, runtime = vllm_server
    (cell,) = [c for c in experiment.cells() if isinstance(c.load, Replay)]
    assert cell.id == "both/trace/ctx0_x1"
    out = tmp_path / "trace.parquet"
    run_cell(experiment, cell, out, owner=procs.ProcessRef.of(os.getpid()), runtime=runtime)
    frame = per_request.derive(cell_file.read_cell(out)[0].to_pandas())
    measured = frame[frame["phase"] == "measured"]
    trace = trace_source.replayed(experiment.cell_workload(cell)).window
    assert len(measured) == len(trace.requests) and measured["valid"].all(), measured[["error"]]
    wanted = {(i, t): r for i, c in enumerate(trace.conversations) for t, r in enumerate(c.turns, start=1)}
    for r in measured.itertuples():  # the server's own count of each prompt, and the exact output
        want = wanted[(int(r.seq), int(r.turn))]
        assert (r.prompt_tokens_reported, r.output_tokens_reported) == (want.input_tokens, want.output_tokens)
    summary = aggregation.aggregate(experiment, [str(out)], RunTables.under(tmp_path / "tables"))
    (row,) = summary.to_dict("records")
    expected, measured_rate = row["expected_hit_rate"], row["server_prefix_cache_hit_rate"]
    assert expected > 0.15  # system prompts and conversations: the trace reuses a good part of its prompts
    # Within the cache's granularity: one 128-token block of the measured prompt tokens either way.
    block_share = 128 / measured["prompt_tokens_reported"].sum()
    assert abs(measured_rate - expected) <= max(block_share, 0.01), (measured_rate, expected)
    assert not row["cache_contradiction"] and row["speedup"] == 1 and row["load"] == "x1"
