"""Sequential sampling end to end: a cell against the calibration server stops as soon as its primary figure is
precise, runs to its ceiling when it is not, counts samples (not requests), and keeps to its time limit.

The calibration server stands in for the engine (its latencies can be made tight or spread on demand); the
same rule on real vLLM runs in the CPU demo and tests/integration.
"""

from __future__ import annotations

import itertools
import os

import pandas as pd
import pytest
from test_cell_flags import calibration_experiment

from servegrid.analysis import aggregation
from servegrid.config import Experiment
from servegrid.errors import ConfigError
from servegrid.paths import RunTables
from servegrid.pipeline.cell_job import run_cell
from servegrid.serving import procs

pytestmark = pytest.mark.exclusive  # sequential sampling stops on measured spreads

RULE = {"target_rel_ci": 0.05, "min_samples": 8, "max_samples": 24, "max_duration_s": 60}


def sequential(mode: str, workload: dict, rule: dict = RULE, server_args: tuple[str, ...] = ()) -> Experiment:  # type: ignore[type-arg]
    raw = calibration_experiment().raw
    raw["configurations"] = {"honest": {"label": "honest", "prefix_caching": True, "args": list(server_args)}}
    raw["workloads"] = {mode: workload}
    raw["sampling"] = {"temperature": 0.0, **rule}
    return Experiment(raw)


def measure(experiment: Experiment, sandbox, tmp_path) -> tuple[pd.Series, dict]:  # type: ignore[no-untyped-def, type-arg]
    (cell,) = experiment.cells("honest")
    meta = run_cell(experiment, cell, cell.path, owner=procs.ProcessRef.of(os.getpid()), runtime=sandbox)
    tables = RunTables.under(tmp_path)
    aggregation.aggregate(experiment, [cell.path], tables)
    return pd.read_parquet(tables.summary).iloc[0], meta


DECODE = {"contexts": [32], "concurrency": [2], "output_tokens": 20, "warmup_requests": 1}
# Five tokens, four gaps: a request's decode speed varies about twice as much as over 20 tokens (~25%), so that
# 24 samples stay clearly short of ±5% however the host's timers smooth the gaps (with 20 tokens, a clean-clone run
# on 2026-12-04 judged ±4.8% at 24 samples and stopped precise).
SPREAD = {**DECODE, "output_tokens": 5}


def test_tight_latencies_stop_at_the_first_stage_as_precise(sandbox, tmp_path):
    """5 ms between tokens, no jitter: decode speed varies by well under 5%, so 8 samples are enough."""
    row, meta = measure(sequential("decode", DECODE), sandbox, tmp_path)
    assert row["sampling_reason"] == "precise" and bool(row["precise"]), meta.sampling
    assert row["primary_n"] == row["n_requests"] == 8  # the first stage: 8 samples, 4 rounds of 2 sessions
    assert row["primary_rel_ci"] <= 0.05 and row["sampling_target_rel_ci"] == 0.05
    stages = meta.sampling["stages"]
    assert [(s["rounds"], s["n_before"], s["n_after"]) for s in stages] == [(4, 0, 8)]
    assert bool(row["valid"]), row["invalid_reasons"]


def test_spread_latencies_run_stage_by_stage_to_the_ceiling_and_are_marked_imprecise(sandbox, tmp_path):
    """Each inter-token gap uniform in 0.1-9.9 ms: over four gaps a request's decode speed varies by ~25%, and 24
    samples leave the 99% interval of the median well over ±5% wide: the cell stops at max_samples, imprecise but
    valid.

    The stop is judged on the 99% interval; the reported 95% one lies inside it and may itself be within the
    target by chance (a clean-clone CI run on 2026-12-01 drew 3.7%), so only the judged width is asserted."""
    experiment = sequential("decode", SPREAD, server_args=("--jitter", "0.0049"))
    row, meta = measure(experiment, sandbox, tmp_path)
    assert row["sampling_reason"] == "max_samples" and not bool(row["precise"]), meta.sampling
    assert row["primary_n"] == row["n_requests"] == 24
    judged = meta.sampling["stop_rel_half_width"]
    assert judged > 0.05 and row["primary_rel_ci"] <= judged
    stages = meta.sampling["stages"]
    assert [s["n_after"] for s in stages] == [8, 12, 18, 24]  # judged at each stage target only
    assert [s["rounds"] for s in stages] == [4, 2, 3, 3]
    assert all(a["end_s"] <= b["start_s"] for a, b in itertools.pairwise(stages))
    assert meta.duration_s == pytest.approx(sum(s["end_s"] - s["start_s"] for s in stages))
    assert bool(row["valid"]), row["invalid_reasons"]
    # Honest tails: 24 samples give a median, not a p90 (30) or a p99 (300).
    assert row["decode_tps_p50"] > 0 and pd.isna(row["decode_tps_p90"]) and pd.isna(row["decode_tps_p99"])


