"""One cell's requests as numpy columns, for the summary (servegrid.analysis.aggregation)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from servegrid.modes.primary import Primary


class CellRows:
    """One cell's requests as numpy columns (positions into the derived table), with its masks.

    The summary computes its columns on these arrays: a pandas filter per figure and per cell cost about
    10 ms a cell, most of the aggregation of a 2,000-cell grid (docs/scale.md). DataFrames are made only for
    what takes one (the modes' hooks and the objectives), from the same rows."""

    def __init__(self, columns: dict[str, np.ndarray], positions: np.ndarray, primary: Primary) -> None:
        self.columns = columns
        self.positions = positions
        self._cache: dict[str, np.ndarray] = {}
        self.measured = self["phase"] == "measured"
        self.priming = np.isin(self["phase"], ("warmup", "probe"))  # what readies the server before measuring
        self.ok = self["error_missing"]  # no error (the error column is empty)
        self.valid = self.measured & self["valid"]
        self.primary = primary.mask(self)

    def __getitem__(self, column: str) -> np.ndarray:
        if column not in self._cache:
            self._cache[column] = self.columns[column][self.positions]
        return self._cache[column]

    def floats(self, column: str, mask: np.ndarray) -> np.ndarray:
        values: np.ndarray = self[column][mask].astype(float)
        return values

    def frame(self, mask: np.ndarray, columns: list[str]) -> pd.DataFrame:
        return pd.DataFrame({c: self[c][mask] for c in columns})


HOOK_COLUMNS = [
    "repeat",  # each repeat (a top-up's too) ran from a reset cache: the modes' expected hits count it on its own
    "session",
    "seq",
    "turn",
    "phase",
    "valid",
    "error",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "prompt_tokens_reported",
    "prompt_tokens_requested",
    "output_tokens_requested",
]
