"""The grid's progress line, logged as each cell job starts: how many of the grid's cells are measured with the
current settings, and an ETA from the most recently written ones.

Reading every cell file's footer for it cost 0.5 to 1.5 ms a file, 5 to 15 s a job at 10,000 cells, and so grew with the
square of the grid over a run (docs/scale.md). The facts the line needs are kept instead in a small index beside
the cells, :data:`INDEX` (``results/cells/.grid-progress.json``): per cell file, a hash of the settings it was
measured with, its wall time, and the file's size, mtime and inode when that was read. Each cell job adds its own
cell after writing it (:func:`record`), under a file lock (:data:`LOCK`), so that cell jobs running side by side
(Slurm, one configuration per GPU) lose nobody's entry. The line then takes a listing (one ``stat`` per cell) and
the index, and reads a footer only for a file the index does not know as it is now (written by another servegrid,
rewritten, or the index missing): it is then read once and its entry written back.

The line never fails a cell: an index that is missing or unreadable is rebuilt from the footers (once); one
written by a newer servegrid is not read nor overwritten (a warning, and the footers are read as before); and
anything else that goes wrong leaves a line that says the progress is unknown.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from servegrid import atomic, paths, progress
from servegrid.config import CellSpec, Experiment, canonical_json
from servegrid.errors import CellFileError, NewerFormatError, ServegridError
from servegrid.records import cell_file
from servegrid.records.cell_record import CellRecord

log = logging.getLogger(__name__)

RECENT_CELLS = 20  # the grid's ETA: the mean wall time of this many most recently written cells
INDEX = f"{paths.RESULTS}/cells/.grid-progress.json"
LOCK = f"{paths.RESULTS}/cells/.grid-progress.lock"
FORMAT = "servegrid grid progress index"
VERSION = 1  # raised when an entry's meaning changes: an older servegrid then refuses the file instead of misreading it
LOCK_WAIT_S = 30.0  # an index update gives up (the line is only a log line) after waiting this long for the lock


class Entry(NamedTuple):
    """What the grid line needs of one cell file, and which version of the file it was read from. In the index, a
    list of these fields in this order (:data:`FIELDS`)."""

    settings: str | None  # settings_hash of the footer's settings; None: no readable footer (never counted)
    wall_s: float | None  # ended_at - started_at: the cell's wall time, its server's start included
    mtime_ns: int
    size: int
    ino: int

    def describes(self, stat: os.stat_result) -> bool:
        return self.mtime_ns == stat.st_mtime_ns and self.size == stat.st_size and self.ino == stat.st_ino

    @classmethod
    def from_json(cls, raw: Any) -> Entry | None:
        """None for anything but a well-formed entry (it is then read again from its footer)."""
        if type(raw) is not list or len(raw) != len(FIELDS):
            return None
        settings, wall, mtime_ns, size, ino = raw
        if not (settings is None or type(settings) is str) or not (wall is None or type(wall) in (float, int)):
            return None
        if not (type(mtime_ns) is type(size) is type(ino) is int):
            return None
        return cls(settings, wall, mtime_ns, size, ino)


FIELDS = Entry._fields


class NewerIndex(NewerFormatError):
    """The index was written by a newer servegrid: not read, not overwritten."""


def settings_hash(settings: Mapping[str, Any]) -> str:
    """The hash a cell's settings are compared by: equal for a footer's settings and the config's cell settings
    exactly when the two are the same JSON (Snakemake's params compare the same canonical JSON)."""
    return hashlib.sha256(canonical_json(settings).encode()).hexdigest()[:16]


# ---- the line --------------------------------------------------------------------------------------------------------
def grid_line(experiment: Experiment, cell: CellSpec) -> str:
    """How far the grid is: its cells measured with the current settings, and an ETA from the most recently written
    ones. Never raises: the line is a log line, and the cell is measured whatever it says."""
    try:
        return _grid_line(experiment, cell)
    except Exception as exc:  # an unforeseen fault in a log line must not fail the cell
        log.warning("the grid's progress line failed (%s); the cell goes on", exc, exc_info=True)
        return f"grid: starting {cell.id} (progress unknown: {exc})"


def _grid_line(experiment: Experiment, cell: CellSpec) -> str:
    cells = experiment.cells()
    known, writable, damaged = _load()
    found: list[tuple[CellSpec, Entry, int]] = []  # the cells with a file: each file's entry and mtime
    refreshed: dict[str, Entry] = {}
    gone: list[str] = []
    for c in cells:
        path = c.path  # made once: a cell's path is formatted each time it is asked for
        try:
            stat = os.stat(path)
        except OSError:  # not written yet (or gone since: a deleted cell is to be measured again)
            if path in known:
                gone.append(path)
            continue
        entry = known.get(path)
        if entry is None or not entry.describes(stat):
            entry = refreshed[path] = _from_footer(path, stat)
        found.append((c, entry, stat.st_mtime_ns))
    if writable and (refreshed or damaged):
        try:
            _update(refreshed, gone)
        except (OSError, ServegridError) as exc:  # the lock held too long, a full disk: read again next time
            log.warning("%s: not updated (%s)", INDEX, exc)
    # A file measured with other settings is to be measured again (a rerun after a config edit): not counted.
    # Only the cells with a file have their settings made and hashed (docs/scale.md: the line's largest part).
    present = [
        (mtime_ns, entry.wall_s)
        for c, entry, mtime_ns in found
        if entry.settings is not None and entry.settings == settings_hash(experiment.cell_settings(c))
    ]
    left = len(cells) - len(present)
    line = f"grid: {len(present)} of {len(cells)} cells measured, starting {cell.id}"
    recent = sorted(present, key=lambda p: p[0])[-RECENT_CELLS:]
    walls = [wall for _, wall in recent if wall is not None]
    if walls and left:
        mean = sum(walls) / len(walls)
        pace = f"{progress.duration(mean)} a cell over the last {len(walls)}"
        line += f"; about {progress.duration(mean * left)} left ({pace})"
    return line


def _from_footer(path: str, stat: os.stat_result) -> Entry:
    """A cell file's entry, from its footer's metadata (the rows are not read)."""
    settings = wall = None
    try:
        cell = cell_file.read_record(path)
        settings, wall = settings_hash(cell.settings), cell.wall_s
    except (OSError, ValueError, TypeError, CellFileError, NewerFormatError):
        pass
    return Entry(settings, wall, stat.st_mtime_ns, stat.st_size, stat.st_ino)


# ---- the index ------------------------------------------------------------------------------------------------------
def record(cell: CellSpec, out_path: Path | str, measured: CellRecord) -> None:
    """Add the cell file just written to the index (a cell job, after writing it). Never raises: without its entry,
    the next line reads that one footer."""
    try:
        if Path(out_path).resolve() != Path(cell.path).resolve():
            return  # written elsewhere (servegrid cell --out, a test): not one of the grid's files
        stat = os.stat(out_path)
        entry = Entry(settings_hash(measured.settings), measured.wall_s, stat.st_mtime_ns, stat.st_size, stat.st_ino)
        _update({cell.path: entry})
    except Exception as exc:  # the cell is written: a fault in its progress entry must not fail it
        log.warning("cell %s: not added to the grid's progress index %s (%s)", cell.id, INDEX, exc, exc_info=True)


def _load() -> tuple[dict[str, Entry], bool, bool]:
    """The index's entries, whether this servegrid may write the index, and whether it must (it is unreadable).
    Missing or unreadable: no entry (the footers are read, and the index written again); newer: no entry, and not
    to be overwritten."""
    try:
        return _read(INDEX), True, False
    except FileNotFoundError:
        return {}, True, False
    except NewerIndex as exc:
        log.warning("%s; the grid's progress line reads the cell files instead (slower)", exc)
        return {}, False, False
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); rebuilt from the cell files", INDEX, exc)
        return {}, True, True


