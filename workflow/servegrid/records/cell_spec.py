"""A grid point (:class:`CellSpec`) and its load: closed-loop sessions (``c4``), an open-loop offered rate (``r0.5``)
or a trace replayed at a speedup (``x2``), in one of its windows (``x2_w600+300``: from 600 s for 300 s).

A closed-loop cell runs N sessions that each send their next request when the last one ends: "how fast for N
users who wait for each other". An open-loop cell sends on a seeded arrival schedule at an offered rate whatever
the server does: "does it keep up with my traffic". A trace cell replays a window of a trace's own arrivals,
``speedup`` times as fast: "does it keep up with *this* traffic". The load is the last part of a cell's name, so every
closed-loop cell keeps the name (and file) it had before rates existed, and a trace cell of the whole trace the one
it had before windows existed.

On disk (a cell file's ``cell`` entry, the tables' columns) a load is still the four keys it always was,
``concurrency``, ``rate``, ``speedup`` and ``window``, 0 or "" where they do not apply: :meth:`CellSpec.entry` writes
them and :meth:`CellSpec.from_entry` reads them back, in this module alone. Everywhere else a load is one of
:class:`Sessions`, :class:`Rate` or :class:`Replay`, and :attr:`CellSpec.open_loop` is the one answer to "open loop?".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from servegrid import paths

# What a cell file's name carries after its context (a Snakemake wildcard constraint too).
NUMBER = r"\d+(?:\.\d+)?"
WINDOW_PATTERN = rf"w{NUMBER}(?:\+{NUMBER})?"
LOAD_PATTERN = rf"c\d+|r{NUMBER}|x{NUMBER}(?:_{WINDOW_PATTERN})?"


def rate_label(rate: float) -> str:
    """A rate as a cell's name shows it: ``2`` for 2.0, ``0.5``, ``0.25`` (no float noise, no trailing zeros)."""
    text = f"{rate:.6f}".rstrip("0").rstrip(".")
    if float(text) != rate:
        raise ValueError(f"rate {rate!r}: at most six decimals")
    return text


@dataclass(frozen=True, order=True)
class Sessions:
    """Closed loop: ``count`` sessions, each sending its next request when its last one ended."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"a closed-loop cell has at least one session (not {self.count})")

    @property
    def label(self) -> str:
        return f"c{self.count}"


@dataclass(frozen=True, order=True)
class Rate:
    """Open loop: ``per_s`` requests (conversations) a second offered on a seeded schedule of ``pattern``
    (``poisson``, ``gamma``, ...; "" where the cell does not say, as in a name parsed alone)."""

    per_s: float
    pattern: str = ""

    def __post_init__(self) -> None:
        if not self.per_s > 0:
            raise ValueError(f"an open-loop cell offers a positive rate (not {self.per_s})")

    @property
    def label(self) -> str:
        return f"r{rate_label(self.per_s)}"


@dataclass(frozen=True, order=True)
class Replay:
    """A trace's own arrivals in ``window`` ("" for the whole trace; servegrid.modes.trace_file.Window.label),
    ``speedup`` times as fast. ``per_s``: the replayed arrivals' mean rate, which only the trace knows (the grid
    fills it; 0.0 in a name parsed alone)."""

    speedup: float
    window: str = ""
    per_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"a trace cell replays at a positive speedup (not {self.speedup})")

    @property
    def label(self) -> str:
        return f"x{rate_label(self.speedup)}" + (f"_{self.window}" if self.window else "")


Load = Sessions | Rate | Replay


def parse_load(load: int | str) -> Load:
    """The load a cell's name carries: an int is sessions; ``"c4"`` sessions, ``"r0.5"`` a rate, ``"x2"`` a
    trace's speedup and ``"x2_w600+300"`` with its window. ValueError naming the load if it is none of these."""
    if isinstance(load, int):
        return Sessions(load)
    if not re.fullmatch(LOAD_PATTERN, load):
        raise ValueError(
            f"load {load!r}: expected c<sessions>, r<requests per second> or x<trace speedup>[_w<start>[+<seconds>]]"
        )
    kind, value = load[0], load[1:]
    if kind == "c":
        return Sessions(int(value))
    if kind == "r":
        return Rate(float(value))
    speedup, _, window = value.partition("_")
    return Replay(float(speedup), window)


@dataclass(frozen=True, order=True)
class CellSpec:
    """One grid point: configuration × workload mode × context × load."""

    configuration: str
    mode: str
    context: int
    load: Load

    @property
    def open_loop(self) -> bool:
        """Whether the cell sends on a schedule whatever the server does (a rate, a replayed trace): the one place
        that answers it."""
        return not isinstance(self.load, Sessions)

    @property
    def sessions(self) -> int | None:
        return self.load.count if isinstance(self.load, Sessions) else None

    @property
    def id(self) -> str:
        return f"{self.configuration}/{self.mode}/ctx{self.context}_{self.load.label}"

    @property
    def path(self) -> str:
        return paths.cell(self.configuration, self.mode, self.context, self.load.label)

    def top_up_path(self, round_: int) -> str:
        """The file of this cell's top-up in round ``round_`` (sampling that serves the verdict)."""
        return paths.top_up(self.configuration, self.mode, self.context, self.load.label, round_)

    def entry(self) -> dict[str, Any]:
        """The cell as a cell file's ``cell`` entry and the tables' key columns hold it (their keys never change:
        measured files carry them)."""
        load = self.load
        return {
            "configuration": self.configuration,
            "mode": self.mode,
            "context": self.context,
            "concurrency": load.count if isinstance(load, Sessions) else 0,
            "rate": 0.0 if isinstance(load, Sessions) else load.per_s,
            "speedup": load.speedup if isinstance(load, Replay) else 0.0,
            "window": load.window if isinstance(load, Replay) else "",
        }

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], pattern: str = "") -> CellSpec:
        """A cell from its ``cell`` entry (a cell file's, upgraded) or a table row with the same keys; an absent
        key means what it meant before it existed (no rate: closed loop; no speedup: no trace; no window: whole)."""
        speedup, rate = float(entry.get("speedup") or 0.0), float(entry.get("rate") or 0.0)
        load: Load
        if speedup:
            load = Replay(speedup, str(entry.get("window") or ""), rate)
        elif rate:
            load = Rate(rate, pattern)
        else:
            load = Sessions(int(entry["concurrency"]))
        return cls(str(entry["configuration"]), str(entry["mode"]), int(entry["context"]), load)
