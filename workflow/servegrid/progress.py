"""The pace and wording of progress lines for runs of hours (a server's start-up, a cell's stages, the grid).

Log lines rather than a progress bar, so that they land in each job's log and on the terminal alike, at
most one every :data:`INTERVAL_S` seconds per activity (a stage's end is always said). The lines themselves
are written where their facts are: the server's start-up in :mod:`servegrid.serving.launch`, a cell's stages beside
the runner (:mod:`servegrid.modes.runner`), the grid's in :mod:`servegrid.pipeline.grid_progress`.
"""

from __future__ import annotations

import time

INTERVAL_S = 10.0


class Every:
    """True at most once per ``interval_s`` (the first time after ``interval_s``)."""

    def __init__(self, interval_s: float | None = None) -> None:
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
