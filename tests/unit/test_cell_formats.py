"""Cell files of every format servegrid ever wrote are read, aggregated with today's and reach the report.

The fixtures in tests/data/cells/ were each written by the commit in their name running its own cell job
(tests/data/cells/README.md). A measured cell is GPU hours: none of them may be set aside, and none re-measured
because servegrid's code changed.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from helpers import REPO, synthetic_cell
from servegrid.analysis import aggregation
from servegrid.analysis.requests_table import load_cells
from servegrid.config import Experiment
from servegrid.errors import CellFileError, NewerFormatError
from servegrid.paths import RunTables
from servegrid.records import cell_file, cell_format

FIXTURES = REPO / "tests" / "data" / "cells"
# Each fixture's on-disk format (records/cell_format.py's table): 1 under servegrid.cell, 2 under
# servegrid.pipeline.cell_job without a checksum, 3 with it.
FORMATS = {
    "20261129-3adb1d4-decode": 1,
    "20261129-71a4356-single_turn": 1,
    "20261129-6c98e80-multi_turn": 1,
    "20261129-26fff94-decode": 1,
    "20261129-239b721-single_turn": 1,
    "20261130-f3cf953-multi_turn": 1,
    "20261201-d459d5d-decode": 1,
    "20261203-9b2d444-single_turn": 1,
    "20261203-8976f12-multi_turn": 1,
    "20261203-09dedc6-decode": 1,
    "20261205-ac4febd-single_turn": 2,
    "20261205-ac4febd-refused": 2,
    "20261205-af271fa-multi_turn": 3,
    "20261205-f9f8059-rate": 3,
    "20261205-78e4c8a-trace": 3,
    "20261206-47f9ef4-trace_window": 3,
    "20261206-47f9ef4-single_turn": 3,
    "20261206-47f9ef4-decode_both": 3,
}
# One cell of each on-disk format with distinct cell keys: aggregated together, with today's, into one report.
ONE_OF_EACH = ["20261129-3adb1d4-decode", "20261205-ac4febd-single_turn", "20261205-af271fa-multi_turn"]


def test_every_fixture_is_listed():
    assert sorted(p.stem for p in FIXTURES.glob("*.parquet")) == sorted(FORMATS)


def experiment() -> Experiment:
    """The fixtures' own config (tests/data/cells/make/basic.json: configuration "honest"), plus "today"."""
    raw = json.loads((FIXTURES / "make" / "basic.json").read_text())
    raw["engine"]["command"] = ["vllm", "serve", "{model}"]
    raw["configurations"]["today"] = {"label": "today", "prefix_caching": True}
    return Experiment(raw)


def place(name: str, root: Path) -> str:
    """A fixture copied to where its cell lives in a results/ tree; its path."""
    path = Path(root) / cell_file.read_record(FIXTURES / f"{name}.parquet").spec.path
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(FIXTURES / f"{name}.parquet", path)
    return str(path)


