"""The figure a workload mode is judged by: :class:`Primary`, and which requests its samples come from.

A module of its own, at the bottom of ``modes/``: the measured phase's stages count its samples, the
declarations name it, and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import pandas as pd


class Columns(Protocol):
    """Columns by name: a DataFrame, a mapping of numpy arrays, or one cell's rows
    (servegrid.analysis.cell_rows.CellRows)."""

    def __getitem__(self, column: str, /) -> Any: ...


@dataclass(frozen=True)
class Primary:
    """The figure a mode is judged by."""

    column: str  # a per-request column of the requests table
    higher_is_better: bool
    unit: str  # "seconds" or "rate": how the report writes the value
    axis_label: str  # N_: the figures' y axis
    header: str  # N_: the report table's column header
    verdict_word: str  # N_ (or a symbol): what a factor measures, "1,3–1,9× decode"
    turn: int | None = None  # only this conversation turn's requests

    @property
    def metric(self) -> str:
        return self.column if self.turn is None else f"{self.column}@turn{self.turn}"

    def mask(self, requests: Columns) -> Any:
        """Which requests this figure's samples come from: measured, valid, of its turn (columns of
        servegrid.records.per_request.derive's table, as a DataFrame or as numpy arrays). The summary, the verdict and
        sequential sampling all count these, and only these."""
        selected = (requests["phase"] == "measured") & requests["valid"]
        return selected if self.turn is None else selected & (requests["turn"] == self.turn)

    def rows(self, requests: pd.DataFrame) -> pd.DataFrame:
        """The rows of :meth:`mask`."""
        return requests[self.mask(requests)]
