"""``servegrid estimate``: what a run will cost, as a range, before it starts: device hours per configuration and
mode, and the wall clock for a given ``--cores``.

A cell's measuring time is its rounds (one unit per session: a request, or a conversation) times the time of a
round. The rounds come from the sampling rule: at least ``min_samples`` (a cell can stop at its first look), at most
``max_samples``, and never past ``max_duration_s`` plus the round in flight; a fixed count is exact. The time of a
round comes, in this order of preference, from

1. an earlier run's summary (``--results``): the same cell's measured seconds per round, or the nearest measured cell
   of the same configuration and mode, scaled by the ratio of the two cells' token costs (the mode's
   ``unit_requests`` priced at the assumed speeds);
2. the assumed speeds of the config's ``estimate`` section (``decode_tokens_per_s`` per session,
   ``prefill_tokens_per_s``; prefix caching skips the tokens a cache can hold), slow end for the high bound.

Around the measuring: each cell's own cost (its job, the warm-up, the prompts; ``estimate.cell_overhead_s``, or
the earlier run's median gap between cells), each configuration's server start-up (``estimate.startup_s``), and the
run's fixed cost (``estimate.run_overhead_s``: model, preflight, tables, figures, reports). Configurations that
share a GPU (or, without GPUs, the host) run one after another; ``--cores N`` runs N such groups side by side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from servegrid import paths
from servegrid.analysis.requests_table import closed_loop
from servegrid.config import CellSpec, Experiment, spec_hash
from servegrid.paths import RunTables
from servegrid.planning import calibrated
from servegrid.planning.cost_model import ZERO, CellEstimate, Estimate, Range, device_groups, rounds, unit_seconds
from servegrid.records import calibration_file, table_format
from servegrid.records.calibration_file import Calibration
from servegrid.records.cell_settings import CellSettings
from servegrid.records.cell_spec import Sessions

__all__ = ["ZERO", "CellEstimate", "Estimate", "Range", "device_groups", "estimate", "rounds", "unit_seconds"]


def earlier_rounds(results: Path) -> pd.DataFrame:
    """An earlier run's seconds per round for each valid measured cell (empty without one)."""
    path = RunTables.under(results / "tables").summary
    if not Path(path).exists():
        return pd.DataFrame()
    summary = table_format.read(path)
    measured = summary[(summary["primary_n"] > 0) & (summary["duration_s"] > 0)].copy()
    measured["round_s"] = measured["duration_s"] / (measured["primary_n"] / measured["concurrency"]).clip(lower=1)
    return measured


def _earlier_overhead(measured: pd.DataFrame) -> Range | None:
    """The median time a cell took beyond its measuring, from one configuration's consecutive cells' start times."""
    gaps = []
    for _, cells in measured.dropna(subset=["started_at"]).groupby("configuration"):
        ordered = cells.sort_values("started_at")
        starts = pd.to_datetime(ordered["started_at"], utc=True)
        between = starts.diff().dt.total_seconds().iloc[1:].to_numpy() - ordered["duration_s"].iloc[:-1].to_numpy()
        gaps += [g for g in between if 0 < g < 3600]
    if len(gaps) < 3:
        return None
    series = pd.Series(gaps)
    return Range(float(series.quantile(0.25)), float(series.quantile(0.75)))


def estimate(
    experiment: Experiment, results: Path | None = None, calibrations: Mapping[str, Calibration] | None = None
) -> Estimate:
    """The run's estimate. ``calibrations`` (configuration → its calibration, of the server spec it has now) price
    that configuration's cells, start and per-cell cost from measurements (servegrid.planning.calibrated); an
    earlier run's cells (``results``) or the config's assumed speeds price the rest."""
    assumed = experiment.estimate
    calibrations = calibrations or {}
    fast = {"decode": assumed["decode_tokens_per_s"][1], "prefill": assumed["prefill_tokens_per_s"][1]}
    slow = {"decode": assumed["decode_tokens_per_s"][0], "prefill": assumed["prefill_tokens_per_s"][0]}
    measured = earlier_rounds(results) if results is not None else pd.DataFrame()
    overhead = Range(*assumed["cell_overhead_s"])
    notes = [
        f"speeds (config estimate:): decode {slow['decode']:g}-{fast['decode']:g} tokens/s per session, prefill "
        f"{slow['prefill']:g}-{fast['prefill']:g} tokens/s"
    ]
    if not measured.empty:
        notes.append(f"an earlier run's {len(measured)} measured cells ({results})")
        overhead = _earlier_overhead(measured) or overhead
    notes.append(f"each cell's own cost beyond measuring: {overhead.low:.0f}-{overhead.high:.0f} s")
    for name, calibration in calibrations.items():
        own = calibrated.job_overhead(calibration)
        if calibration.refused:
            notes.append(
                f"{name}: refused by its engine at calibration {calibration.measured_at} ({calibration.refused}); "
                f"its cells are written as refused after {calibration.startup_s:.0f} s of starts, "
                f"{own.low:.1f}-{own.high:.1f} s each"
            )
            continue
        notes.append(
            f"{name}: calibrated {calibration.measured_at} ({len(calibration.probes)} probes; start "
            f"{calibration.startup_s:.0f} s, each cell's own cost {own.low:.1f}-{own.high:.1f} s, Snakemake's "
            f"{calibrated.SNAKEMAKE_JOB_S.low:g}-{calibrated.SNAKEMAKE_JOB_S.high:g} s of it assumed)"
        )
    cells = []
    for cell in experiment.cells():
        own_calibration = calibrations.get(cell.configuration)
        priced = None
        if own_calibration is not None:
            priced = calibrated.cell_estimate(experiment, cell, own_calibration, slow, experiment.top_up_rounds)
            if priced is None:  # no probe of its mode: the assumptions, with the measured per-cell cost
                priced = _cell(experiment, cell, measured, fast, slow, calibrated.job_overhead(own_calibration))
        cells.append(priced or _cell(experiment, cell, measured, fast, slow, overhead))
    startup = {
        name: calibrated.startup(calibrations[name]) if name in calibrations else Range(*assumed["startup_s"])
        for name in experiment.configurations
    }
    gpus = {name: len(conf.gpus) for name, conf in experiment.configurations.items()}
    return Estimate(cells, startup, Range(*assumed["run_overhead_s"]), device_groups(experiment), gpus, notes)


