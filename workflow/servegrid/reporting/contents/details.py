"""The report's details: every cell, or in a large grid's PDF those that need a look."""

from __future__ import annotations

from typing import Any

from servegrid.reporting.contents.shared import Contents
from servegrid.stats import intervals

# Up to this many cells the PDF's details list every cell, as the HTML's always do. A larger grid's would run
# to hundreds of pages (287 at 2,028 cells, most of the PDF's time: docs/scale.md) that nobody reads on paper:
# the PDF then lists the cells that need a look, and says where the rest are.
PRINT_EVERY_CELL_UP_TO = 400


class DetailsContents(Contents):
    def details_abridged(self, medium: str) -> bool:
        return medium == "print" and len(self.summary) > PRINT_EVERY_CELL_UP_TO

    @staticmethod
    def needs_a_look(cell: dict[str, Any]) -> bool:
        """Invalid, imprecise (a ceiling reached first), at the KV limit, or too few samples for a median."""
        precise = cell.get("precise")  # None (or NaN from Parquet): a fixed count, no target to reach
        return (
            not bool(cell.get("valid"))
            or (not intervals.missing(precise) and not bool(precise))
            or bool(cell.get("kv_limited"))
            or intervals.missing(cell.get("primary_p50"))
        )

    def detail_cells(self, medium: str) -> list[dict[str, Any]]:
        cells = self.cells()
        return [c for c in cells if self.needs_a_look(c)] if self.details_abridged(medium) else cells

    def detail_rows(self, rows: list[dict[str, Any]], medium: str) -> list[dict[str, Any]]:
        """A mode's rows (:meth:`mode_rows`) as the details show them."""
        if not self.details_abridged(medium):
            return rows
        kept = ({**row, "cells": {k: c for k, c in row["cells"].items() if self.needs_a_look(c)}} for row in rows)
        return [row for row in kept if row["cells"]]

    def invalid_cells(self) -> list[dict[str, Any]]:
        if self.summary.empty:
            return []
        invalid: list[dict[str, Any]] = self.summary[~self.summary["valid"].astype(bool)].to_dict("records")
        return invalid
