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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servegrid import modes
from servegrid.analysis.requests_table import closed_loop
from servegrid.config import Cell, Experiment, spec_hash
from servegrid.paths import RunTables


@dataclass(frozen=True)
class Range:
    low: float
    high: float

    def __add__(self, other: Range) -> Range:
        return Range(self.low + other.low, self.high + other.high)

    def scaled(self, factor: float) -> Range:
        return Range(self.low * factor, self.high * factor)


ZERO = Range(0.0, 0.0)


@dataclass(frozen=True)
class CellEstimate:
    cell: Cell
    measuring: Range
    overhead: Range
    basis: str  # "this cell, earlier run" | "nearest cell, earlier run" | "assumed speeds"

    @property
    def total(self) -> Range:
        return self.measuring + self.overhead


@dataclass
class Estimate:
    cells: list[CellEstimate]
    startup: dict[str, Range]  # configuration → one server start
    run_overhead: Range
    groups: list[list[str]]  # configurations sharing a device: one after another
    gpus: dict[str, int]  # configuration → its GPUs (0: a CPU server)
    assumptions: list[str] = field(default_factory=list)

    def configuration_time(self, name: str) -> Range:
        own = [c.total for c in self.cells if c.cell.configuration == name]
        return sum(own, ZERO) + (self.startup[name] if own else ZERO)

    def device_hours(self, name: str) -> Range:
        """GPU hours where the configuration has GPUs (each counted), else hours of the host."""
        return self.configuration_time(name).scaled(max(1, self.gpus[name]) / 3600)

    def wall_clock(self, cores: int) -> Range:
        """Seconds from start to report with ``cores`` jobs at a time: groups packed longest first."""
        lanes_low, lanes_high = [0.0] * max(1, cores), [0.0] * max(1, cores)
        for group in sorted(self.groups, key=lambda g: -sum(self.configuration_time(n).high for n in g)):
            time = sum((self.configuration_time(n) for n in group), ZERO)
            lanes_low[lanes_low.index(min(lanes_low))] += time.low
            lanes_high[lanes_high.index(min(lanes_high))] += time.high
        return Range(max(lanes_low), max(lanes_high)) + self.run_overhead


def device_groups(experiment: Experiment) -> list[list[str]]:
    """Configurations that cannot run side by side (a GPU in common, or no GPU at all: the host's cores)."""
    groups: list[tuple[set[int], list[str]]] = []
    for name, conf in experiment.configurations.items():
        devices = set(conf.gpus) if conf.gpus else {-1}
        touching = [g for g in groups if g[0] & devices]
        merged = (devices.union(*(g[0] for g in touching)), [n for g in touching for n in g[1]] + [name])
        groups = [g for g in groups if g not in touching] + [merged]
    return [names for _, names in groups]


def unit_seconds(experiment: Experiment, cell: Cell, speed: Mapping[str, float]) -> float:
    """One unit's time at ``speed`` (prefill and per-session decode tokens/s): the mode's requests, priced."""
    prefix_caching = experiment.configuration(cell.configuration).prefix_caching
    seconds = 0.0
    unit = modes.get(cell.mode).requests_of_unit(cell.context, experiment.cell_workload(cell))
    for prompt, cacheable, output in unit:
        prefilled = prompt - (cacheable if prefix_caching else 0)
        # With several sessions the server prefills their prompts in one batch: per session, no faster.
        seconds += prefilled * cell.concurrency / speed["prefill"] + output / speed["decode"]
    return seconds


def rounds(experiment: Experiment, cell: Cell) -> tuple[int, int, float]:
    """(fewest rounds, most rounds, measuring time limit in s) of the cell under its sampling rule, every repeat
    (``repeats``: the measured phase again on a clean cache) counted."""
    rule = experiment.sampling_rules[cell.mode]
    settings = experiment.workloads[cell.mode].settings
    repeats = int(settings.get("repeats") or 1)
    if rule is None:
        limit = float(settings["duration_s"]) * repeats if settings.get("duration_s") else math.inf
        if settings.get("requests_per_session"):
            fixed = int(settings["requests_per_session"]) * repeats
            return fixed, fixed, limit
        return repeats, 10**9, limit
    fewest, most = math.ceil(rule.min_samples / cell.concurrency), math.ceil(rule.max_samples / cell.concurrency)
    return fewest * repeats, most * repeats, rule.max_duration_s * repeats


def earlier_rounds(results: Path) -> pd.DataFrame:
    """An earlier run's seconds per round for each valid measured cell (empty without one)."""
    path = RunTables.under(results / "tables").summary
    if not Path(path).exists():
        return pd.DataFrame()
    summary = pd.read_parquet(path)
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


