"""The report's method section: how each mode's cells were sampled and ended, and when the run measured."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pandas as pd

from servegrid import modes
from servegrid.reporting.contents.shared import Contents


class MethodContents(Contents):
    def sampling_rows(self) -> list[dict[str, Any]]:
        """Per mode measured: how its cells were sampled (its rule, or its fixed count) and how they ended."""
        rows = []
        for mode in self.experiment.modes():
            cells = self.summary[self.summary["mode"] == mode] if len(self.summary) else self.summary
            if cells.empty:
                continue
            reasons = cells["sampling_reason"].value_counts() if "sampling_reason" in cells else pd.Series()
            samples = cells["primary_n"].astype(int)
            rows.append(
                {
                    "mode": modes.get(mode),
                    "rule": self.experiment.sampling_rules.get(mode),
                    "per_session": self.experiment.workload(mode).settings.get("requests_per_session"),
                    "cells": len(cells),
                    **{reason: int(reasons.get(reason, 0)) for reason in ("precise", "max_samples", "max_duration")},
                    "n_min": int(samples.min()),
                    "n_max": int(samples.max()),
                }
            )
        return rows

    def cells_measured(self) -> int:
        """Every cell of the run, closed and open loop (``summary`` holds the closed-loop ones only)."""
        return len(self.every_cell)

    def run_dates(self) -> tuple[datetime | None, datetime | None]:
        """When the run's first and last cells started, open-loop cells included."""
        if self.every_cell.empty:
            return None, None
        starts = pd.to_datetime(self.every_cell["started_at"], utc=True, format="ISO8601")
        return starts.min().to_pydatetime(), starts.max().to_pydatetime()
