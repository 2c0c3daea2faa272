"""Progress lines for runs of hours: a server's start-up, a cell's stages, the grid.

Log lines rather than a progress bar, so that they land in each job's log and on the terminal alike, at
most one every :data:`INTERVAL_S` seconds per activity (a stage's end is always said). Nothing here sits
on a measured path: the cell's line is written by a task that wakes every ten seconds, and the grid's
line is made before its server is asked for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from servegrid.records import METADATA_KEY

if TYPE_CHECKING:  # the workload modes import this module, and the config imports the modes
    from servegrid.config import Cell, Experiment
    from servegrid.modes.base import WorkloadContext

INTERVAL_S = 10.0
RECENT_CELLS = 20  # the grid's ETA: the mean wall time of this many most recently written cells

log = logging.getLogger(__name__)


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


def _wall_s(path: Path) -> float | None:
    """A cell file's wall time (its server's start included, if it started it), from the file's footer."""
    try:
        meta = json.loads((pq.read_schema(path).metadata or {})[METADATA_KEY])
        return (datetime.fromisoformat(meta["ended_at"]) - datetime.fromisoformat(meta["started_at"])).total_seconds()
    except (OSError, KeyError, ValueError, TypeError):
        return None


def grid_line(experiment: Experiment, cell: Cell) -> str:
    """How far the grid is: its cells with a file, and an ETA from the most recently written ones."""
    cells = experiment.cells()
    # A file measured with other settings is to be measured again (a rerun after a config edit): not counted.
    present = [Path(c.path) for c in cells if _up_to_date(c.path, experiment.cell_settings(c))]
    left = len(cells) - len(present)
    line = f"grid: {len(present)} of {len(cells)} cells measured, starting {cell.id}"
    recent = sorted(present, key=lambda p: p.stat().st_mtime)[-RECENT_CELLS:]
    walls = [w for w in map(_wall_s, recent) if w is not None]
    if walls and left:
        mean = sum(walls) / len(walls)
        line += f"; about {duration(mean * left)} left ({duration(mean)} a cell over the last {len(walls)})"
    return line


async def stage_ticker(ctx: WorkloadContext, stage: int, planned: int, first: int) -> None:
    """Every few seconds while a stage runs: its requests done of planned, time measured, and an ETA (the
    stage's pace, or the cell's time limit if that comes first)."""
    started = ctx.elapsed_s()
    while True:
        await asyncio.sleep(INTERVAL_S)
        done = sum(1 for r in ctx.records[first:] if r.phase == "measured" and r.end_ns is not None)
        elapsed = ctx.elapsed_s()
        eta = (elapsed - started) / done * (planned - done) if done else float("inf")
        if ctx.plan.time_limit_s is not None:
            eta = min(eta, max(0.0, ctx.plan.time_limit_s - elapsed))
        shown = "unknown" if eta == float("inf") else f"about {duration(eta)}"
        log.info(
            "cell %s: stage %d: %d of %d requests done, %s measured; stage ETA %s",
            ctx.plan.label, stage, done, planned, duration(elapsed), shown,
        )  # fmt: skip


def _up_to_date(path: str, settings: dict[str, object]) -> bool:
    """The cell file exists and was measured with ``settings`` (its footer's metadata only is read)."""
    try:
        metadata = pq.read_schema(path).metadata or {}
        return bool(json.loads(metadata[METADATA_KEY]).get("settings") == settings)
    except (OSError, KeyError, ValueError, pa.ArrowException):
        return False