def estimate(experiment: Experiment, results: Path | None = None) -> Estimate:
    assumed = experiment.estimate
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
    cells = [_cell(experiment, cell, measured, fast, slow, overhead) for cell in experiment.cells()]
    startup = {name: Range(*assumed["startup_s"]) for name in experiment.configurations}
    gpus = {name: len(conf.gpus) for name, conf in experiment.configurations.items()}
    return Estimate(cells, startup, Range(*assumed["run_overhead_s"]), device_groups(experiment), gpus, notes)


def _cell(experiment: Experiment, cell: Cell, measured: pd.DataFrame, fast: Mapping[str, float],
          slow: Mapping[str, float], overhead: Range) -> CellEstimate:  # fmt: skip
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
        exact = same[(same["context"] == cell.context) & (same["concurrency"] == cell.concurrency)]
        if not exact.empty:
            seconds = float(exact["round_s"].iloc[0])
            round_time, basis = Range(seconds, seconds), "this cell, earlier run"
        elif not same.empty:
            distance = (same["context"] / cell.context).map(math.log).abs() + (
                same["concurrency"] / cell.concurrency
            ).map(math.log).abs()
            nearest = same.loc[distance.idxmin()]
            near_cell = Cell(cell.configuration, cell.mode, int(nearest["context"]), int(nearest["concurrency"]))
            ratio = unit_seconds(experiment, cell, slow) / unit_seconds(experiment, near_cell, slow)
            seconds = float(nearest["round_s"]) * ratio
            round_time, basis = Range(seconds, seconds), "nearest cell, earlier run"
    low = fewest * round_time.low
    high = min(most * round_time.high, limit + round_time.high)
    return CellEstimate(cell, Range(min(low, high), high), overhead, basis)


def _open_loop_cell(experiment: Experiment, cell: Cell, fast: Mapping[str, float], slow: Mapping[str, float],
                    overhead: Range) -> CellEstimate:  # fmt: skip
    """An open-loop cell lasts as long as its schedule: the ramp, the measured arrivals at the offered rate, and the
    last measured request's own time (one request alone at the assumed speeds: the drain, if the server keeps up)."""
    settings = experiment.cell_settings(cell)
    window = settings["open_loop"]  # a trace cell's: its window's arrivals
    repeats = int(settings["workload"].get("repeats") or 1)
    span = float(window["ramp_s"]) + int(window["requests"]) / cell.rate
    alone = Cell(cell.configuration, cell.mode, cell.context, 1, window=cell.window)  # one request alone
    low, high = (repeats * (span + unit_seconds(experiment, alone, speed)) for speed in (fast, slow))
    return CellEstimate(cell, Range(low, high), overhead, "the arrival schedule")


def text(est: Estimate, cores: int | None) -> str:
    advice = len(est.groups)
    lines = ["configuration     mode          cells   device hours        basis"]
    for name in est.gpus:
        for mode in dict.fromkeys(c.cell.mode for c in est.cells if c.cell.configuration == name):
            own = [c for c in est.cells if c.cell.configuration == name and c.cell.mode == mode]
            hours = sum((c.total for c in own), ZERO).scaled(max(1, est.gpus[name]) / 3600)
            bases = ", ".join(sorted({c.basis for c in own}))
            lines.append(f"{name:17} {mode:13} {len(own):5}   {hours.low:6.2f}-{hours.high:<7.2f}   {bases}")
    total = sum((est.device_hours(n) for n in est.gpus), ZERO)
    kind = "GPU" if any(est.gpus.values()) else "host"
    lines.append(f"{kind} hours in all (server start-ups included): {total.low:.1f}-{total.high:.1f}")
    for n in sorted({advice, cores or advice, 1}):
        wall = est.wall_clock(n)
        lines.append(f"wall clock with --cores {n}: {_duration(wall.low)} to {_duration(wall.high)}"
                     + (" (advised: one job per device group)" if n == advice else ""))  # fmt: skip
    groups = "; ".join(" → ".join(g) for g in est.groups)
    lines.append(f"run one after another (a device in common): {groups}")
    lines += [f"assumed: {note}" for note in est.assumptions]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


def as_json(est: Estimate, cores: int) -> dict[str, Any]:
    return {
        "cells": [
            {"cell": c.cell.id, "measuring_s": [c.measuring.low, c.measuring.high], "basis": c.basis} for c in est.cells
        ],
        "device_hours": {n: [est.device_hours(n).low, est.device_hours(n).high] for n in est.gpus},
        "wall_clock_s": [est.wall_clock(cores).low, est.wall_clock(cores).high],
        "cores": cores,
        "groups": est.groups,
    }