def current_calibrations(experiment: Experiment) -> dict[str, Calibration]:
    """Each configuration's calibration on disk that measured the server spec it has now (others are stale)."""
    found = {}
    for name in experiment.configurations:
        path = Path(paths.calibration_path(name))
        if path.exists():
            calibration = calibration_file.read(path)
            if calibration.spec_hash == spec_hash(experiment.launch_spec(name)):
                found[name] = calibration
    return found


def _cell(
    experiment: Experiment,
    cell: CellSpec,
    measured: pd.DataFrame,
    fast: Mapping[str, float],
    slow: Mapping[str, float],
    overhead: Range,
) -> CellEstimate:
    if cell.open_loop:
        return _open_loop_cell(experiment, cell, fast, slow, overhead)
    measured = closed_loop(measured)  # an earlier run's cells by sessions: what a round of sessions costs
    fewest, most, limit = rounds(experiment, cell)
    round_time, basis = Range(unit_seconds(experiment, cell, fast), unit_seconds(experiment, cell, slow)), "assumed"
    if not measured.empty:
        # Only cells measured on this configuration's server as it is now (another config's results, or a server
        # with other flags, say nothing about it).
        server = spec_hash(experiment.launch_spec(cell.configuration))
        same = measured[
            (measured["configuration"] == cell.configuration)
            & (measured["mode"] == cell.mode)
            & (measured.get("spec_hash", server) == server)
        ]
        sessions = cell.sessions or 1
        exact = same[(same["context"] == cell.context) & (same["concurrency"] == sessions)]
        if not exact.empty:
            seconds = float(exact["round_s"].iloc[0])
            round_time, basis = Range(seconds, seconds), "this cell, earlier run"
        elif not same.empty:
            distance = (same["context"] / cell.context).map(math.log).abs() + (same["concurrency"] / sessions).map(
                math.log
            ).abs()
            nearest = same.loc[distance.idxmin()]
            near_cell = CellSpec(
                cell.configuration, cell.mode, int(nearest["context"]), Sessions(int(nearest["concurrency"]))
            )
            ratio = unit_seconds(experiment, cell, slow) / unit_seconds(experiment, near_cell, slow)
            seconds = float(nearest["round_s"]) * ratio
            round_time, basis = Range(seconds, seconds), "nearest cell, earlier run"
    low = fewest * round_time.low
    high = min(most * round_time.high, limit + round_time.high)
    if experiment.top_up_rounds:
        # Sampling that serves the verdict: the first pass at least; at most, every round tops the cell up (the
        # measured phase again, and the job's own cost again).
        runs = 1 + experiment.top_up_rounds
        high, overhead = high * runs, Range(overhead.low, overhead.high * runs)
        basis += f", first pass + up to {experiment.top_up_rounds} top-ups"
    return CellEstimate(cell, Range(min(low, high), high), overhead, basis)


def _open_loop_cell(
    experiment: Experiment, cell: CellSpec, fast: Mapping[str, float], slow: Mapping[str, float], overhead: Range
) -> CellEstimate:
    """An open-loop cell lasts as long as its schedule: the ramp, the measured arrivals at the offered rate, and the
    last measured request's own time (one request alone at the assumed speeds: the drain, if the server keeps up)."""
    settings = CellSettings(experiment.cell_settings(cell))
    window = settings.open_loop_window  # a trace cell's: its window's arrivals
    repeats = settings.repeats
    assert not isinstance(cell.load, Sessions)  # _cell: open loop
    span = float(window["ramp_s"]) + int(window["requests"]) / cell.load.per_s
    # The last measured unit alone (one session's prefill), from the cell's own workload (a trace: its window's).
    low, high = (repeats * (span + unit_seconds(experiment, cell, speed, sessions=1)) for speed in (fast, slow))
    return CellEstimate(cell, Range(low, high), overhead, "the arrival schedule")
