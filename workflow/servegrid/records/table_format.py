"""The run's tables (``results/tables/*.parquet``) carry their format, and every reader accepts every format.

A run's tables are read back by later servegrid versions: ``servegrid compare OLD NEW`` reads an older run's,
``servegrid estimate`` an earlier run's seconds per round, and after an upgrade the figures and reports of a run
whose cells (and so whose aggregation) did not change are drawn from tables the older version wrote. Each table
says its format under :data:`FORMAT_KEY` in its Parquet metadata; a table without it is format 1 (every table before
2026-12-06). Columns added since are the readers' business (each says what an absent column meant, as
``rate``: closed loop, ``window``: none); a table of a newer format is refused naming the file.

    format  written
    1       2026-11-29 .. 2026-12-06   no number (tests/data/tables/20261206-47f9ef4/)
    2       2026-12-06 ..              servegrid.table.format = 2
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from servegrid.errors import NewerFormatError

TABLE_FORMAT = 2
FORMAT_KEY = b"servegrid.table.format"


def write(frame: pd.DataFrame, path: Path | str) -> None:
    """``frame`` as a table of today's format (not atomic by itself: write to a temporary path and rename)."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    pq.write_table(
        table.replace_schema_metadata({**(table.schema.metadata or {}), FORMAT_KEY: str(TABLE_FORMAT).encode()}), path
    )


def read(path: Path | str) -> pd.DataFrame:
    """A table of any format servegrid wrote; :class:`NewerFormatError` naming it if a newer servegrid wrote it."""
    version = format_of(path)
    if version > TABLE_FORMAT:
        raise NewerFormatError(
            f"{path}: a table of format {version}, written by a newer servegrid (this one reads formats 1 to "
            f"{TABLE_FORMAT}): read it with that servegrid, or aggregate its cells again with this one"
        )
    return pd.read_parquet(path)


def format_of(path: Path | str) -> int:
    """The table's format number (1 where it has none)."""
    raw = (pq.read_schema(path).metadata or {}).get(FORMAT_KEY)
    try:
        return int(raw.decode()) if raw is not None else 1
    except ValueError:
        raise NewerFormatError(f"{path}: its format number {raw!r} is not one this servegrid wrote") from None
