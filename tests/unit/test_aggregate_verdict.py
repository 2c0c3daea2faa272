"""Aggregation formulas, validity flags and the per-group verdict, on cells with known timings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers import synthetic_cell, with_changes
from servegrid.analysis import aggregation, summary_table, verdict
from servegrid.config import Experiment
from servegrid.paths import RunTables
from servegrid.records import per_request


@pytest.fixture
def demo_grid(tmp_path, monkeypatch, demo_raw):
    """The demo grid with synthetic cells: ngram decodes faster, caching prefills faster."""
    monkeypatch.chdir(tmp_path)
    return make_demo_grid(demo_raw, tmp_path)


def make_demo_grid(demo_raw, tmp_path):  # type: ignore[no-untyped-def]
    """demo_grid's cells under ``tmp_path``, the working directory (cell paths are relative to it)."""
    raw = with_changes(demo_raw)
    # Two of the demo's configurations: the report tests read their comparison (tests/unit/test_n_configurations.py
    # covers any number).
    raw["configurations"] = {name: raw["configurations"][name] for name in ("prefix_cache", "ngram")}
    # ngram's 2 ms per token meets it at every concurrency, prefix caching's 5 ms nowhere.
    raw["slo"] = {"decode": {"tpot_p90_ms": 4}}
    for mode, context in (("decode", 512), ("single_turn", 2048), ("multi_turn", 1024)):
        raw["workloads"][mode].update(contexts=[context], concurrency=[1, 4])  # a fixed grid, whatever the demo's
    experiment = Experiment(raw)
    timings = {
        ("prefix_cache", "decode"): {"ttft_s": 0.1, "interval_s": 0.005, "hit_rate": 0.0},
        ("ngram", "decode"): {"ttft_s": 0.1, "interval_s": 0.002, "tokens_per_chunk": 4},
        ("prefix_cache", "single_turn"): {"ttft_s": 0.05, "interval_s": 0.005, "hit_rate": 0.96},
        ("ngram", "single_turn"): {"ttft_s": 0.5, "interval_s": 0.002},
        ("prefix_cache", "multi_turn"): {"ttft_s": 0.1, "interval_s": 0.005, "turns": 3, "hit_rate": 0.7},
        ("ngram", "multi_turn"): {"ttft_s": 0.3, "interval_s": 0.002, "turns": 3},
    }
    for cell in experiment.cells():
        # 30 requests (conversations) a cell: the fewest the demo's p90 objectives are judged from.
        synthetic_cell(
            tmp_path / cell.path,
            cell.configuration,
            cell.mode,
            cell.context,
            cell.sessions,
            requests=30,
            **timings[(cell.configuration, cell.mode)],
        )
    return experiment, [c.path for c in experiment.cells()]


def run_aggregate(experiment, cells, tmp_path):
    tables = RunTables.under(tmp_path)
    aggregation.aggregate(experiment, cells, tables)
    return {name: pd.read_parquet(path) for name, path in tables.named().items()}


def test_per_request_formulas():
    frame = pd.DataFrame(
        {
            "sent_s": [0.0],
            "intended_send_s": [-0.01],
            "end_s": [1.1],
            "chunk_times_s": [[0.1, 0.4, 0.7, 1.0]],
            "chunk_tokens": [[1, 3, 3, 3]],
            "prompt_tokens_requested": [10],
            "prompt_tokens_reported": [10],
            "output_tokens_requested": [10],
            "output_tokens_reported": [10],
            "error": [None],
        }
    )
    row = per_request.derive(frame).iloc[0]
    assert row["ttft_s"] == pytest.approx(0.1)
    assert row["e2e_s"] == pytest.approx(1.1)
    assert row["tpot_s"] == pytest.approx(1.0 / 9)
    assert row["decode_tps"] == pytest.approx(9 / 1.0)
    assert row["send_delay_s"] == pytest.approx(0.01)
    assert bool(row["valid"])
    itl = per_request.per_token_itl(np.array([0.1, 0.4, 0.7, 1.0]), np.array([1, 3, 3, 3]))
    assert itl.tolist() == pytest.approx([0.1] * 9)


