"""The calibration pass and the estimate it prices: which cells it probes, what it measures on a server (the
calibration stand-in, whose timings are known), the file it keeps with the server spec, and the forecast of a cell's
sampling from a probe's spread (tests/integration/test_top_ups_on_vllm.py calibrates on real vLLM)."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import numpy as np
import pytest
import yaml

from helpers import REPO
from servegrid import paths
from servegrid.config import Experiment, spec_hash
from servegrid.errors import CellFileError, NewerFormatError
from servegrid.pipeline import calibration_pass
from servegrid.planning import calibrated, estimate
from servegrid.records import calibration_file
from servegrid.records.calibration_file import Calibration, Probe
from servegrid.serving import procs, server
from servegrid.stats.sample_forecast import measuring_time
from servegrid.stats.sampling import SamplingRule

DATA = REPO / "tests" / "data" / "calibrations"


def stand_in_experiment(**more: dict[str, Any]) -> Experiment:
    """Two configurations of the calibration stand-in: 'quick' decodes a token in 5 ms, 'slow' in 20 ms (and
    ``more``)."""
    engine = [sys.executable, "-m", "servegrid.testing.calibration", "--model", "{model}"]
    return Experiment(
        {
            "experiment": {"title": "calibration"},
            "model": {"path": "none", "served_name": "calibration"},
            "engine": {"command": engine},
            "configurations": {
                "quick": {"label": "quick", "prefix_caching": True},
                "slow": {"label": "slow", "prefix_caching": True, "args": ["--interval", "0.02"]},
                **more,
            },
            "sampling": {"target_rel_ci": 0.05, "min_samples": 8, "max_samples": 64, "max_duration_s": 30},
            "workloads": {"decode": {"contexts": [16, 32, 64], "concurrency": [1, 2], "output_tokens": 8}},
            "operations": {"request_timeout_s": 30},
            "validity": {"max_loop_lag_s": 0.1, "max_client_cpu": 0.95, "max_send_delay_s": 0.1},
        }
    )


def test_the_probes_are_each_modes_lightest_and_heaviest_cell(demo_raw):
    demo = Experiment(demo_raw)
    probes = [(c.mode, c.context, c.sessions) for c in calibration_pass.probe_cells(demo, "ngram")]
    assert probes == [
        ("decode", 512, 1),
        ("decode", 512, 4),
        ("single_turn", 1024, 1),
        ("single_turn", 1536, 4),
        ("multi_turn", 1024, 1),
        ("multi_turn", 2048, 4),
    ]
    settings = calibration_pass.probe_settings(demo, calibration_pass.probe_cells(demo, "ngram")[0])
    rule = settings["sampling"]["rule"]
    assert rule["min_samples"] == rule["max_samples"] == calibration_pass.PROBE_SAMPLES
    assert rule["max_duration_s"] == min(demo_raw["workloads"]["decode"]["sampling"]["max_duration_s"], 20)
    assert settings["calibration"] is True


def test_a_calibration_measures_the_probes_on_one_session_and_stops_its_server(sandbox):
    experiment = stand_in_experiment()
    out = paths.calibration_path("slow")
    done = calibration_pass.calibrate(experiment, "slow", out, owner=procs.ProcessRef.of(os.getpid()), runtime=sandbox)
    assert calibration_file.read(out) == done
    assert done.spec_hash == spec_hash(experiment.launch_spec("slow"))
    assert [(p.context, p.concurrency) for p in done.probes] == [(16, 1), (64, 2)]
    for probe in done.probes:
        assert len(probe.values) == calibration_pass.PROBE_SAMPLES
        # The stand-in sends its 8 tokens 20 ms apart: at most 50 tokens/s per session (less on a loaded host).
        assert 0 < np.median(probe.values) <= 50 * 1.1
        assert probe.rounds == calibration_pass.PROBE_SAMPLES // probe.concurrency
        assert probe.job_s > probe.measuring_s > 0
    assert done.startup_s > 0 and done.job_start_s > 0
    assert [r["alive"] for r in server.status(sandbox)] == [False]  # the calibration's session is over


def test_the_estimate_prices_a_calibrated_configuration_from_its_probes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    experiment = stand_in_experiment()
    tight = [0.02] * 16  # no spread: every cell stops at its first stage, min_samples
    probe = Probe("decode", 16, 1, rounds=16, measuring_s=3.2, job_s=4.0, values=tight)
    at = "2026-12-07T20:00:00+00:00"
    current = Calibration("slow", spec_hash(experiment.launch_spec("slow")), at, 7.0, 2.0, [probe])
    calibration_file.write(paths.calibration_path("slow"), current)
    stale = Calibration("quick", "0" * 16, at, 7.0, 2.0, [probe])
    calibration_file.write(paths.calibration_path("quick"), stale)  # of another server spec: ignored
    found = estimate.current_calibrations(experiment)
    assert list(found) == ["slow"]
    est = estimate.estimate(experiment, None, found)
    assert est.startup["slow"] == estimate.Range(7.0 * 0.6, 7.0 * 1.2)  # one start measured: calibrated.STARTUP_SPREAD
    assert est.startup["quick"] == estimate.Range(*experiment.estimate["startup_s"])
    cells = {c.cell.id: c for c in est.cells}
    same = cells["slow/decode/ctx16_c1"]
    assert same.basis.startswith("calibration (decode ctx16 c1)")
    # 8 samples (min_samples) at the probe's 0.2 s a round, exactly: no spread, no range.
    assert same.measuring == estimate.Range(pytest.approx(1.6), pytest.approx(1.6))
    assert same.overhead == estimate.Range(2.0 + 0.8, 2.0 + 0.8) + calibrated.SNAKEMAKE_JOB_S
    # 8 samples in 4 rounds of 2 sessions, each round the probe's scaled by the two cells' token costs.
    two = cells["slow/decode/ctx16_c2"]
    slow = {
        "decode": experiment.estimate["decode_tokens_per_s"][0],
        "prefill": experiment.estimate["prefill_tokens_per_s"][0],
    }
    ratio = estimate.unit_seconds(experiment, two.cell, slow) / estimate.unit_seconds(experiment, same.cell, slow)
    assert ratio > 1 and two.measuring.low == pytest.approx(4 * 0.2 * ratio)
    assert cells["quick/decode/ctx16_c1"].basis == "assumed"


def test_the_forecast_follows_the_sampling_rule():
    rule = SamplingRule(target_rel_ci=0.05, min_samples=8, max_samples=64, max_duration_s=math.inf)
    exact = measuring_time([1.0] * 10, rule, sessions=2, round_s=0.5)
    assert (exact.low_s, exact.high_s, exact.samples_median) == (2.0, 2.0, 8)  # 4 rounds of 2
    spread = np.random.default_rng(3).lognormal(0, 1.0, 40)
    wide = measuring_time(spread, rule, sessions=1, round_s=0.5)
    assert wide.samples_median == 64 and wide.high_s == 32.0  # too spread to be precise: the ceiling
    capped = measuring_time(spread, SamplingRule(0.05, 8, 64, 10.0), sessions=1, round_s=0.5)
    assert capped.high_s == 10.0  # 20 rounds begin before the 10 s limit
    some = measuring_time(np.random.default_rng(4).lognormal(0, 0.1, 40), rule, sessions=1, round_s=0.5)
    assert 4.0 <= some.low_s <= some.median_s <= some.high_s <= 32.0


def test_a_calibration_of_every_format_written_reads_back(tmp_path):
    # Format 1, as `servegrid calibrate` wrote it (tests/data/calibrations/README.md).
    old = calibration_file.read(DATA / "v1.json")
    assert old.format_version == 1 and old.probes and old.probes[0].values and old.refused is None
    # Format 2, a configuration its engine refused (the hybrid demo's MTP with prefix caching on vLLM's CPU build).
    refused = calibration_file.read(DATA / "v2-refused.json")
    assert refused.format_version == 2 and refused.probes == [] and refused.startup_s > 0
    assert refused.refused and "mamba_utils.py" in refused.refused
    newer = tmp_path / "calibration.json"
    newer.write_text(json.dumps({"format_version": calibration_file.FORMAT_VERSION + 1}))
    with pytest.raises(NewerFormatError, match="newer servegrid"):
        calibration_file.read(newer)
    newer.write_text("{")
    with pytest.raises(CellFileError, match="delete it to calibrate again"):
        calibration_file.read(newer)


def test_a_configuration_its_engine_refuses_is_calibrated_as_refused_and_priced_so(sandbox, monkeypatch):
    """The engine dies of its own error at its first request (the hybrid's MTP with prefix caching on vLLM's CPU
    build): the calibration records the refusal and what it took instead of failing, and the estimate prices its
    cells as the run writes them, refused after the starts, a job's own cost each."""
    refusing = {"label": "refuses", "prefix_caching": True, "args": ["--fault", "1=engine-death"]}
    experiment = stand_in_experiment(refuses=refusing)
    out = paths.calibration_path("refuses")
    done = calibration_pass.calibrate(
        experiment, "refuses", out, owner=procs.ProcessRef.of(os.getpid()), runtime=sandbox
    )
    assert done.refused and "told to refuse this configuration" in done.refused, done
    assert done.probes == [] and done.startup_s > 0 and done.job_start_s > 0
    assert calibration_file.read(out) == done
    assert not any(r["alive"] for r in server.status(sandbox))
    est = estimate.estimate(experiment, None, {"refuses": done})
    priced = [c for c in est.cells if c.cell.configuration == "refuses"]
    assert priced and all(c.measuring == estimate.Range(0.0, 0.0) for c in priced)
    assert {c.basis for c in priced} == {"refused by its engine (calibration)"}
    assert est.startup["refuses"] == calibrated.startup(done)
    assert any(note.startswith("refuses: refused by its engine") for note in est.assumptions)


