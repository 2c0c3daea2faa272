"""The grid's progress line, counted from a listing and the progress index (servegrid.pipeline.grid_progress):
it says what the footers say, after a config edit, a deleted or rewritten cell file, with an index that is
corrupt or of a newer format, and with cell jobs updating the index side by side."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
from test_aggregate_verdict import decode_only

from helpers import with_changes
from servegrid.config import CellSpec, Experiment
from servegrid.pipeline import grid_progress
from servegrid.pipeline.grid_progress import INDEX, grid_line
from servegrid.records import cell_file
from servegrid.records.cell_record import CellRecord

FIELDS = json.dumps(grid_progress.FIELDS)
TIMED = {"started_at": "2026-12-03T10:00:00.000+00:00", "ended_at": "2026-12-03T10:01:30.000+00:00"}


def write(experiment: Experiment, cell: CellSpec, *, indexed: bool = True, settings: dict | None = None) -> None:  # type: ignore[type-arg]
    """The cell's file as a cell job writes it, and (``indexed``) its entry as the cell job then adds it."""
    settings = experiment.cell_settings(cell) if settings is None else settings
    meta = CellRecord(cell, settings, None, {}, **TIMED)
    cell_file.write_cell(cell.path, [], meta)
    if indexed:
        grid_progress.record(cell, cell.path, meta)


@pytest.fixture
def footers_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The cell files whose footer the line reads."""
    read: list[str] = []
    original = grid_progress._from_footer

    def counted(path: str, stat: os.stat_result) -> grid_progress.Entry:
        read.append(path)
        return original(path, stat)

    monkeypatch.setattr(grid_progress, "_from_footer", counted)
    return read


@pytest.fixture
def grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_raw) -> Experiment:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    return decode_only(demo_raw)


def test_the_line_reads_the_index_not_the_footers_and_a_config_edit_uncounts_the_cells(grid, footers_read, demo_raw):
    first, second = grid.cells()
    write(grid, first)
    assert grid_line(grid, second) == (
        f"grid: 1 of 2 cells measured, starting {second.id}; about 1 min 30 s left (1 min 30 s a cell over the last 1)"
    )
    assert footers_read == []  # the cell job's own entry: no footer read
    # A config edit that changes the cells' settings: the files stay, measured with the old settings.
    edited = decode_only(with_changes(demo_raw, **{"workloads.decode.output_tokens": 17}))
    assert grid.cell_settings(first) != edited.cell_settings(first)
    assert grid_line(edited, second) == f"grid: 0 of 2 cells measured, starting {second.id}"
    write(edited, first)
    assert grid_line(edited, second).startswith(f"grid: 1 of 2 cells measured, starting {second.id}; about")
    assert footers_read == []


def test_a_deleted_cell_file_is_not_counted(grid, footers_read):
    first, second = grid.cells()
    write(grid, first)
    write(grid, second)
    assert grid_line(grid, first) == f"grid: 2 of 2 cells measured, starting {first.id}"
    os.unlink(first.path)  # its entry stays in the index
    assert grid_line(grid, first).startswith(f"grid: 1 of 2 cells measured, starting {first.id}; about")
    assert footers_read == []


def test_a_cell_file_rewritten_without_its_entry_is_read_again(grid, footers_read):
    """Rewritten behind the index's back (an older servegrid, a copy): its entry no longer describes it."""
    first, second = grid.cells()
    write(grid, first)
    write(grid, first, indexed=False, settings={"other": "settings"})
    assert grid_line(grid, second) == f"grid: 0 of 2 cells measured, starting {second.id}"
    assert footers_read == [first.path]
    write(grid, first, indexed=False)
    assert grid_line(grid, second).startswith(f"grid: 1 of 2 cells measured, starting {second.id}; about")
    assert footers_read == [first.path, first.path]
    grid_line(grid, second)  # the entry read from the footer was written back
    assert footers_read == [first.path, first.path]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        '{"format": "servegrid grid progress index", "version": 1, "fields": ' + FIELDS + ', "cells": []}',
        '["a list"]',
        '{"format": "servegrid grid progress index", "version": "1", "fields": ' + FIELDS + ', "cells": {}}',
        '{"format": "servegrid grid progress index", "version": 1, "fields": ["wall_s"], "cells": {}}',
    ],
    ids=["not-json", "empty", "cells-not-a-mapping", "not-a-mapping", "version-not-a-number", "other-fields"],
)
def test_a_corrupt_index_is_rebuilt_from_the_footers_once(grid, footers_read, caplog, content):
    first, second = grid.cells()
    write(grid, first, indexed=False)
    write(grid, second, indexed=False, settings={"other": "settings"})
    Path(INDEX).write_text(content)
    with caplog.at_level(logging.WARNING, logger=grid_progress.__name__):
        assert grid_line(grid, second).startswith(f"grid: 1 of 2 cells measured, starting {second.id}; about")
    assert f"{INDEX}: unreadable" in caplog.text and "rebuilt from the cell files" in caplog.text
    assert sorted(footers_read) == sorted([first.path, second.path])
    index = json.loads(Path(INDEX).read_text())
    assert index["version"] == grid_progress.VERSION and sorted(index["cells"]) == sorted([first.path, second.path])
    assert grid_line(grid, second).startswith(f"grid: 1 of 2 cells measured, starting {second.id}; about")
    assert len(footers_read) == 2  # once