def todays_cells(root: Path) -> list[str]:
    paths = []
    for mode, context in (("decode", 64), ("single_turn", 64), ("multi_turn", 32)):
        path = root / "results" / "cells" / "today" / mode / f"ctx{context}_c1.parquet"
        synthetic_cell(path, "today", mode, context, 1, ttft_s=0.05, interval_s=0.01, requests=8)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_past_format_is_read_as_todays_record(name):
    table, record = cell_file.read_cell(FIXTURES / f"{name}.parquet")
    assert record.format_version == FORMATS[name]
    assert table.schema.names == cell_file.CELL_SCHEMA.names  # today's columns, in today's order
    frame = table.to_pandas()
    assert frame["repeat"].notna().all() and frame["route"].isin(["direct", "proxy"]).all()
    assert record.spec.configuration == "honest" and record.id.startswith("honest/")
    assert record.settings and record.server["configuration"] == "honest"
    assert record.refused or record.server_metrics is not None


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_past_format_aggregates_with_todays_cells(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cells = [place(name, tmp_path), *todays_cells(tmp_path)]
    tables = RunTables.under(tmp_path / "tables")
    summary = aggregation.aggregate(experiment(), cells, tables)
    assert not list(tmp_path.rglob("*.damaged-*"))  # nothing set aside
    record = cell_file.read_record(FIXTURES / f"{name}.parquet")
    if record.refused:
        servers = pd.read_parquet(tables.servers)
        assert record.refused in set(servers["refused"].dropna())
        return
    own = summary[summary["cell_id"] == record.id]
    rows = pq.read_table(FIXTURES / f"{name}.parquet").to_pandas()
    measured = rows[(rows["phase"] == "measured") & (rows.get("route", "direct") == "direct")]
    assert len(own) == 1 and int(own["n_requests"].iloc[0]) == len(measured) > 0
    assert set(summary["configuration"]) == {"honest", "today"}


@pytest.mark.parametrize("lang", ["pt", "hu"])
def test_one_cell_of_each_format_reaches_the_report(lang, tmp_path, monkeypatch):
    from servegrid.reporting import document

    monkeypatch.chdir(tmp_path)
    cells = [place(name, tmp_path) for name in ONE_OF_EACH] + todays_cells(tmp_path)
    tables = RunTables.under(tmp_path / "tables")
    the_experiment = experiment()
    summary = aggregation.aggregate(the_experiment, cells, tables)
    assert len(summary) == len(cells)
    html = tmp_path / f"r-{lang}.html"
    document.render(the_experiment, lang, tables, tmp_path / "no-figures", html_out=str(html))
    text = html.read_text(encoding="utf-8")
    # The provenance counts every cell, and its dates begin with the oldest fixture's (2026-11-29).
    (measured,) = re.findall(r"<td>(\d+), [^<]*29[^<]*2026[^<]*</td>", text)
    assert int(measured) == len(cells)


def newer_format_copy(path: Path, version: int) -> None:
    """``path`` rewritten as a newer servegrid would write it: format ``version``, checksum right."""
    table = pq.read_table(path)
    facts = json.loads(table.schema.metadata[cell_format.FOOTER_KEY])
    metadata = cell_format.encode(facts)
    encoded = json.dumps({**facts, "format_version": version}, sort_keys=True).encode()
    import hashlib

    metadata.update(
        {
            cell_format.FOOTER_KEY: encoded,
            cell_format.FORMAT_KEY: str(version).encode(),
            cell_format.SHA256_KEY: hashlib.sha256(encoded).hexdigest().encode(),
        }
    )
    pq.write_table(table.replace_schema_metadata(metadata), path)


def test_a_file_of_a_newer_format_is_refused_saying_so_and_left_in_place(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cells = todays_cells(tmp_path)
    newer_format_copy(Path(cells[0]), cell_format.FORMAT_VERSION + 1)
    before = Path(cells[0]).read_bytes()
    with pytest.raises(NewerFormatError, match=r"ctx64_c1\.parquet: a cell file of format 5, written by a newer"):
        load_cells(cells)
    assert Path(cells[0]).read_bytes() == before and not list(tmp_path.rglob("*.damaged-*"))


def test_a_newer_format_is_not_damage_but_a_damaged_file_still_is(tmp_path):
    """The two are told apart: a checksum that fails in today's format is damage (set aside), as before."""
    path = tmp_path / "cell.parquet"
    synthetic_cell(path, "a", "decode", 64, 1, ttft_s=0.1, interval_s=0.01)
    table = pq.read_table(path)
    metadata = dict(table.schema.metadata)
    metadata[cell_format.SHA256_KEY] = b"0" * 64
    pq.write_table(table.replace_schema_metadata(metadata), path)
    with pytest.raises(CellFileError, match="does not match its checksum"):
        load_cells([str(path)])
    assert list(tmp_path.glob("cell.parquet.damaged-*"))


def test_todays_files_carry_their_format_under_a_key_named_for_it(tmp_path):
    path = tmp_path / "cell.parquet"
    synthetic_cell(path, "a", "decode", 64, 1, ttft_s=0.1, interval_s=0.01)
    metadata = pq.read_schema(path).metadata
    assert metadata[cell_format.FORMAT_KEY] == str(cell_format.FORMAT_VERSION).encode()
    assert json.loads(metadata[cell_format.FOOTER_KEY])["format_version"] == cell_format.FORMAT_VERSION
    assert not any(key.startswith(b"servegrid.pipeline") for key in metadata)  # no module's name on disk


def test_what_an_older_format_lacks_is_named_in_the_tables_and_the_run_summary(tmp_path, monkeypatch):
    """The first format (3adb1d4) had no client monitor, no cache state and no server TTFT: its cell is compared,
    its summary row says what it lacks, and the run's last lines say so; today's cells lack nothing."""
    from servegrid.reporting import terminal_summary

    monkeypatch.chdir(tmp_path)
    cells = [place("20261129-3adb1d4-decode", tmp_path), *todays_cells(tmp_path)]
    the_experiment = experiment()
    summary = aggregation.aggregate(the_experiment, cells, RunTables())
    lacking = dict(zip(summary["cell_id"], summary["older_format_lacks"], strict=True))
    assert "client's own load" in lacking["honest/decode/ctx64_c1"]
    assert "server's own TTFT" in lacking["honest/decode/ctx64_c1"]
    assert [v for k, v in lacking.items() if k.startswith("today/")] == ["", "", ""]
    assert set(summary["cell_format"]) == {1, cell_format.FORMAT_VERSION}
    text = terminal_summary.text(the_experiment)
    assert "Read from an older cell-file format (1 cells" in text
    assert "honest/decode/ctx64_c1: lacks the prefix cache's state" in text


@pytest.mark.parametrize("name", [n for n in sorted(FORMATS) if n.startswith("20261206-47f9ef4")])
def test_the_record_writes_the_footer_47f9ef4_wrote_key_for_key(name):
    """CellRecord.facts() is what today's writer puts in the footer: for a cell of the last format before the
    record existed, its facts are the file's footer exactly (no key renamed, none added but the format number)."""
    raw = json.loads(pq.read_schema(FIXTURES / f"{name}.parquet").metadata[b"servegrid.pipeline.cell_job"])
    record = cell_file.read_record(FIXTURES / f"{name}.parquet")
    assert json.dumps(record.facts(), sort_keys=True) == json.dumps(raw, sort_keys=True)
