"""A grid point (:class:`Cell`) and its load: closed-loop sessions (``c4``), an open-loop offered rate (``r0.5``)
or a trace replayed at a speedup (``x2``), in one of its windows (``x2_w600+300``: from 600 s for 300 s).

A closed-loop cell runs N sessions that each send their next request when the last one ends: "how fast for N
users who wait for each other". An open-loop cell sends on a seeded arrival schedule at an offered rate whatever
the server does (servegrid.modes.arrivals): "does it keep up with my traffic". A trace cell replays a window of a
trace's own arrivals, ``speedup`` times as fast (servegrid.modes.trace): "does it keep up with *this* traffic". The
load is the last part of a cell's name, so every closed-loop cell keeps the name (and file) it had before rates
existed, and a trace cell of the whole trace the one it had before windows existed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from servegrid import paths
from servegrid.errors import ConfigError
from servegrid.modes.arrivals import rate_label

# Keys that shape open-loop cells only: part of those cells' settings, never of a closed-loop cell's (adding rates to
# a mode reruns none of its closed-loop cells).
OPEN_LOOP_KEYS = ("arrival", "open_loop")

# What a cell file's name carries after its context (a Snakemake wildcard constraint too).
NUMBER = r"\d+(?:\.\d+)?"
WINDOW_PATTERN = rf"w{NUMBER}(?:\+{NUMBER})?"
LOAD_PATTERN = rf"c\d+|r{NUMBER}|x{NUMBER}(?:_{WINDOW_PATTERN})?"


@dataclass(frozen=True, order=True)
class Cell:
    """One grid point: configuration × workload mode × context × load (``concurrency`` sessions, or ``rate``)."""

    configuration: str
    mode: str
    context: int
    concurrency: int  # closed-loop sessions; 0 for an open-loop cell
    rate: float = 0.0  # open loop: requests/s offered; 0.0 for a closed-loop cell
    # A trace cell: the trace's pace times this (its rate is then the replayed arrivals' mean rate); 0.0 otherwise.
    speedup: float = 0.0
    # A trace cell's window (servegrid.modes.trace_file.Window.label): "" for the whole trace, and for other cells.
    window: str = ""

    def __post_init__(self) -> None:
        if (self.concurrency > 0) == (self.rate > 0):
            raise ValueError(
                f"a cell has sessions or a rate, one of them (concurrency {self.concurrency}, rate {self.rate})"
            )

    @property
    def open_loop(self) -> bool:
        return self.rate > 0

    @property
    def load(self) -> str:
        if self.speedup:
            return f"x{rate_label(self.speedup)}" + (f"_{self.window}" if self.window else "")
        return f"r{rate_label(self.rate)}" if self.open_loop else f"c{self.concurrency}"

    @property
    def id(self) -> str:
        return f"{self.configuration}/{self.mode}/ctx{self.context}_{self.load}"

    @property
    def path(self) -> str:
        return paths.cell(self.configuration, self.mode, self.context, self.load)


def parse_load(load: int | str) -> tuple[int, float, float, str]:
    """(concurrency, rate, speedup, window) of a load: an int is sessions; ``"c4"`` sessions, ``"r0.5"`` a rate,
    ``"x2"`` a trace's speedup and ``"x2_w600+300"`` with its window (its rate is the window's, which the grid
    knows)."""
    if isinstance(load, int):
        return load, 0.0, 0.0, ""
    if not re.fullmatch(LOAD_PATTERN, load):
        raise ConfigError(
            f"load {load!r}: expected c<sessions>, r<requests per second> or x<trace speedup>[_w<start>[+<seconds>]]"
        )
    kind, value = load[0], load[1:]
    if kind == "c":
        return int(value), 0.0, 0.0, ""
    if kind == "r":
        return 0, float(value), 0.0, ""
    speedup, _, window = value.partition("_")
    return 0, 0.0, float(speedup), window
