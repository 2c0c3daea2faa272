"""The run's tables of every format are read by the commands that read an earlier run's tables; a newer one is
refused. Fixture: tests/data/tables/20261206-47f9ef4/, the CPU demo's tables as 47f9ef4 wrote them (format 1)."""

from __future__ import annotations

import shutil

import pandas as pd
import pyarrow.parquet as pq
import pytest

from helpers import REPO
from servegrid.errors import NewerFormatError
from servegrid.planning import estimate
from servegrid.records import table_format
from servegrid.reporting import run_comparison

OLD = REPO / "tests" / "data" / "tables" / "20261206-47f9ef4"


def test_a_table_of_the_first_format_is_read():
    assert table_format.format_of(OLD / "summary.parquet") == 1
    summary = table_format.read(OLD / "summary.parquet")
    assert len(summary) == 30 and summary["valid"].any()


def test_an_older_run_compares_with_one_of_todays_format(tmp_path):
    """servegrid compare OLD NEW, OLD of format 1, NEW the same tables written in today's format: every valid cell
    compared, none moved."""
    new = tmp_path / "tables"
    new.mkdir()
    for name in ("summary", "requests"):
        table_format.write(pd.read_parquet(OLD / f"{name}.parquet"), new / f"{name}.parquet")
        assert table_format.format_of(new / f"{name}.parquet") == table_format.TABLE_FORMAT
    compared = run_comparison.compare_runs(OLD, new)
    assert len(compared) > 0 and not compared["moved"].any()


def test_an_earlier_runs_rounds_are_read_from_the_first_format(tmp_path):
    (tmp_path / "tables").mkdir()
    shutil.copyfile(OLD / "summary.parquet", tmp_path / "tables" / "summary.parquet")
    rounds = estimate.earlier_rounds(tmp_path)
    assert len(rounds) > 0 and (rounds["round_s"] > 0).all()


def test_a_table_of_a_newer_format_is_refused_naming_it(tmp_path):
    table = pq.read_table(OLD / "summary.parquet")
    newer = tmp_path / "summary.parquet"
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, table_format.FORMAT_KEY: b"3"}), newer)
    with pytest.raises(NewerFormatError, match=r"summary\.parquet: a table of format 3, written by a newer"):
        table_format.read(newer)