def test_summary_of_the_demo_grid(demo_grid, tmp_path):
    experiment, cells = demo_grid
    tables = run_aggregate(experiment, cells, tmp_path)
    summary = tables["summary"].set_index("cell_id")
    assert len(summary) == len(cells)
    decode = summary.loc["ngram/decode/ctx512_c1"]
    assert decode["primary_metric"] == "decode_tps"
    assert decode["primary_p50"] == pytest.approx(500, rel=0.01)  # 1 / 2 ms per token
    assert decode["itl_token_s_p50"] == pytest.approx(0.002, rel=0.01)
    assert decode["chunk_gap_s_p50"] == pytest.approx(0.008, rel=0.01)
    assert decode["tokens_per_chunk_mean"] == pytest.approx(32 / 9)  # 1 + 7 x 4 + 3 tokens in 9 chunks
    assert decode["primary_ci_low"] <= decode["primary_p50"] <= decode["primary_ci_high"]
    assert summary.loc["prefix_cache/decode/ctx512_c1", "primary_p50"] == pytest.approx(200, rel=0.01)
    multi = summary.loc["prefix_cache/multi_turn/ctx1024_c4"]
    assert multi["primary_metric"] == "ttft_s@turn2"
    assert multi["primary_n"] == 30 and multi["n_requests"] == 90  # one turn-2 request per conversation
    # Honest tails: 30 samples give a p90, not a p99 (which needs 300); no sampling rule, no precision target.
    assert decode["ttft_s_p90"] is not None and pd.isna(decode["ttft_s_p99"]) and pd.isna(decode["e2e_s_p99"])
    assert pd.isna(decode["sampling_target_rel_ci"]) and pd.isna(decode["precise"])
    low, high, median = decode["primary_ci_low"], decode["primary_ci_high"], decode["primary_p50"]
    assert decode["primary_rel_ci"] == pytest.approx(max(median - low, high - median) / median)
    assert summary["valid"].all()
    assert list(summary["configuration"].unique()) == ["prefix_cache", "ngram"]  # config order
    servers = tables["servers"]
    assert set(servers["configuration"]) == {"prefix_cache", "ngram"}
    assert servers["cells"].sum() == len(cells)


def test_comparisons_name_winner_factor_and_interval(demo_grid, tmp_path):
    experiment, cells = demo_grid
    comparisons = run_aggregate(experiment, cells, tmp_path)["comparisons"]
    assert len(comparisons) == 6  # 3 modes x 1 context x 2 concurrencies
    by = comparisons.set_index(["mode", "concurrency"])
    assert by.loc[("decode", 1), "winner"] == "ngram"
    assert by.loc[("decode", 1), "factor"] == pytest.approx(2.5, rel=0.02)
    assert by.loc[("single_turn", 4), "winner"] == "prefix_cache"
    assert by.loc[("single_turn", 4), "factor"] == pytest.approx(10, rel=0.1)
    assert by.loc[("multi_turn", 1), "winner"] == "prefix_cache"
    assert not comparisons["tie"].any()
    low, high = by.loc[("decode", 1), ["factor_ci_low", "factor_ci_high"]]
    assert low <= by.loc[("decode", 1), "factor"] <= high


def decode_only(demo_raw) -> Experiment:  # type: ignore[no-untyped-def]
    """Two of the demo's configurations on one decode cell each."""
    raw = with_changes(demo_raw, **{"workloads.decode.concurrency": [1], "workloads.decode.contexts": [512]})
    raw["configurations"] = {name: raw["configurations"][name] for name in ("prefix_cache", "ngram")}
    raw["workloads"]["single_turn"]["enabled"] = False
    raw["workloads"]["multi_turn"]["enabled"] = False
    return Experiment(raw)


def test_overlapping_results_are_a_tie(tmp_path, monkeypatch, demo_raw):
    monkeypatch.chdir(tmp_path)
    experiment = decode_only(demo_raw)
    for cell in experiment.cells():
        interval = 0.005 if cell.configuration == "ngram" else 0.00505  # 1% apart, 30% scatter
        synthetic_cell(
            tmp_path / cell.path,
            cell.configuration,
            cell.mode,
            cell.context,
            1,
            ttft_s=0.1,
            interval_s=interval,
            interval_spread=0.3,
            requests=8,
        )
    comparisons = run_aggregate(experiment, [c.path for c in experiment.cells()], tmp_path)["comparisons"]
    assert len(comparisons) == 1
    row = comparisons.iloc[0]
    assert row["factor_ci_low"] < 1.0 < row["factor_ci_high"]
    assert bool(row["tie"])


