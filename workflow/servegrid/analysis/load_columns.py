"""A cell's load in the summary: its name's last part, and for an open-loop cell what its runs did
(servegrid.load.open_loop: the rate it achieved, whether it saturated, its ramp and drain)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servegrid.records.cell_spec import CellSpec, Sessions


def load_columns(
    cell: CellSpec,
    runs: list[dict[str, Any]] | None,
    n_valid: int,
    window_s: float | None,
    arrival: Mapping[str, Any] | None,
    requests_per_arrival: float = 1.0,
    n_measured: int = 0,
) -> dict[str, Any]:
    """The cell's load, and for an open-loop cell what its runs did (servegrid.load.open_loop), every repeat
    together: the rate it achieved, whether it saturated, how long its ramp and drain were."""
    rate = 0.0 if isinstance(cell.load, Sessions) else cell.load.per_s
    open_loop = cell.open_loop and runs is not None
    columns: dict[str, Any] = {
        "load": cell.load.label,  # the last part of the cell's name: c4, r0.5, x2, x2_w600+300
        "open_loop": open_loop,
        # Requests/s, as the achieved rate and goodput are: a multi_turn arrival (a conversation) brings each turn.
        "offered_rate": rate * requests_per_arrival if open_loop else None,
        "arrival_pattern": (arrival or {}).get("pattern") if open_loop else None,
        "burstiness": (arrival or {}).get("burstiness") if open_loop else None,
    }
    names = (
        "achieved_rate",
        "scheduled_rate",
        "saturated",
        "not_sent",
        "peak_in_flight",
        "ramp_s",
        "drain_s",
        "ramp_requests",
        "drain_requests",
    )
    if not open_loop or not runs:
        return columns | dict.fromkeys(names)
    return columns | {
        # Measured requests answered in full, per second of the measured arrivals' span.
        "achieved_rate": n_valid / window_s if window_s else None,
        # What the seeded schedule itself offered in that window (sent or not): 30 Poisson arrivals span ±18%
        # around their nominal rate, so goodput is judged against this, the same for every configuration.
        "scheduled_rate": (n_measured + requests_per_arrival * sum(r["not_sent"] for r in runs)) / window_s
        if window_s
        else None,
        "saturated": any(r["saturated"] for r in runs),
        "not_sent": sum(r["not_sent"] for r in runs),
        "peak_in_flight": max(r["peak_in_flight"] for r in runs),
        "ramp_s": max(r["ramp_s"] for r in runs),
        "drain_s": max(r["drain_s"] for r in runs),
        "ramp_requests": sum(r["ramp_requests"] for r in runs),
        "drain_requests": sum(r["drain_requests"] for r in runs),
    }