def test_a_malformed_entry_is_read_again_from_its_footer(grid, footers_read):
    first, second = grid.cells()
    write(grid, first)
    index = json.loads(Path(INDEX).read_text())
    index["cells"][first.path][grid_progress.FIELDS.index("wall_s")] = (
        "90"  # as the file is now, but a wall time that is no number
    )
    Path(INDEX).write_text(json.dumps(index))
    assert grid_line(grid, second) == (
        f"grid: 1 of 2 cells measured, starting {second.id}; about 1 min 30 s left (1 min 30 s a cell over the last 1)"
    )
    assert footers_read == [first.path]


def test_an_index_of_a_newer_format_is_refused_clearly_and_left_as_it_is(grid, footers_read, caplog):
    """Not read (its entries might mean something else now) nor overwritten (the newer servegrid's); the line
    reads the footers instead, and is right."""
    first, second = grid.cells()
    write(grid, first, indexed=False, settings={"other": "settings"})
    stat = os.stat(first.path)
    # An entry that would count the file were it read: the current settings, the file as it is.
    lie = grid_progress.Entry(
        grid_progress.settings_hash(grid.cell_settings(first)), 90.0, stat.st_mtime_ns, stat.st_size, stat.st_ino
    )
    newer = json.dumps(
        {
            "format": grid_progress.FORMAT,
            "version": grid_progress.VERSION + 1,
            "fields": grid_progress.FIELDS,
            "cells": {first.path: lie},
        }
    )
    Path(INDEX).write_text(newer)
    with caplog.at_level(logging.WARNING, logger=grid_progress.__name__):
        assert grid_line(grid, second) == f"grid: 0 of 2 cells measured, starting {second.id}"
        write(grid, second)  # a cell job's entry: not added to the newer index
    assert f"{INDEX}: format version {grid_progress.VERSION + 1}, written by a newer servegrid" in caplog.text
    assert "delete it to have this servegrid rebuild it" in caplog.text
    assert footers_read == [first.path]
    assert Path(INDEX).read_text() == newer


