"""When is a cell group's verdict decided? Pure decision logic for sampling that serves the verdict.

A group is one mode × context × load measured on several configurations. Its *leader* is the configuration with
the best median of the primary figure. For every other configuration, the factor by which the leader is ahead
(median over median, oriented so that the leader's lead is ≥ 1) has a bootstrap interval. With ``min_factor``
m the tie band is [1/m, m] (the verdict calls a lead smaller than m no win, docs/verdict.md). A pair is

- ``ahead``: the interval lies above m, so more samples will not turn the lead into a tie;
- ``tie``: the interval lies inside the band, so more samples will not turn it into a win;
- ``open``: otherwise (the interval straddles m, or reaches below 1/m).

A group is ``decided`` when no pair is open and at least one is ahead, a ``tie`` when every pair is a tie, and
``open`` otherwise: the pipeline then tops its open pairs' cells up (servegrid.analysis.top_ups), round after
round, until the group is decided or its budget is spent.

As for a single cell (servegrid.stats.sampling), a group is judged at several looks, and stopping the first
time an interval clears the band picks intervals that clear it by chance: the check judges the 99% interval
(:data:`STOP_CONFIDENCE`) while the verdict reports the 95% one. docs/sampling.md simulates the rule's coverage.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from servegrid.stats import intervals
from servegrid.stats.sampling import MIN_SAMPLES_FOR, STOP_CONFIDENCE

PairState = Literal["ahead", "tie", "open"]
GroupState = Literal["decided", "tie", "open"]
# Fewer values than the summary needs to report a median (6) leave the pair open: the verdict could not use it, and
# the cell is what a time limit stopped early, which a top-up completes (found 2026-12-07: cells of 2-3 values were
# left out of the decisions, so never topped up).
MIN_VALUES = MIN_SAMPLES_FOR(0.5)


@dataclass(frozen=True)
class Pair:
    """The leader against one other configuration: the factor it leads by and its stopping interval."""

    other: str
    factor: float
    low: float | None
    high: float | None
    state: PairState


@dataclass(frozen=True)
class GroupDecision:
    leader: str
    pairs: tuple[Pair, ...]

    @property
    def state(self) -> GroupState:
        states = {p.state for p in self.pairs}
        if "open" in states:
            return "open"
        return "tie" if states == {"tie"} else "decided"

    @property
    def open_configurations(self) -> list[str]:
        """What a top-up measures again: the leader and every configuration whose pair with it is open."""
        others = [p.other for p in self.pairs if p.state == "open"]
        return [self.leader, *others] if others else []


def pair_state(low: float | None, high: float | None, min_factor: float) -> PairState:
    if low is None or high is None:
        return "open"
    if low > min_factor:
        return "ahead"
    if low >= 1 / min_factor and high <= min_factor:
        return "tie"
    return "open"


def decide_group(
    values: Mapping[str, Sequence[float] | np.ndarray],
    higher_is_better: bool,
    min_factor: float,
    seed: str = "",
    confidence: float = STOP_CONFIDENCE,
) -> GroupDecision | None:
    """The group's decision from each configuration's primary values (NaN ignored; insertion order breaks ties
    of the medians); None with fewer than two configurations that have values. ``seed`` makes the bootstrap
    repeatable (each configuration's resamples are seeded by it and the configuration's name)."""
    clean = {name: np.asarray(v, dtype=float) for name, v in values.items()}
    clean = {name: v[~np.isnan(v)] for name, v in clean.items() if np.any(~np.isnan(v))}
    if len(clean) < 2:
        return None
    medians = {name: float(np.median(v)) for name, v in clean.items()}
    sign = -1.0 if higher_is_better else 1.0
    leader = min(clean, key=lambda name: sign * medians[name])
    boot = {
        name: intervals.bootstrap_medians(v, np.random.default_rng(zlib.crc32(f"{seed}/{name}".encode())))
        if v.size >= MIN_VALUES
        else None
        for name, v in clean.items()
    }
    pairs = []
    for other in clean:
        if other == leader:
            continue
        # The factor the leader leads by: ≥ 1 at the medians, whichever way the figure is better.
        top, bottom = (leader, other) if higher_is_better else (other, leader)
        factor = medians[top] / medians[bottom] if medians[bottom] else float("inf")
        low = high = None
        top_medians, bottom_medians = boot[top], boot[bottom]
        if top_medians is not None and bottom_medians is not None:
            low, high = intervals.ratio_interval(top_medians, bottom_medians, confidence)
        pairs.append(Pair(other, factor, low, high, pair_state(low, high, min_factor)))
    return GroupDecision(leader, tuple(pairs))
