"""A run's measured cells as the verdict sees them: the per-request table, each cell's record, and the summary.

One place for what the aggregation and each round of sampling that serves the verdict (servegrid.analysis.top_ups)
both start from, so that a round decides on the very figures the verdict will report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from servegrid.analysis.requests_table import load_cells
from servegrid.analysis.summary_table import summarize
from servegrid.config import Experiment
from servegrid.records.cell_record import CellRecord
from servegrid.records.per_request import derive


@dataclass(frozen=True)
class MeasuredRun:
    derived_all: pd.DataFrame  # every measured request, every route, with its derived figures
    derived: pd.DataFrame  # the verdict's route's
    metas: list[CellRecord]  # the verdict's route's measured cells
    all_metas: list[CellRecord]  # every route's measured cells
    refused: list[CellRecord]  # cells whose engine died at their first request (no request measured)
    summary: pd.DataFrame  # one row per cell of the verdict's route


def measured_run(experiment: Experiment, cell_paths: Sequence[str], top_up_paths: Sequence[str] = ()) -> MeasuredRun:
    everything, read_metas = load_cells(list(cell_paths), top_up_paths)
    # A refused cell (its engine died at its first request) has no request: the servers table names its
    # reason; every other table is made of the measured cells, so the verdict proceeds with the others.
    refused = [m for m in read_metas if m.refused]
    all_metas = [m for m in read_metas if not m.refused]
    derived_all = derive(everything) if all_metas else everything  # cell files without a row still have every column
    # The verdict's route (direct, unless every cell goes through the gateway); the other route, where cells were
    # measured both ways, is only compared with it (servegrid.analysis.gateway_cost).
    verdict_route = experiment.routes()[0]
    routes = derived_all["route"] if "route" in derived_all else pd.Series("direct", index=derived_all.index)
    derived = derived_all[routes == verdict_route]
    metas = [m for m in all_metas if m.route == verdict_route]
    return MeasuredRun(derived_all, derived, metas, all_metas, refused, summarize(derived, metas, experiment))
