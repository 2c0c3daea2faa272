"""Cell files → the per-request table: every cell file's rows, keyed by their cell, and each file's metadata.

Files of every format servegrid wrote are read (servegrid.records.cell_format upgrades them in memory). A file that
cannot be read back (damaged, truncated) is moved aside and named, so that the next run measures its cell again; a
file a newer servegrid wrote is refused and left where it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from servegrid.analysis import pooled_cells
from servegrid.errors import CellFileError, NewerFormatError
from servegrid.records import cell_file
from servegrid.records.cell_record import CellRecord
from servegrid.records.cell_spec import CellSpec

# rate: requests/s offered to an open-loop cell, 0.0 for a closed-loop one (whose concurrency is its sessions; 0 for
# an open-loop cell). window: a trace cell's window ("" for the whole trace and every other cell). Cell files from
# before either existed have none: closed loop, no window.
CELL_KEYS = ["configuration", "mode", "context", "concurrency", "rate", "window"]
# The cells of one sweep of loads: a mode at one context (a trace: in one window), each configuration at each load.
SERIES_KEYS = ["mode", "context", "window"]


def cell_values(cell: CellSpec) -> dict[str, Any]:
    """The cell's key columns, as the tables hold them (CellSpec.entry)."""
    entry = cell.entry()
    return {key: entry[key] for key in CELL_KEYS}


def cell_key(cell: CellSpec) -> tuple[Any, ...]:
    entry = cell.entry()
    return tuple(entry[key] for key in CELL_KEYS)


def with_window(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a ``window`` column (tables from before windows existed have none: no window)."""
    if "window" not in frame:
        frame = frame.assign(window="")
    return frame.assign(window=frame["window"].fillna("").astype(str))


def load_cells(paths: list[str], top_up_paths: Sequence[str] = ()) -> tuple[pd.DataFrame, list[CellRecord]]:
    """Every cell file's rows, and its record (one per route it was measured by), each cell's top-ups pooled into it
    (servegrid.analysis.pooled_cells). Files that cannot be read back (a checksum that fails, a truncated file) are
    all moved aside first, and the error lists them: the next run measures them again."""
    tables: list[pa.Table] = []
    metas: list[CellRecord] = []
    damaged: list[str] = []
    newer: list[str] = []
    metas_by_route: list[CellRecord] = []
    top_ups: dict[str, list[tuple[str, tuple[pa.Table, CellRecord]]]] = {}
    for path in top_up_paths:
        try:
            measured = cell_file.read_cell(path)
        except NewerFormatError as exc:
            newer.append(str(exc))
            continue
        except CellFileError as exc:
            damaged.append(f"{exc}\n  kept as {cell_file.set_aside(path)}")
            continue
        top_ups.setdefault(measured[1].spec.id, []).append((path, measured))
    for path in paths:
        try:
            table, meta = cell_file.read_cell(path)
        except NewerFormatError as exc:  # not damage: left where it is
            newer.append(str(exc))
            continue
        except CellFileError as exc:
            damaged.append(f"{exc}\n  kept as {cell_file.set_aside(path)}")
            continue
        rounds = sorted(top_ups.get(meta.spec.id, []), key=lambda t: t[1][1].cell_settings.top_up_round)
        for top_up_path, (_, top) in rounds:
            if not pooled_cells.belongs(top, meta):
                damaged.append(
                    f"{top_up_path}: a top-up of {top.spec.id} measured with other settings than its cell (the cell "
                    f"was measured again since)\n  kept as {cell_file.set_aside(top_up_path)}"
                )
        table, meta = pooled_cells.pool((table, meta), [r for r in rounds if pooled_cells.belongs(r[1][1], meta)])
        tables.append(table.replace_schema_metadata(None))
        metas.append(meta)
        # A cell measured by more than one route: its other routes' phases as cells of their own (their rows
        # are told apart by the route column).
        metas_by_route += meta.by_route()[1:]
    if newer:
        raise NewerFormatError(
            f"{len(newer)} cell file(s) were written by a newer servegrid; they are left as they are: upgrade "
            "servegrid (git pull) to aggregate them, or run this one in a results/ of its own:\n" + "\n".join(newer)
        )
    if damaged:
        raise CellFileError(
            f"{len(damaged)} cell file(s) could not be read back and were moved aside; the next run measures "
            "those cells again:\n" + "\n".join(damaged)
        )
    if not tables:
        return pd.DataFrame(columns=CELL_KEYS), metas + metas_by_route
    # One Arrow table, one conversion: a DataFrame per cell and a concat cost most of the reading (docs/scale.md).
    df = pa.concat_tables(tables).to_pandas()  # each upgraded to today's columns (cell_format.upgrade_table)
    counts = [t.num_rows for t in tables]
    entries = [m.spec.entry() for m in metas]
    keys = {key: np.repeat(np.array([e[key] for e in entries], dtype=object), counts) for key in CELL_KEYS}
    cell_keys = pd.DataFrame(keys).astype(
        {
            "context": "int64",
            "concurrency": "int64",
            "rate": "float64",
            "configuration": "str",
            "mode": "str",
            "window": "str",
        }
    )
    df = pd.concat([cell_keys, df], axis=1)
    return df, metas + metas_by_route


def closed_loop(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of closed-loop cells (sessions): what the figures by concurrency, the verdict and the production
    table are drawn from. Tables from before rates existed have no rate column: all closed loop."""
    if "rate" not in frame or frame.empty:
        return frame
    return frame[frame["rate"].fillna(0.0) == 0.0].reset_index(drop=True)