def test_mismatches_and_errors_invalidate_a_cell_and_keep_it_out_of_the_verdict(tmp_path, monkeypatch, demo_raw):
    monkeypatch.chdir(tmp_path)
    experiment = decode_only(demo_raw)
    bad, good = experiment.cells()
    synthetic_cell(tmp_path / bad.path, bad.configuration, "decode", 512, 1, ttft_s=0.1, interval_s=0.001, mismatched=2)
    synthetic_cell(tmp_path / good.path, good.configuration, "decode", 512, 1, ttft_s=0.1, interval_s=0.004, errors=1)
    tables = run_aggregate(experiment, [bad.path, good.path], tmp_path)
    summary = tables["summary"].set_index("configuration")
    assert summary.loc[bad.configuration, "n_token_mismatch"] == 2
    assert summary.loc[good.configuration, "n_errors"] == 1
    assert not summary["valid"].any()
    assert tables["comparisons"].empty
    requests = tables["requests"]
    assert (~requests["prompt_tokens_ok"]).sum() == 2


def test_verdict_primary_values_filter_turn_and_validity(demo_grid, tmp_path):
    experiment, cells = demo_grid
    requests = run_aggregate(experiment, cells, tmp_path)["requests"]
    values = verdict.values_of_cell(requests, "ngram", "multi_turn", 1024, 4)
    assert len(values) == 30
    assert np.median(values) == pytest.approx(0.3, rel=0.06)


def test_expected_hit_rates_per_mode(demo_grid, tmp_path):
    experiment, cells = demo_grid
    summary = run_aggregate(experiment, cells, tmp_path)["summary"].set_index("cell_id")
    assert summary.loc["prefix_cache/decode/ctx512_c1", "expected_hit_rate"] == 0
    assert summary.loc["prefix_cache/single_turn/ctx2048_c1", "expected_hit_rate"] == pytest.approx(2048 / 2112)
    # synthetic turns all have 1024-token prompts: turns 2 and 3 find 1024 cached tokens each
    assert summary.loc["prefix_cache/multi_turn/ctx1024_c1", "expected_hit_rate"] == pytest.approx(2 / 3)
    assert summary.loc["ngram/single_turn/ctx2048_c4", "expected_hit_rate"] == 0  # caching off
    assert not summary["cache_contradiction"].any()
    assert (summary["cache_state"] == "reset").all()


@pytest.mark.parametrize(
    ("configuration", "mode", "hit_rate"),
    [("prefix_cache", "single_turn", 0.1), ("prefix_cache", "decode", 0.5), ("ngram", "single_turn", 0.9)],
)
def test_a_contradicting_hit_rate_invalidates_the_cell(tmp_path, monkeypatch, demo_raw, configuration, mode, hit_rate):
    monkeypatch.chdir(tmp_path)
    experiment = Experiment(demo_raw)
    cell = experiment.cell(configuration, mode, experiment.workload(mode).contexts[0], 1)
    synthetic_cell(
        tmp_path / cell.path, configuration, mode, cell.context, 1, ttft_s=0.1, interval_s=0.01, hit_rate=hit_rate
    )
    row = run_aggregate(experiment, [cell.path], tmp_path)["summary"].iloc[0]
    assert bool(row["cache_contradiction"])
    assert not bool(row["valid"])
    assert "contradicts the expected" in row["invalid_reasons"]


def test_a_failed_warm_up_invalidates_the_cell(tmp_path, monkeypatch, demo_raw):
    """A warm-up that failed may have left the shared prefix unprimed: the cell is not comparable."""
    monkeypatch.chdir(tmp_path)
    experiment = Experiment(demo_raw)
    cell = experiment.cell("prefix_cache", "single_turn", 1024, 1)
    synthetic_cell(
        tmp_path / cell.path,
        "prefix_cache",
        "single_turn",
        1024,
        1,
        ttft_s=0.1,
        interval_s=0.01,
        hit_rate=0.9,
        warmup_errors=1,
    )
    row = run_aggregate(experiment, [cell.path], tmp_path)["summary"].iloc[0]
    assert row["n_unmeasured_errors"] == 1 and row["n_errors"] == 0
    assert not bool(row["valid"])
    assert "1 warm-up or probe requests failed" in row["invalid_reasons"]


@pytest.mark.parametrize(("preemptions", "kv_usage_max", "limited"), [(0, 0.5, False), (3, 0.5, True), (0, 0.99, True)])
def test_kv_limited_cells_are_marked(tmp_path, monkeypatch, demo_raw, preemptions, kv_usage_max, limited):
    monkeypatch.chdir(tmp_path)
    experiment = Experiment(demo_raw)
    cell = experiment.cell("ngram", "multi_turn", 1024, 4)
    synthetic_cell(
        tmp_path / cell.path,
        "ngram",
        "multi_turn",
        1024,
        4,
        ttft_s=0.1,
        interval_s=0.01,
        turns=3,
        preemptions=preemptions,
        kv_usage_max=kv_usage_max,
    )
    row = run_aggregate(experiment, [cell.path], tmp_path)["summary"].iloc[0]
    assert bool(row["kv_limited"]) is limited
    assert row["peak_tokens_asked"] == 4 * (1024 + 32)