def _read(path: str) -> dict[str, Entry]:
    """The index at ``path``: FileNotFoundError, NewerIndex, or ValueError for anything malformed."""
    with open(path, encoding="utf-8") as handle:
        raw = json.load(handle)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("cells"), dict):
        raise ValueError("not a grid progress index")
    version = raw.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"version {version!r} is not a number")
    if version > VERSION:
        raise NewerIndex(
            f"{path}: format version {version}, written by a newer servegrid (this one reads version {VERSION}); "
            f"it is left as it is (delete it to have this servegrid rebuild it)"
        )
    if version < VERSION:
        raise ValueError(f"format version {version}, older than {VERSION}")
    if raw.get("fields") != list(FIELDS):
        raise ValueError(f"its entries' fields are {raw.get('fields')!r}, not {list(FIELDS)}")
    return {key: entry for key, value in raw["cells"].items() if (entry := Entry.from_json(value)) is not None}


def _update(entries: Mapping[str, Entry], gone: Iterable[str] = ()) -> None:
    """Merge ``entries`` into the index and drop ``gone``, under the lock: the index read again under it, so that
    an update made meanwhile by another cell job is kept. An entry already there from a later version of its file
    is kept too."""
    with _locked():
        try:
            current = _read(INDEX)
        except FileNotFoundError:
            current = {}
        except NewerIndex:
            return  # written meanwhile by a newer servegrid: its own
        except (OSError, ValueError):
            current = {}  # unreadable: replaced
        for key, entry in entries.items():
            there = current.get(key)
            if there is None or there.mtime_ns <= entry.mtime_ns:
                current[key] = entry
        for key in gone:
            current.pop(key, None)
        document = {
            "format": FORMAT,
            "version": VERSION,
            "fields": FIELDS,
            "cells": {key: current[key] for key in sorted(current)},
        }
        atomic.write_text(INDEX, json.dumps(document, separators=(",", ":")) + "\n")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The index's lock; TimeoutError after :data:`LOCK_WAIT_S` (a cell job stuck holding it must not stop others)."""
    Path(LOCK).parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "a+") as handle:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{LOCK}: still held by another process after {LOCK_WAIT_S:.0f} s") from None
                time.sleep(0.02)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
