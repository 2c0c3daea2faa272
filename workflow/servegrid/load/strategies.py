"""One class per load strategy, and the one place a cell's settings choose it (:func:`for_cell`).

A strategy decides when a mode's units of work go out (:class:`~servegrid.load.base.Work`): closed-loop sessions
(:class:`SessionsStrategy`: ``c<N>``), arrivals on a seeded schedule at an offered rate (:class:`RateStrategy`:
``r<rate>``), or a trace's own arrivals replayed at a speedup (:class:`ReplayStrategy`: ``x<speedup>``). Each
knows how many connections its cell needs, how many to open before the measured phase, how to run the units it
is handed, and how the later requests inside one unit (a conversation's turns) are paced.

A cell's load (:mod:`servegrid.records.cell_spec`'s ``Sessions | Rate | Replay``) is read from its settings by
:attr:`servegrid.records.cell_settings.CellSettings.load`, the one place that answers "open loop?" from settings
(:attr:`CellSpec.open_loop` answers it for a cell).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from servegrid.load import open_loop, sessions
from servegrid.load.arrivals import Arrival, due_offsets_s
from servegrid.load.base import Driver, MeasureHook, Work
from servegrid.load.open_loop import OpenLoopOutcome
from servegrid.records.cell_settings import CellSettings
from servegrid.records.cell_spec import Rate, Sessions
from servegrid.records.request import RequestRecord


class LoadStrategy(ABC):
    """When a cell's units of work are sent (see the module docstring)."""

    open_loop: ClassVar[bool]  # sent on a schedule whatever the server does

    @property
    @abstractmethod
    def connections(self) -> int:
        """Connections the client's pool may hold: a session's each, or the ceiling on requests in flight."""

    @abstractmethod
    def expected_in_flight(self, warmups: Sequence[RequestRecord]) -> int:
        """Connections to open before the measured phase, from the warm-up's requests."""

    @abstractmethod
    async def run(self, driver: Driver, measure: MeasureHook, work: Work[Any]) -> OpenLoopOutcome | None:
        """The measured phase: ``measure()`` once the first units are built, then every unit at its time; what the
        open-loop run was (None: closed loop)."""

    def think_times_s(self, index: int, count: int) -> list[float] | None:
        """The user's pause before each of ``count`` later requests of the ``index``-th unit (a conversation's
        turns), due then whatever else is in flight; None: each goes as the previous answer ends."""
        return None

    def at_pace_ns(self, trace_ms: float) -> int:
        """A span of a replayed trace (ms) as this load sends it (ns): the trace's own pace."""
        return int(trace_ms * 1e6)


@dataclass(frozen=True)
class SessionsStrategy(LoadStrategy):
    """Closed loop: ``sessions`` sessions, each sending its next unit when its last one ended, in the stages of the
    cell's sampling rule (servegrid.load.sessions)."""

    open_loop: ClassVar[bool] = False
    sessions: int

    @property
    def connections(self) -> int:
        return self.sessions

    def expected_in_flight(self, warmups: Sequence[RequestRecord]) -> int:
        return self.sessions

    async def run(self, driver: Driver, measure: MeasureHook, work: Work[Any]) -> OpenLoopOutcome | None:
        await sessions.measure_in_stages(driver, measure, work, self.sessions)
        return None


@dataclass(frozen=True)
class _OpenLoopStrategy(LoadStrategy):
    """Open loop (servegrid.load.open_loop): each unit is one arrival, sent when its schedule says; ``requests``
    arrivals measured after a ramp of ``ramp_s`` seconds, at most ``max_in_flight`` in flight. ``seed``: the
    schedule's (not the configuration: every configuration meets the same arrival times)."""

    open_loop: ClassVar[bool] = True
    rate: float  # arrivals a second (the measured arrivals')
    requests: int
    ramp_s: float
    max_in_flight: int
    seed: int

    @abstractmethod
    def schedule(self) -> tuple[list[float], int]:
        """Every arrival's due time (s after the start) and how many of them are the ramp's."""

    @property
    def connections(self) -> int:
        return self.max_in_flight

    def expected_in_flight(self, warmups: Sequence[RequestRecord]) -> int:
        """Requests in flight at this rate if each takes as long as the warm-up's longest (Little's law), at least
        1, at most the ceiling: how many connections to open before the window starts."""
        latency_s = max(((r.end_ns or r.sent_ns) - r.sent_ns) / 1e9 for r in warmups) if warmups else 1.0
        return max(1, min(self.max_in_flight, math.ceil(self.rate * latency_s * 2)))

    async def run(self, driver: Driver, measure: MeasureHook, work: Work[Any]) -> OpenLoopOutcome | None:
        outcome = await open_loop.measure(driver, measure, work, self)
        work.settle()
        return outcome