def test_requests_queued_while_the_cells_live_tokens_exceed_the_pool_are_kv_limited_whatever_usage_was_sampled():
    """vLLM's 'capacity' waiting reason also counts a full token budget, so queueing alone is not enough;
    queueing while the cell's live tokens cannot all fit the pool is, even where the 1-s gauge samples
    missed the peak usage (a demo cell: 69% sampled, 4 x 2,618 tokens asked of 9,216)."""
    row = {
        "server_kv_cache_usage_perc_max": 0.69,
        "server_num_requests_waiting_capacity_max": 1.0,
        "server_preemptions": 0.0,
        "kv_cache_tokens": 9216,
        "peak_tokens_asked": 10472,
    }
    assert summary_table.kv_limited(row, concurrency=4)
    assert not summary_table.kv_limited({**row, "server_num_requests_waiting_capacity_max": 0.0}, concurrency=4)
    assert not summary_table.kv_limited({**row, "peak_tokens_asked": 4000}, concurrency=4)  # it fits: queued for else


def test_each_cell_is_resampled_once_with_a_seed_of_its_own_and_its_ratio_interval_covers_the_true_ratio():
    rng = np.random.default_rng(7)
    slow, fast = rng.lognormal(np.log(0.3), 0.2, 60), rng.lognormal(np.log(0.1), 0.2, 60)
    rows = [
        {
            "configuration": name,
            "mode": "single_turn",
            "context": 1024,
            "concurrency": 4,
            "phase": "measured",
            "valid": True,
            "turn": 1,
            "ttft_s": value,
        }
        for name, values in (("a", slow), ("b", fast), ("c", fast))
        for value in values
    ]
    samples = verdict.CellSamples(pd.DataFrame(rows))
    a, b, c = ((name, "single_turn", 1024, 4) for name in "abc")
    low, high = samples.ratio_ci(a, b)
    assert low < 3.0 < high and high / low < 1.5  # the true ratio of medians is 3
    assert samples.medians(a) is samples.medians(a)  # made once, however many duels read it
    # Cells with the same values are resampled independently (a shared seed would make their ratio exactly 1).
    assert not np.array_equal(samples.medians(b), samples.medians(c))
    low, high = samples.ratio_ci(b, c)
    assert low < 1.0 < high
    # The same tables on every run: the seed comes from the cell, not from the process.
    assert np.array_equal(verdict.CellSamples(pd.DataFrame(rows)).medians(a), samples.medians(a))
    assert samples.ratio_ci(a, ("d", "single_turn", 1024, 4)) == (None, None)  # no such cell: no interval


def test_the_run_summary_names_each_class_winner_the_invalid_cells_and_the_reports(demo_grid, tmp_path):
    from servegrid import paths
    from servegrid.reporting import terminal_summary

    experiment, cells = demo_grid
    assert terminal_summary.text(experiment).startswith("servegrid: no tables yet")
    bad = next(c for c in experiment.cells() if c.configuration == "ngram" and c.mode == "decode")
    synthetic_cell(tmp_path / bad.path, "ngram", "decode", 512, bad.sessions, ttft_s=0.1, interval_s=0.002, errors=2)
    Path(paths.SUMMARY_TABLE).parent.mkdir(parents=True)
    aggregation.aggregate(experiment, cells, RunTables())
    Path(paths.REPORT_PATTERN.format(lang="hu", ext="html")).parent.mkdir(parents=True)
    Path(paths.REPORT_PATTERN.format(lang="hu", ext="html")).write_text("<html></html>")
    lines = terminal_summary.text(experiment).splitlines()
    assert lines[0].startswith("servegrid: 12 cells, 1 invalid, 0 imprecise")
    rows = {line[:26].strip(): line[26:].split() for line in lines[5:8]}
    assert rows["Decode, cold prompts"][:2] == ["wins", "ngram"]  # the other concurrency level still compares
    assert rows["Single-turn, shared prefix"][:2] == ["wins", "prefix_cache"]
    low, high = (float(x) for x in rows["Single-turn, shared prefix"][2].rstrip("x").split("-"))
    assert 9.5 < low <= high < 10.5  # the synthetic cells' factor of 10
    assert rows["Multi-turn, turn-2 TTFT"][:2] == ["wins", "prefix_cache"]
    assert f"  {bad.id}: 2 failed requests" in lines
    assert lines[-2:] == ["Reports:", f"  {paths.REPORT_PATTERN.format(lang='hu', ext='html')}"]
