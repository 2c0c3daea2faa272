"""The report's section "open loop": each open-loop cell (a configuration at an offered rate) with the rate it
achieved, its latency, and how its run went (saturated, ramp and drain, correlated samples).

Built from the summary's open-loop rows (servegrid.analysis.load_columns) and the verdict in rates (rates.parquet,
servegrid.analysis.rate_verdict); shown when the run has any. A replayed trace's cells are among them, named by
their speedup and window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from servegrid import modes
from servegrid.config import Experiment
from servegrid.modes.trace_file import Window
from servegrid.stats import intervals


@dataclass
class OpenLoopView:
    """What the template's open-loop section shows."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    # The verdict in rates (rates.parquet), per mode and context: each configuration's sustainable rate.
    rates: list[dict[str, Any]] = field(default_factory=list)

    @property
    def any_saturated(self) -> bool:
        return any(r["saturated"] for r in self.rows)

    @property
    def any_trace(self) -> bool:
        return any(r["speedup"] is not None for r in self.rows)

    @property
    def any_window(self) -> bool:
        return any(r["window"] is not None for r in self.rows)

    @property
    def any_correlated(self) -> bool:
        return any(r["correlated"] for r in self.rows)


def _value(row: dict[str, Any], name: str) -> float | None:
    value = row.get(name)
    return None if value is None or intervals.missing(value) else float(value)


def _window(row: dict[str, Any]) -> dict[str, float | None] | None:
    """A trace cell's window as the template shows it ({start, end} in seconds into the trace; end None: to its end),
    None for the whole trace and for every other cell."""
    label = row.get("window")
    if intervals.missing(label) or not label:
        return None
    window = Window.from_label(str(label))
    end = None if window.duration_s is None else window.start_s + window.duration_s
    return {"start": window.start_s, "end": end}


def open_loop_view(
    experiment: Experiment, summary: pd.DataFrame, rates: pd.DataFrame | None = None
) -> OpenLoopView | None:
    """The section's data, or None when no cell of the run was open loop."""
    if "open_loop" not in summary or not summary["open_loop"].fillna(False).astype(bool).any():
        return None
    cells = summary[summary["open_loop"].fillna(False).astype(bool)].to_dict("records")
    order = {name: i for i, name in enumerate(experiment.configurations)}
    mode_order = {name: i for i, name in enumerate(experiment.modes())}
    window_order = {label: i for w in experiment.workloads.values() for i, label in enumerate(w.windows)}
    cells.sort(
        key=lambda r: (
            mode_order.get(r["mode"], 99),
            r["context"],
            window_order.get(r.get("window") or "", 99),
            r["offered_rate"],
            order.get(r["configuration"], 99),
        )
    )
    view = OpenLoopView()
    for cell in cells:
        view.rows.append(
            {
                "configuration": cell["configuration"],
                "mode_title": modes.get(cell["mode"]).short_title,
                "context": int(cell["context"]),
                "offered": float(cell["offered_rate"]),
                "achieved": _value(cell, "achieved_rate"),
                "ttft_p50": _value(cell, "ttft_s_p50"),
                "ttft_p90": _value(cell, "ttft_s_p90"),
                "e2e_p50": _value(cell, "e2e_s_p50"),
                "ramp_s": _value(cell, "ramp_s"),
                "drain_s": _value(cell, "drain_s"),
                "saturated": bool(cell.get("saturated")),
                "not_sent": int(cell.get("not_sent") or 0),
                "correlated": bool(cell.get("primary_correlated")),
                "valid": bool(cell.get("valid")),
                "speedup": _value(cell, "speedup"),  # a replayed trace's, shown instead of its context
                "window": _window(cell),
            }
        )
    for rate in rates.to_dict("records") if rates is not None and len(rates) else []:
        view.rates.append(
            {
                "configuration": rate["configuration"],
                "mode_title": modes.get(rate["mode"]).short_title,
                "context": int(rate["context"]),
                "sustainable": _value(rate, "sustainable_rate"),
                "below": _value(rate, "capacity_below"),
                "stopped_by": None if intervals.missing(rate.get("stopped_by")) else rate["stopped_by"],
                "ratio": _value(rate, "ratio_to_baseline"),
                "ratio_low": _value(rate, "ratio_ci_low"),
                "ratio_high": _value(rate, "ratio_ci_high"),
                "winner": bool(rate.get("winner")),
                "speedup": _value(rate, "sustainable_speedup"),
                "speedup_below": _value(rate, "speedup_below"),
                "window": _window(rate),
            }
        )
    return view
