"""Cell files → the per-request table: every cell file's rows, keyed by their cell, and each file's metadata.

A file that cannot be read back is moved aside and named, so that the next run measures its cell again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from servegrid.errors import CellFileError
from servegrid.records import cell_file

# rate: requests/s offered to an open-loop cell, 0.0 for a closed-loop one (whose concurrency is its sessions; 0 for
# an open-loop cell). window: a trace cell's window ("" for the whole trace and every other cell). Cell files from
# before either existed have none: closed loop, no window.
CELL_KEYS = ["configuration", "mode", "context", "concurrency", "rate", "window"]
# The cells of one sweep of loads: a mode at one context (a trace: in one window), each configuration at each load.
SERIES_KEYS = ["mode", "context", "window"]


def cell_value(cell: Mapping[str, Any], key: str) -> Any:
    """A cell file's ``cell`` entry at ``key``, with what a file from before that key existed means by its absence."""
    return cell.get(key, "" if key == "window" else 0.0)


def cell_key(cell: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(cell_value(cell, key) for key in CELL_KEYS)


def with_window(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a ``window`` column (tables from before windows existed have none: no window)."""
    if "window" not in frame:
        frame = frame.assign(window="")
    return frame.assign(window=frame["window"].fillna("").astype(str))


def load_cells(paths: list[str]) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """Every cell file's rows and metadata. Files that cannot be read back (a checksum that fails, a
    truncated file) are all moved aside first, and the error lists them: the next run measures them again."""
    tables, metas, damaged = [], [], []
    metas_by_route: list[dict[str, Any]] = []
    for path in paths:
        try:
            table, meta = cell_file.read_cell(path)
        except CellFileError as exc:
            damaged.append(f"{exc}\n  kept as {cell_file.set_aside(path)}")
            continue
        tables.append(table.replace_schema_metadata(None))
        metas.append(meta)
        # A cell measured by more than one route: its other routes' phases as cells of their own (their rows
        # are told apart by the route column).
        for route, measured in (meta.get("other_routes") or {}).items():
            metas_by_route.append({**meta, **measured, "route": route, "other_routes": {}})
    if damaged:
        raise CellFileError(
            f"{len(damaged)} cell file(s) could not be read back and were moved aside; the next run measures "
            "those cells again:\n" + "\n".join(damaged)
        )
    if not tables:
        return pd.DataFrame(columns=CELL_KEYS), metas + metas_by_route
    # One Arrow table, one conversion: a DataFrame per cell and a concat cost most of the reading (docs/scale.md).
    # A file of an older schema lacks a newer column: it is filled with nulls.
    df = pa.concat_tables(tables, promote_options="default").to_pandas()
    counts = [t.num_rows for t in tables]
    keys = {key: np.repeat(np.array([cell_value(m["cell"], key) for m in metas], dtype=object), counts)
            for key in CELL_KEYS}  # fmt: skip
    cell_keys = pd.DataFrame(keys).astype({"context": "int64", "concurrency": "int64", "rate": "float64",
                                           "configuration": "str", "mode": "str", "window": "str"})  # fmt: skip
    df = pd.concat([cell_keys, df], axis=1)
    df["route"] = df["route"].fillna("direct") if "route" in df else "direct"  # files from before routes existed
    return df, metas + metas_by_route


def closed_loop(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of closed-loop cells (sessions): what the figures by concurrency, the verdict and the production
    table are drawn from. Tables from before rates existed have no rate column: all closed loop."""
    if "rate" not in frame or frame.empty:
        return frame
    return frame[frame["rate"].fillna(0.0) == 0.0].reset_index(drop=True)