def test_multi_turn_counts_conversations_not_requests(sandbox, tmp_path):
    workload = {"contexts": [128], "concurrency": [2], "turns": 3, "tokens_per_turn": 64, "output_tokens": 8}
    rule = {**RULE, "target_rel_ci": 1e-6, "max_samples": 12}  # never precise: two stages, 8 then 12
    row, meta = measure(sequential("multi_turn", workload, rule), sandbox, tmp_path)
    assert row["sampling_reason"] == "max_samples", meta.sampling
    assert row["primary_n"] == 12 and row["n_requests"] == 3 * 12  # one turn-2 sample per conversation
    assert [s["n_after"] for s in meta.sampling["stages"]] == [8, 12]


def test_a_shared_prefix_stays_cached_from_stage_to_stage(sandbox, tmp_path):
    """Each stage builds its prompts anew: on the same prefix, so every measured request finds it cached."""
    workload = {"contexts": [256], "concurrency": [2], "suffix_tokens": 16, "output_tokens": 4}
    rule = {**RULE, "target_rel_ci": 1e-6, "max_samples": 16}
    row, meta = measure(sequential("single_turn", workload, rule), sandbox, tmp_path)
    assert [s["n_after"] for s in meta.sampling["stages"]] == [8, 12, 16]
    assert row["server_prefix_cache_hit_rate"] >= row["expected_hit_rate"] > 0.9
    assert not bool(row["cache_contradiction"]) and bool(row["valid"]), row["invalid_reasons"]


def test_the_time_limit_stops_a_cell_below_its_floor(sandbox, tmp_path):
    """~1 s a request (20 tokens, 50 ms apart): 1.5 s lets each session start two, fewer than the floor of 8."""
    experiment = sequential("decode", DECODE, {**RULE, "max_duration_s": 1.5}, ("--interval", "0.05"))
    row, meta = measure(experiment, sandbox, tmp_path)
    assert row["sampling_reason"] == "max_duration" and not bool(row["precise"]), meta.sampling
    assert 2 <= row["primary_n"] <= 4
    requests = pd.read_parquet(experiment.cells()[0].path)
    assert requests.loc[requests["phase"] == "measured", "sent_s"].max() < 1.5
    assert pd.isna(row["primary_p50"]) and pd.isna(row["primary_ci_low"])  # fewer than 6: no median reported


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        ({"requests_per_session": 3}, r"workloads\.decode\.requests_per_session: a fixed count or time limit"),
        ({"duration_s": 10}, r"workloads\.decode\.duration_s: .* set sampling\.max_duration_s"),
        ({"repeats": 2}, r"workloads\.decode\.repeats: 2 repeats with sequential sampling"),
        ({"sampling": {"min_samples": 4}}, r"workloads\.decode\.sampling\.min_samples must be an integer >= 8"),
        ({"sampling": {"max_samples": 6}}, r"workloads\.decode\.sampling\.max_samples must be an integer >= 8"),
    ],
)
def test_settings_that_contradict_sequential_sampling_are_refused_by_key(workload, message):
    with pytest.raises(ConfigError, match=message):
        sequential("decode", {**DECODE, **workload})


def test_a_mode_may_sample_by_its_own_rule_and_a_fixed_count_stays_possible():
    experiment = sequential("decode", {**DECODE, "sampling": {"max_samples": 40, "max_duration_s": 5}})
    rule = experiment.sampling_rules["decode"]
    assert rule is not None and (rule.min_samples, rule.max_samples, rule.max_duration_s) == (8, 40, 5)
    settings = experiment.cell_settings(experiment.cells()[0])
    assert settings["sampling"]["rule"]["max_samples"] == 40  # part of the cell's identity: editing it reruns
    assert "requests_per_session" not in settings["workload"]  # a default that no longer shapes the cell
    fixed = sequential("decode", {**DECODE, "requests_per_session": 3}, rule={"target_rel_ci": None})
    assert fixed.sampling_rules["decode"] is None
    assert fixed.cell_settings(fixed.cells()[0])["sampling"]["rule"] is None


