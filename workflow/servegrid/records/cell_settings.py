"""A cell's settings, typed for reading: the slice of the config its numbers depend on.

The settings are the cell rule's params and a cell file's identity (Experiment.cell_settings builds them; a golden
test pins them byte for byte), so they stay the JSON object they always were, in :attr:`CellSettings.raw`. Every
reader goes through this view: the keys are named here alone. ``workload`` is the mode's own settings, which each
mode reads by its own keys (servegrid.modes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from servegrid.records.cell_spec import Load, Rate, Replay, Sessions, parse_load


@dataclass(frozen=True)
class CellSettings:
    raw: Mapping[str, Any]

    @property
    def mode(self) -> str:
        return str(self.raw["mode"])

    @property
    def context(self) -> int:
        return int(self.raw["context"])

    @property
    def cell_id(self) -> str:
        """The cell's id (settings written before it was there: "")."""
        return str(self.raw.get("cell") or "")

    @property
    def workload(self) -> Mapping[str, Any]:
        """The mode's own settings (a trace cell's: its window's)."""
        workload: Mapping[str, Any] = self.raw["workload"]
        return workload

    @property
    def seed(self) -> int:
        return int(self.workload["seed"])

    @property
    def repeats(self) -> int:
        return int(self.workload.get("repeats") or 1)

    @property
    def first_repeat(self) -> int:
        """The number of the first repeat this run measures: 0, or a top-up's (servegrid.analysis.top_ups)."""
        return int((self.raw.get("top_up") or {}).get("first_repeat") or 0)

    @property
    def top_up_round(self) -> int:
        """0 for a cell's own run; a top-up's round from 1."""
        return int((self.raw.get("top_up") or {}).get("round") or 0)

    @property
    def temperature(self) -> float:
        return float(self.raw["sampling"]["temperature"])

    @property
    def rule(self) -> Mapping[str, Any] | None:
        """The sequential sampling rule's fields (None: a fixed count; open-loop cells, and settings from before
        sequential sampling)."""
        rule: Mapping[str, Any] | None = (self.raw.get("sampling") or {}).get("rule") or None
        return rule

    @property
    def sessions(self) -> int | None:
        """Closed-loop sessions; None for an open-loop cell."""
        value = self.raw.get("concurrency")
        return None if value is None else int(value)

    @property
    def open_loop_window(self) -> Mapping[str, Any]:
        """An open-loop cell's measured window: ``requests``, ``ramp_s``, ``max_in_flight``."""
        window: Mapping[str, Any] = self.raw["open_loop"]
        return window

    @property
    def arrival(self) -> Mapping[str, Any] | None:
        """How an open-loop cell's requests arrive (``pattern``, ``burstiness``); None for a closed-loop cell."""
        arrival: Mapping[str, Any] | None = self.raw.get("arrival")
        return arrival

    @property
    def speedup(self) -> float | None:
        """A replayed trace's speedup; None for every other cell."""
        value = self.raw.get("speedup")
        return None if value is None else float(value)

    @property
    def load(self) -> Load:
        """The cell's load: a replayed trace's speedup (in its window), an offered rate, or closed-loop sessions.
        Where the cell's :class:`~servegrid.records.cell_spec.CellSpec` is at hand, its ``load`` says the same."""
        if self.speedup:
            named = self._named_load()
            window = named.window if isinstance(named, Replay) else ""
            return Replay(self.speedup, window, float(self.raw.get("rate") or 0.0))
        if self.raw.get("rate"):
            return Rate(float(self.raw["rate"]), str((self.arrival or {}).get("pattern", "")))
        return Sessions(int(self.raw["concurrency"]))

    def _named_load(self) -> Load | None:
        """The load the cell's name carries (a trace window's label), if the settings name the cell."""
        _, _, load = self.cell_id.rsplit("/", 1)[-1].partition("_")
        try:
            return parse_load(load)
        except ValueError:
            return None