def test_an_open_loop_grid_probes_its_shortest_schedule_as_the_grid_has_it():
    """`make demo-traffic`'s grid has no closed-loop cell: its calibration probes the open-loop cell of the shortest
    arrival schedule (what a cell job costs beyond its schedule), unchanged but for the mark, within a time limit
    that allows its schedule and its last answers."""
    traffic = Experiment(yaml.safe_load((REPO / "config" / "cpu-traffic-demo.yaml").read_text()))
    (probe,) = calibration_pass.probe_cells(traffic, "ngram")
    schedules = {c.id: calibration_pass.schedule_s(traffic, c) for c in traffic.cells("ngram")}
    assert schedules[probe.id] == min(schedules.values()) and probe.open_loop
    assert schedules["ngram/single_turn/ctx1024_r2"] == pytest.approx(2 + 30 / 2)  # ramp + 30 arrivals at 2/s
    assert calibration_pass.probe_settings(traffic, probe) == traffic.cell_settings(probe) | {"calibration": True}
    limit = calibration_pass.time_limit_s(traffic, "ngram")
    assert limit > traffic.operations.startup_timeout_s + schedules[probe.id] + traffic.operations.request_timeout_s


def test_an_open_loop_grid_is_priced_by_its_schedule_with_its_calibrations_costs(tmp_path, monkeypatch):
    """`make demo-traffic`'s calibration probes a trace cell (context 0); the estimate prices every open-loop cell by
    its schedule and takes the start and a job's own cost from the calibration (it divided by the trace's context
    0 before, 2026-12-08)."""
    monkeypatch.chdir(tmp_path)
    traffic = Experiment(yaml.safe_load((REPO / "config" / "cpu-traffic-demo.yaml").read_text()))
    (cell,) = calibration_pass.probe_cells(traffic, "ngram")
    probe = Probe(cell.mode, cell.context, 1, rounds=30, measuring_s=6.0, job_s=8.0, values=[0.1] * 30)
    at = "2026-12-08T01:00:00+00:00"
    calibration = Calibration("ngram", spec_hash(traffic.launch_spec("ngram")), at, 80.0, 2.5, [probe])
    est = estimate.estimate(traffic, None, {"ngram": calibration})
    priced = [c for c in est.cells if c.cell.configuration == "ngram"]
    assert priced and {c.basis for c in priced} == {"the arrival schedule"}
    assert {c.overhead for c in priced} == {calibrated.job_overhead(calibration)}
    assert est.startup["ngram"] == calibrated.startup(calibration)
