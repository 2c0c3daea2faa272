"""The load: when a cell's requests are sent, below the modes that say what is sent.

A mode hands the load its units of work (:class:`Work`: a request, a conversation, a trace arrival, each sent as a
:class:`Unit`); the cell's strategy (:mod:`servegrid.load.strategies`, one class per load kind, chosen in
:func:`for_cell`) sends them: closed-loop sessions in stages, arrivals on a seeded schedule at a rate, or a trace's
own arrivals at a speedup. A cell's load is read from its settings by
:attr:`servegrid.records.cell_settings.CellSettings.load` alone.
"""

from __future__ import annotations

from servegrid.load.arrivals import Arrival
from servegrid.load.base import Driver, MeasureHook, Unit, Work
from servegrid.load.open_loop import OpenLoopOutcome
from servegrid.load.stages import StagePlan
from servegrid.load.strategies import (
    LoadStrategy,
    RateStrategy,
    ReplayArrivals,
    ReplayStrategy,
    SessionsStrategy,
    for_cell,
)

__all__ = [
    "Arrival",
    "Driver",
    "LoadStrategy",
    "MeasureHook",
    "OpenLoopOutcome",
    "RateStrategy",
    "ReplayArrivals",
    "ReplayStrategy",
    "SessionsStrategy",
    "StagePlan",
    "Unit",
    "Work",
    "for_cell",
]
