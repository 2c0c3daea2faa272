"""The cost model servegrid estimate prices a run with: ranges of seconds, a cell's estimate, the run's, and what a
cell's rounds and one unit of its work cost (servegrid.planning.estimate fills it from assumptions, an earlier run or
a calibration)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from servegrid import modes
from servegrid.config import CellSpec, Experiment


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
    cell: CellSpec
    measuring: Range
    overhead: Range
    basis: str  # "this cell, earlier run" | "nearest cell, earlier run" | "assumed speeds" (+ the top-ups' bound)

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


def unit_seconds(experiment: Experiment, cell: CellSpec, speed: Mapping[str, float], sessions: int = 0) -> float:
    """One unit's time at ``speed`` (prefill and per-session decode tokens/s): the mode's requests, priced, with
    ``sessions`` prefilling together (0: the cell's own sessions; an open-loop cell's unit alone: 1)."""
    sessions = sessions or cell.sessions or 1
    prefix_caching = experiment.configuration(cell.configuration).prefix_caching
    seconds = 0.0
    unit = modes.get(cell.mode).requests_of_unit(cell.context, experiment.cell_workload(cell))
    for prompt, cacheable, output in unit:
        prefilled = prompt - (cacheable if prefix_caching else 0)
        # With several sessions the server prefills their prompts in one batch: per session, no faster.
        seconds += prefilled * sessions / speed["prefill"] + output / speed["decode"]
    return seconds


def rounds(experiment: Experiment, cell: CellSpec) -> tuple[int, int, float]:
    """(fewest rounds, most rounds, measuring time limit in s) of the cell under its sampling rule, every repeat
    (``repeats``: the measured phase again on a clean cache) counted."""
    rule = experiment.sampling_rules[cell.mode]
    workload = experiment.workloads[cell.mode].settings  # the mode's config section
    repeats = int(workload.get("repeats") or 1)
    if rule is None:
        limit = float(workload["duration_s"]) * repeats if workload.get("duration_s") else math.inf
        if workload.get("requests_per_session"):
            fixed = int(workload["requests_per_session"]) * repeats
            return fixed, fixed, limit
        return repeats, 10**9, limit
    sessions = cell.sessions or 1
    fewest, most = math.ceil(rule.min_samples / sessions), math.ceil(rule.max_samples / sessions)
    return fewest * repeats, most * repeats, rule.max_duration_s * repeats
