"""A cell and its top-ups as one cell: their requests pooled, their facts added up (sampling that serves the verdict).

A top-up (servegrid.analysis.top_ups) is the cell's measured phase run again, in a file of the cell format of its own:
a cell's file is never rewritten, so a top-up never remeasures the cell's earlier repeats. Its requests carry repeat
numbers after the cell's (Experiment.top_up_settings), so pooled they stay told apart, as the repeats of one cell
always were. What the record says of the measured phase is recomputed over every repeat (the server's counters,
what they derive, the measuring time) or combined conservatively (the worst client lag, the weakest cache state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa

from servegrid.engines import metrics
from servegrid.errors import CellFileError
from servegrid.records.cell_record import CellRecord

Measured = tuple[pa.Table, CellRecord]

# How two summaries' numbers combine: counts add up, extremes keep the extreme, means are weighted by samples.
_ADDED = ("samples", "scrape_errors", "loop_lag_samples", "requests_in_window", "energy_j")


def pool(cell: Measured, top_ups: Sequence[tuple[str, Measured]]) -> Measured:
    """``cell`` with its ``top_ups`` ((path, measured) in round order) pooled into it."""
    if not top_ups:
        return cell
    table, record = cell
    tables = [table]
    for path, (top_table, top) in top_ups:
        if not belongs(top, record):
            raise CellFileError(f"{path}: a top-up of {top.spec.id} measured with other settings than its cell")
        tables.append(top_table.select(table.schema.names).cast(table.schema))
        record = _pooled_record(record, top)
    return pa.concat_tables(tables), record


def belongs(top_up: CellRecord, cell: CellRecord) -> bool:
    """Whether ``top_up`` measured ``cell`` as it is: the same cell, with the same settings but for its round."""
    own = {k: v for k, v in top_up.settings.items() if k != "top_up"}
    return top_up.spec == cell.spec and own == cell.settings


def _pooled_record(record: CellRecord, top: CellRecord) -> CellRecord:
    phase = _pooled_phase(_phase(record), _phase(top))
    routes = {
        route: _pooled_phase(measured, top.other_routes[route]) if route in top.other_routes else measured
        for route, measured in record.other_routes.items()
    }
    earlier = (record.sampling or {}).get("top_up_rounds", [])
    sampling = dict(record.sampling or {}) | {"top_up_rounds": [*earlier, top.cell_settings.top_up_round]}
    summary = {
        "round": top.cell_settings.top_up_round,
        "wall_s": top.wall_s,
        "server": top.server,
        "started_at": top.started_at,
        "ended_at": top.ended_at,
    }
    # The record keeps its own job's start and end: its wall time is that job's plus its top-ups' (CellRecord.wall_s),
    # not the span to the last top-up's end, which holds every other job run in between.
    return replace(record, **phase, sampling=sampling, other_routes=routes, top_ups=(*record.top_ups, summary))


def _phase(record: CellRecord) -> dict[str, Any]:
    return {
        "duration_s": record.duration_s,
        "server_metrics": record.server_metrics,
        "client": record.client,
        "cache_state": record.cache_state,
        "repeats": record.repeats,
        "gpus": record.gpus,
    }


def _pooled_phase(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    repeats = [*(a.get("repeats") or []), *(b.get("repeats") or [])]
    out = dict(a)
    out["repeats"] = repeats
    out["duration_s"] = (a.get("duration_s") or 0.0) + (b.get("duration_s") or 0.0)
    if a.get("server_metrics") is not None and b.get("server_metrics") is not None:
        # Each phase's counters are the sum of its repeats' (a cell file from before repeats has no repeat list).
        delta = metrics.sum_deltas([a["server_metrics"].get("delta") or {}, b["server_metrics"].get("delta") or {}])
        out["server_metrics"] = {
            "delta": delta,
            "derived": metrics.derived(delta),
            "gauges": combined(a["server_metrics"].get("gauges"), b["server_metrics"].get("gauges")),
        }
    out["client"] = combined(a.get("client"), b.get("client"))
    out["cache_state"] = "reset" if a.get("cache_state") == b.get("cache_state") == "reset" else "fresh content"
    out["gpus"] = combined(a.get("gpus"), b.get("gpus"))
    return out


def combined(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Two summaries of the same shape (gauges, the client's watch, the GPU watch) as one over both phases."""
    if a is None or b is None:
        either = a if a is not None else b
        return dict(either) if either is not None else None
    out = dict(a)
    weights = (_samples(a), _samples(b))
    for key, theirs in b.items():
        mine = a.get(key)
        if mine is None or theirs is None:
            out[key] = mine if theirs is None else theirs
        elif isinstance(mine, bool) or isinstance(theirs, bool):
            out[key] = bool(mine and theirs)  # "measured": only if both phases were
        elif key in _ADDED:
            out[key] = mine + theirs
        elif isinstance(mine, list) and isinstance(theirs, list):
            out[key] = sorted({*mine, *theirs}) if all(isinstance(v, int | str) for v in [*mine, *theirs]) else mine
        elif isinstance(mine, int | float) and isinstance(theirs, int | float):
            if key.endswith("_min"):
                out[key] = min(mine, theirs)
            elif key.endswith(("_mean", "_fraction", "cpu_fraction")):
                out[key] = (mine * weights[0] + theirs * weights[1]) / sum(weights)
            else:  # maxima, upper percentiles: the worse of the two
                out[key] = max(mine, theirs)
    return out


def _samples(summary: Mapping[str, Any]) -> float:
    """What a summary's means are over: the gauges' or GPU watch's samples, or the client's lag samples."""
    return float(summary.get("samples") or summary.get("loop_lag_samples") or 1)
