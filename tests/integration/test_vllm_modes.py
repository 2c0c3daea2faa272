"""Each workload mode against the real vLLM CPU server: exact tokens, cache hits, speculation."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from servegrid import engines
from servegrid.pipeline.cell_job import run_cell
from servegrid.records import cell_file, per_request
from servegrid.serving import procs

pytestmark = pytest.mark.vllm


def measure(vllm_server, mode, tmp_path):  # type: ignore[no-untyped-def]
    experiment, facts, runtime = vllm_server
    (cell,) = [c for c in experiment.cells() if c.mode == mode and not c.open_loop]
    out = tmp_path / f"{mode}.parquet"
    meta = run_cell(experiment, cell, out, owner=procs.ProcessRef.of(os.getpid()), runtime=runtime)
    assert meta.server["session"] == facts.session  # the shared server was reused
    table, stored = cell_file.read_cell(out)
    frame = per_request.derive(table.to_pandas())
    return frame, stored


def measured(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["phase"] == "measured"]


def test_server_facts_are_recorded(vllm_server):
    experiment, facts, _ = vllm_server
    assert facts.engine == "vllm" and facts.engine_version == "0.32.0"
    assert facts.kv_cache_tokens and facts.kv_cache_tokens > 10_000
    assert facts.max_model_len == 8192
    assert 1 < facts.startup_s < 600
    both = experiment.configuration("both")
    flags = engines.get("vllm").feature_flags(both.prefix_caching, both.speculative)
    assert len(flags) == 3 and set(flags) <= set(facts.argv)  # prefix caching on, and the speculative config


def test_decode_is_token_exact_cold_and_speculative(vllm_server, tmp_path):
    frame, meta = measure(vllm_server, "decode", tmp_path)
    rows = measured(frame)
    assert len(rows) == 2 * 2  # concurrency x requests_per_session
    assert rows["valid"].all(), rows[["error", "prompt_tokens_reported", "output_tokens_reported"]]
    assert (rows["prompt_tokens_reported"] == 256).all()
    assert (rows["output_tokens_reported"] == 48).all()
    derived = meta.server_metrics["derived"]
    assert derived["prefix_cache_hit_rate"] < 0.05  # cold prompts
    assert derived["spec_acceptance_rate"] > 0  # greedy random weights cycle: ngram drafts accepted
    # Speculative chunks carry several tokens; per-token ITL is finer than the chunk gap.
    assert rows["tokens_per_chunk"].mean() > 1
    assert (frame[frame["phase"] == "warmup"]["valid"]).all()
    # vLLM counted exactly the client's requests between the phase's two scrapes: no foreign traffic reported
    # where there was none.
    assert meta.server_metrics["delta"]["time_to_first_token_seconds_count"] == meta.client["requests_in_window"]


def test_single_turn_reuses_the_shared_prefix(vllm_server, tmp_path):
    frame, meta = measure(vllm_server, "single_turn", tmp_path)
    rows = measured(frame)
    assert rows["valid"].all()
    assert (rows["prompt_tokens_reported"] == 1024 + 64).all()
    expected = 1024 / (1024 + 64)
    assert meta.server_metrics["derived"]["prefix_cache_hit_rate"] >= 0.8 * expected
    probe = frame[frame["phase"] == "probe"].sort_values("turn")
    assert len(probe) == 2 and probe["valid"].all()
    first, second = probe["ttft_s"].tolist()
    assert second < first  # the second request on a fresh prefix hits the cache


def test_multi_turn_grows_a_real_conversation(vllm_server, tmp_path):
    frame, meta = measure(vllm_server, "multi_turn", tmp_path)
    rows = measured(frame)
    assert sorted(rows["turn"].unique()) == [1, 2, 3]
    assert rows["valid"].all(), rows[["turn", "prompt_tokens_requested", "prompt_tokens_reported", "error"]]
    assert (rows.loc[rows["turn"] == 1, "prompt_tokens_reported"] == 512).all()
    by_turn = rows.groupby("turn")["prompt_tokens_reported"].mean()
    growth = by_turn.diff().dropna()
    assert ((growth > 100) & (growth < 200)).all(), by_turn  # ~tokens_per_turn (128) per turn
    assert meta.server_metrics["derived"]["prefix_cache_hit_rate"] > 0.3