def test_the_line_never_fails_the_cell(grid, monkeypatch, caplog):
    first, second = grid.cells()

    def broken(*args: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(grid_progress, "_load", broken)
    with caplog.at_level(logging.WARNING, logger=grid_progress.__name__):
        assert grid_line(grid, second) == f"grid: starting {second.id} (progress unknown: disk on fire)"
        monkeypatch.setattr(grid_progress, "_update", broken)
        write(grid, first)  # its entry is not written; the cell is
    assert "the cell goes on" in caplog.text and "not added to the grid's progress index" in caplog.text
    assert os.path.exists(first.path)


def test_a_lock_held_too_long_leaves_the_index_as_it_was(grid, monkeypatch, caplog):
    """A cell job stuck holding the lock: the others give up on their entry after LOCK_WAIT_S, and go on."""
    import fcntl

    first, second = grid.cells()
    monkeypatch.setattr(grid_progress, "LOCK_WAIT_S", 0.2)
    Path(grid_progress.LOCK).parent.mkdir(parents=True)
    with open(grid_progress.LOCK, "a+") as held, caplog.at_level(logging.WARNING, logger=grid_progress.__name__):
        fcntl.flock(held, fcntl.LOCK_EX)
        write(grid, first)
        assert grid_line(grid, second).startswith(f"grid: 1 of 2 cells measured, starting {second.id}; about")
    assert "still held by another process after 0 s" in caplog.text
    assert not os.path.exists(INDEX)


def test_footer_settings_hash_as_the_configs_for_every_demo_cell(demo_raw):
    """A footer's settings went through JSON (cell_file.write_cell): their hash is the config's, cell by cell."""
    experiment = Experiment(demo_raw)
    for cell in experiment.cells():
        settings = experiment.cell_settings(cell)
        footer = json.loads(json.dumps(settings, sort_keys=True, default=str))
        assert grid_progress.settings_hash(footer) == grid_progress.settings_hash(settings), cell.id


WRITERS, UPDATES = 2, 40


def _add_entries(folder: str, writer: int, start: Any) -> None:
    os.chdir(folder)
    start.wait()
    for i in range(UPDATES):
        entry = grid_progress.Entry("0" * 16, 1.0, i, i, i)
        grid_progress._update({f"results/cells/w{writer}/{i}.parquet": entry})


def test_cell_jobs_updating_the_index_side_by_side_lose_no_entry(tmp_path):
    """Each update reads the index, adds its entry and writes it all back: under the lock, or entries are lost."""
    fork = multiprocessing.get_context("fork")
    start = fork.Barrier(WRITERS)
    writers = [fork.Process(target=_add_entries, args=(str(tmp_path), w, start)) for w in range(WRITERS)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    cells = json.loads((tmp_path / INDEX).read_text())["cells"]
    assert len(cells) == WRITERS * UPDATES


def test_a_cell_job_adds_its_cell_to_the_index_even_over_a_corrupt_one(sandbox, caplog):
    """The call sites: the line as the cell starts (over a corrupt index: a warning), the entry once it is written."""
    from test_cell_flags import calibration_experiment

    from servegrid.pipeline.cell_job import run_cell
    from servegrid.serving import procs

    raw = calibration_experiment().raw
    raw["workloads"] = {"decode": {"contexts": [16], "concurrency": [1], "output_tokens": 4, "requests_per_session": 2}}
    experiment = Experiment(raw)
    (cell,) = experiment.cells("honest")
    Path(INDEX).parent.mkdir(parents=True)
    Path(INDEX).write_text("{not json")
    with caplog.at_level(logging.INFO):
        run_cell(experiment, cell, cell.path, owner=procs.ProcessRef.of(os.getpid()), runtime=sandbox)
    assert f"grid: 0 of {len(experiment.cells())} cells measured, starting {cell.id}" in caplog.text
    assert f"{INDEX}: unreadable" in caplog.text
    entry = grid_progress.Entry(*json.loads(Path(INDEX).read_text())["cells"][cell.path])
    assert entry.settings == grid_progress.settings_hash(experiment.cell_settings(cell))
    assert entry.describes(os.stat(cell.path)) and entry.wall_s > 0


def test_every_index_version_ever_written_is_read():
    """tests/data/grid-progress/ holds one index of each version: each reads, entry by entry."""
    from helpers import REPO

    for fixture in sorted((REPO / "tests" / "data" / "grid-progress").glob("*.json")):
        entries = grid_progress._read(str(fixture))
        assert entries and all(len(e.settings or "") == 16 and e.size > 0 for e in entries.values()), fixture
