"""docs/parquet-schema.md names every column the tables have."""

from __future__ import annotations

import re

import pandas as pd
from test_aggregate_verdict import demo_grid, run_aggregate  # noqa: F401 - the fixture is reused

from helpers import REPO

DOC = (REPO / "docs" / "parquet-schema.md").read_text()


def documented() -> set[str]:
    names = set()
    for token in re.findall(r"`([^`]+)`", DOC):
        # expand `{a,b}_{p50,p90}` patterns
        parts = re.split(r"(\{[^}]*\})", token)
        expanded = [""]
        for part in parts:
            options = part[1:-1].split(",") if part.startswith("{") else [part]
            expanded = [e + o for e in expanded for o in options]
        names.update(expanded)
    return names


def test_every_column_is_documented(demo_grid, tmp_path):  # noqa: F811
    experiment, cells = demo_grid
    run_aggregate(experiment, cells, tmp_path)
    names = documented()
    for table in ("requests", "summary", "servers", "comparisons", "verdict", "crossovers"):
        columns = set(pd.read_parquet(tmp_path / f"{table}.parquet").columns)
        missing = sorted(columns - names)
        assert not missing, f"{table}: undocumented columns {missing}"
