"""servegrid estimate: the sampling rule's floor and ceiling, the grid, the device groups, and an earlier run's
measured cells (the check that a real run lands inside the range is the demo's: docs/gpu-host.md)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from helpers import with_changes
from servegrid.config import CellSpec, Experiment
from servegrid.errors import ConfigError
from servegrid.pipeline import cli
from servegrid.planning import estimate
from servegrid.records.cell_spec import Sessions


def test_a_cells_rounds_come_from_the_sampling_rule(seed_raw):
    seed = Experiment(seed_raw)
    assert estimate.rounds(seed, CellSpec("mtp", "decode", 1024, Sessions(1))) == (30, 300, 1800.0)
    assert estimate.rounds(seed, CellSpec("mtp", "decode", 1024, Sessions(32))) == (1, 10, 1800.0)  # 32 samples a round
    fixed = Experiment(
        with_changes(seed_raw, **{"sampling": {"temperature": 0.0}, "workloads.decode.requests_per_session": 7})
    )
    assert estimate.rounds(fixed, CellSpec("mtp", "decode", 1024, Sessions(4)))[:2] == (7, 7)


def test_without_an_earlier_run_the_range_spans_the_assumed_speeds_and_the_rule(seed_raw, tmp_path):
    seed = Experiment(seed_raw)
    est = estimate.estimate(seed, tmp_path)  # no results there
    by_id = {c.cell.id: c for c in est.cells}
    assert len(by_id) == len(seed.cells()) and {c.basis for c in est.cells} == {"assumed"}
    one = by_id["mtp/decode/ctx1024_c1"]
    # 30 rounds of one 1K-token prompt and 512 output tokens at the fast end; at the slow end 300 rounds would
    # take longer than the cell may measure, so the limit plus the round in flight.
    fast = 1024 / 20000 + 512 / 100
    slow = 1024 / 2000 + 512 / 15
    assert one.measuring.low == pytest.approx(30 * fast)
    assert one.measuring.high == pytest.approx(min(300 * slow, 1800 + slow))
    # Prefix caching prices a multi-turn conversation's later turns at their new tokens only.
    cached = by_id["prefix_cache/multi_turn/ctx65536_c1"].measuring
    uncached = by_id["mtp/multi_turn/ctx65536_c1"].measuring
    assert cached.low < uncached.low


def test_configurations_sharing_a_gpu_run_one_after_another(seed_raw, tmp_path):
    est = estimate.estimate(Experiment(seed_raw), tmp_path)
    assert sorted(sorted(g) for g in est.groups) == [["mtp"], ["mtp_prefix_cache", "prefix_cache"]]
    one, two = est.wall_clock(1), est.wall_clock(2)
    assert two.low < one.low and two.high < one.high
    assert est.wall_clock(3) == two  # a third lane has nothing to run
    gpu_hours = sum(est.device_hours(n).high for n in est.gpus)
    assert gpu_hours == pytest.approx((one.high - est.run_overhead.high) / 3600)  # one GPU each


def test_an_earlier_run_gives_the_time_of_a_round(demo_raw, tmp_path):
    demo = Experiment(demo_raw)
    tables = tmp_path / "tables"
    tables.mkdir()
    pd.DataFrame(
        [
            {
                "configuration": "ngram",
                "mode": "decode",
                "context": 512,
                "concurrency": 1,
                "duration_s": 4.0,
                "primary_n": 40,
                "started_at": "2026-12-04T10:00:00+00:00",
            },
        ]
    ).to_parquet(tables / "summary.parquet")
    est = estimate.estimate(demo, tmp_path)
    by_id = {c.cell.id: c for c in est.cells}
    exact = by_id["ngram/decode/ctx512_c1"]
    fewest, most, limit = estimate.rounds(demo, exact.cell)
    assert exact.basis == "this cell, earlier run"
    assert exact.measuring == estimate.Range(fewest * 0.1, min(most * 0.1, limit + 0.1))
    near = by_id["ngram/decode/ctx512_c4"]
    assert near.basis == "nearest cell, earlier run"
    speed = {"decode": demo.estimate["decode_tokens_per_s"][0], "prefill": demo.estimate["prefill_tokens_per_s"][0]}
    ratio = estimate.unit_seconds(demo, near.cell, speed) / estimate.unit_seconds(demo, exact.cell, speed)
    assert near.measuring.low == pytest.approx(estimate.rounds(demo, near.cell)[0] * 0.1 * ratio)
    assert by_id["prefix_cache/decode/ctx512_c1"].basis == "assumed"  # another configuration: not borrowed


def test_a_range_the_wrong_way_round_is_refused_naming_the_key(seed_raw):
    with pytest.raises(ConfigError, match=r"estimate\.startup_s: \[900, 60\]"):
        Experiment(with_changes(seed_raw, **{"estimate.startup_s": [900, 60]}))


def test_the_cli_prints_the_range_and_the_cores_advice(capsys):
    assert cli.main(["estimate", "--results", "/nonexistent"]) == 0
    out = capsys.readouterr().out
    assert "GPU hours in all" in out
    assert "wall clock with --cores 2:" in out and "(advised: one job per device group)" in out
    assert math.isfinite(float(out.split("GPU hours in all (server start-ups included): ")[1].split("-")[0]))


def test_repeats_multiply_the_rounds_and_another_servers_cells_are_not_borrowed(demo_raw, tmp_path):
    fixed = {
        "sampling": {"temperature": 0.0},
        "workloads.decode.requests_per_session": 5,
        "workloads.decode.duration_s": 2.0,
    }
    once = estimate.rounds(Experiment(with_changes(demo_raw, **fixed)), CellSpec("ngram", "decode", 512, Sessions(1)))
    assert once == (5, 5, 2.0)
    demo = Experiment(with_changes(demo_raw, **fixed, **{"workloads.decode.repeats": 3}))
    assert estimate.rounds(demo, CellSpec("ngram", "decode", 512, Sessions(1))) == (15, 15, 6.0)
    tables = tmp_path / "tables"
    tables.mkdir()
    pd.DataFrame(
        [
            {
                "configuration": "ngram",
                "mode": "decode",
                "context": 512,
                "concurrency": 1,
                "duration_s": 4.0,
                "primary_n": 40,
                "started_at": "2026-12-04T10:00:00+00:00",
                "spec_hash": "another server",
            },
        ]
    ).to_parquet(tables / "summary.parquet")
    assert {c.basis for c in estimate.estimate(demo, tmp_path).cells} == {"assumed"}


def test_under_the_verdict_policy_a_cell_costs_its_first_pass_to_every_round_of_top_ups(seed_raw, tmp_path):
    precision = estimate.estimate(Experiment(seed_raw), tmp_path)
    verdict = estimate.estimate(
        Experiment(with_changes(seed_raw, **{"sampling.policy": "verdict", "sampling.top_up_rounds": 3})), tmp_path
    )
    before = {c.cell.id: c for c in precision.cells}["mtp/decode/ctx1024_c1"]
    after = {c.cell.id: c for c in verdict.cells}["mtp/decode/ctx1024_c1"]
    slow = 1024 / 2000 + 512 / 15
    assert after.measuring.low == before.measuring.low  # 30 samples: the first pass, as the precise case's least
    assert after.measuring.high == pytest.approx(4 * 30 * slow)  # the first pass and three top-ups, 30 samples each
    assert after.overhead.high == pytest.approx(4 * before.overhead.high)
    assert "up to 3 top-ups" in after.basis