@dataclass(frozen=True)
class RateStrategy(_OpenLoopStrategy):
    """Open loop at an offered ``rate``: arrivals on a seeded schedule of ``arrival``'s pattern
    (servegrid.load.arrivals); a conversation's later turns each after a seeded think time."""

    arrival: Arrival
    think_mean_s: float = 0.0  # multi_turn: between a reply and the next turn
    think_pattern: str = "exponential"

    @classmethod
    def from_settings(cls, settings: CellSettings, rate: Rate) -> RateStrategy:
        window = settings.open_loop_window
        think = window.get("think") or {}
        return cls(
            rate=rate.per_s,
            arrival=Arrival(**(settings.arrival or {})),
            requests=int(window["requests"]),
            ramp_s=float(window["ramp_s"]),
            max_in_flight=int(window["max_in_flight"]),
            think_mean_s=float(think.get("mean_s", 0.0)),
            think_pattern=str(think.get("pattern", "exponential")),
            seed=settings.seed,
        )

    def schedule(self) -> tuple[list[float], int]:
        """Enough arrivals for the ramp, the measured window and a drain as long as ``max_in_flight`` arrivals
        (beyond that many the cell is saturated anyway)."""
        ramp_estimate = math.ceil(self.rate * self.ramp_s * 2) + 10
        while True:
            offsets = due_offsets_s(
                self.rate, ramp_estimate + self.requests + self.max_in_flight, self.arrival, self.seed
            )
            ramp = int((offsets < self.ramp_s).sum())
            if ramp < ramp_estimate:  # the schedule reaches past the ramp: the window and drain are whole
                return offsets[: ramp + self.requests + self.max_in_flight].tolist(), ramp
            ramp_estimate *= 2

    def think_times_s(self, index: int, count: int) -> list[float] | None:
        """Seeded by the schedule's seed and the arrival, so every configuration meets the same ones."""
        if self.think_pattern == "constant" or self.think_mean_s == 0:
            return [self.think_mean_s] * count
        rng = np.random.default_rng([self.seed, index])
        think_s: list[float] = rng.exponential(self.think_mean_s, count).tolist()
        return think_s


@dataclass(frozen=True)
class ReplayArrivals:
    """A replayed trace's own arrivals, what a mode that replays one declares (servegrid.modes.base.Mode.arrivals):
    each one's due time at 1x in seconds after the first (its window's, then its drain's), and how many are the
    window's."""

    offsets_s: tuple[float, ...]
    in_window: int


@dataclass(frozen=True)
class ReplayStrategy(_OpenLoopStrategy):
    """Open loop on a trace's own schedule, ``speedup`` times as fast: the window's arrivals due in its first
    ``ramp_s`` seconds are the ramp, the rest of the window is measured (``requests``), the arrivals after it are
    the drain; ``rate``: the measured arrivals' mean rate. A later turn is due at the trace's gap, sped up too."""

    offsets_s: tuple[float, ...]
    ramp: int
    speedup: float

    @classmethod
    def of(
        cls, arrivals: ReplayArrivals, speedup: float, ramp_s: float, max_in_flight: int, seed: int
    ) -> ReplayStrategy:
        offsets_s = [t / speedup for t in arrivals.offsets_s]
        in_window = arrivals.in_window
        ramp = min(sum(1 for t in offsets_s[:in_window] if t < ramp_s), in_window - 1)
        measured = offsets_s[ramp:in_window]
        span = measured[-1] - measured[0] if len(measured) > 1 else 0.0
        return cls(
            rate=(len(measured) - 1) / span if span > 0 else 1.0,
            requests=len(measured),
            ramp_s=ramp_s,
            max_in_flight=max_in_flight,
            seed=seed,
            offsets_s=tuple(offsets_s),
            ramp=ramp,
            speedup=speedup,
        )

    def schedule(self) -> tuple[list[float], int]:
        return list(self.offsets_s), self.ramp

    def at_pace_ns(self, trace_ms: float) -> int:
        return int(trace_ms / self.speedup * 1e6)


def for_cell(
    settings: Mapping[str, Any], arrivals: Callable[[Mapping[str, Any]], ReplayArrivals] | None = None
) -> LoadStrategy:
    """The strategy that sends a cell's units, from its settings; ``arrivals``: the mode's own arrivals at 1x from
    its workload settings, which a replayed trace's load paces (servegrid.modes.base.Mode.arrivals)."""
    typed = CellSettings(settings)
    load = typed.load
    if isinstance(load, Sessions):
        return SessionsStrategy(load.count)
    if isinstance(load, Rate):
        return RateStrategy.from_settings(typed, load)
    if arrivals is None:
        raise ValueError(f"cell {typed.cell_id}: its mode has no arrivals of its own to replay")
    window = typed.open_loop_window
    return ReplayStrategy.of(
        arrivals(typed.workload), load.speedup, float(window["ramp_s"]), int(window["max_in_flight"]), typed.seed
    )
