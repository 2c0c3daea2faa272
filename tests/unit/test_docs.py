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
    for table in ("requests", "summary", "servers", "comparisons", "verdict", "crossovers", "production", "rates"):
        columns = set(pd.read_parquet(tmp_path / f"{table}.parquet").columns)
        missing = sorted(columns - names)
        assert not missing, f"{table}: undocumented columns {missing}"


def test_the_fault_matrix_lists_every_fault_the_suite_provokes():
    """docs/reliability.md's table is copied from the fault suite's output (results/fault-matrix.md): one row per
    fault; the README links it and says how many."""
    from helpers.faults import FAULTS

    readme = (REPO / "README.md").read_text()
    assert f"provokes {len(FAULTS)} faults for real" in readme
    page = (REPO / "docs" / "reliability.md").read_text()
    section = page.split("## The fault matrix", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| fault ")]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [fault.what for fault in FAULTS.values()]
    for row in rows:
        took = row.split(" | ")[2]
        assert re.fullmatch(r"(no error|[\d.]+ s)( \(.+\))?", took), f"not a measured time: {row}"


ARCHITECTURE = (REPO / "docs" / "architecture.md").read_text()


def test_architecture_lists_every_run_table():
    """The run's tables as docs/architecture.md lists them are the fields of paths.RunTables, in order."""
    from dataclasses import fields

    from servegrid.paths import RunTables

    sentence = ARCHITECTURE.split("`paths.RunTables`, one path per table: ", 1)[1].split(" (`test_docs`", 1)[0]
    assert re.findall(r"`(\w+)`", sentence) == [f.name for f in fields(RunTables)]


def test_architecture_gives_every_module_of_the_package_a_line():
    """Every module of workflow/servegrid/ (but the __init__ files) is named in docs/architecture.md's module list,
    under its folder's heading."""
    listing = ARCHITECTURE.split("### Every module, one line each", 1)[1].split("\n## ", 1)[0]
    named: dict[str, set[str]] = {}
    folder = ""
    for line in listing.splitlines():
        heading = re.match(r"\*\*(?:`(\w+)/`|The root)\*\*", line)
        if heading:
            folder = heading.group(1) or ""
        named.setdefault(folder, set()).update(re.findall(r"`(\w+)`", line))
    package = REPO / "workflow" / "servegrid"
    missing = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] not in named.get(parts[0] if len(parts) > 1 else "", set()):
            missing.append("/".join(parts))
    assert not missing, f"docs/architecture.md lists no line for {missing}"


def test_readme_is_a_newcomers_read():
    """The README stays at reading length, names no path outside the repository, and lists every workload mode."""
    from servegrid import modes

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "../" not in readme
    table = readme.split("| mode | what one cell does |", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == modes.names()
    for link in re.findall(r"\]\((docs/[\w.-]+)", readme):
        assert (REPO / link).exists(), link