def test_a_stage_plans_counts_only_its_running_time_and_stops_when_a_stage_adds_nothing():
    from servegrid import modes
    from servegrid.load.stages import StagePlan
    from servegrid.stats.sampling import SamplingRule

    rule = SamplingRule(target_rel_ci=0.05, min_samples=8, max_samples=24, max_duration_s=10)
    plan = StagePlan(concurrency=2, primary=modes.get("decode").primary, rule=rule)
    assert plan.next_rounds([], 0.0) == 4  # 8 samples in rounds of 2
    plan.stage_started(0.5)  # its prompts took half a second to build: not measuring time
    plan.stage_ended(2.0)
    assert plan.active_s == 1.5
    assert plan.next_rounds([], 2.1) == 0 and plan.reason == "no_samples"  # every request failed: stop
    late = StagePlan(concurrency=2, primary=modes.get("decode").primary, rule=rule)
    late.next_rounds([], 0.0)
    late.time_up()  # the limit passed while the cell was judged: the planned stage never runs
    assert late.stages == [] and late.reason == "max_duration" and late.active_s == 0


def test_a_cell_says_where_the_grid_and_each_stage_stand(sandbox, tmp_path, caplog, monkeypatch):
    from servegrid import progress

    monkeypatch.setattr(progress, "INTERVAL_S", 0.05)  # the in-stage line, every 10 s in a real run
    experiment = sequential("decode", SPREAD, server_args=("--jitter", "0.0049"))
    with caplog.at_level("INFO"):
        measure(experiment, sandbox, tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    (cell,) = experiment.cells("honest")
    assert f"grid: 0 of 1 cells measured, starting {cell.id}" in lines
    stage_ends = [line for line in lines if line.startswith(f"cell {cell.id}: stage ") and " samples in " in line]
    assert [line.split(" done, ")[1].split(" samples")[0] for line in stage_ends] == ["8", "12", "18", "24"]
    assert "target ±5%" in stage_ends[0] and stage_ends[0].endswith("next stage: 2 round(s) of 2 session(s)")
    assert stage_ends[-1].endswith("stops: max_samples")
    ticks = [line for line in lines if line.startswith(f"cell {cell.id}: stage 1: ") and "requests done" in line]
    assert ticks and all(" of 8 requests done" in line and "stage ETA" in line for line in ticks)


def test_progress_durations_read_as_people_write_them():
    from servegrid.progress import duration

    assert [duration(s) for s in (0.4, 42, 185, 7260)] == ["0 s", "42 s", "3 min 05 s", "2 h 01 min"]


def test_the_grid_line_counts_the_cells_and_estimates_from_the_last_ones_written(tmp_path, monkeypatch, demo_raw):
    from test_aggregate_verdict import decode_only

    from servegrid.pipeline.grid_progress import grid_line
    from servegrid.records import cell_file
    from servegrid.records.cell_record import CellRecord

    monkeypatch.chdir(tmp_path)
    experiment = decode_only(demo_raw)
    first, second = experiment.cells()
    assert grid_line(experiment, first) == f"grid: 0 of 2 cells measured, starting {first.id}"
    timed = {"started_at": "2026-12-03T10:00:00.000+00:00", "ended_at": "2026-12-03T10:01:30.000+00:00"}
    # A file measured with other settings (before a config edit) is to be measured again: not counted.
    cell_file.write_cell(first.path, [], CellRecord(first, {"other": "settings"}, None, {}, **timed))
    assert grid_line(experiment, second) == f"grid: 0 of 2 cells measured, starting {second.id}"
    cell_file.write_cell(first.path, [], CellRecord(first, experiment.cell_settings(first), None, {}, **timed))
    assert grid_line(experiment, second) == (
        f"grid: 1 of 2 cells measured, starting {second.id}; about 1 min 30 s left (1 min 30 s a cell over the last 1)"
    )
