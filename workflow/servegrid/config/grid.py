"""The grid's load keys: what shapes open-loop cells only. A cell and its load are
:class:`servegrid.records.cell_spec.CellSpec` (closed-loop sessions, an open-loop rate, a trace replayed at a speedup).
"""

from __future__ import annotations

# Keys that shape open-loop cells only: part of those cells' settings, never of a closed-loop cell's (adding rates to
# a mode reruns none of its closed-loop cells).
OPEN_LOOP_KEYS = ("arrival", "open_loop")
