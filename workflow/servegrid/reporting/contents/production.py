"""The report's production section: per workload with objectives, each configuration's highest sustained
concurrency within them, who leads most often, and the goodput figure."""

from __future__ import annotations

from typing import Any

import pandas as pd

from servegrid import modes
from servegrid.analysis import cost
from servegrid.modes.base import FigureSpec
from servegrid.reporting.contents.shared import Contents
from servegrid.reporting.figure_files import GOODPUT_FIGURE, MAX_CONTEXT_PANELS, run_figures


class ProductionContents(Contents):
    def production_sections(self) -> list[dict[str, Any]]:
        """Per mode with service-level objectives: the objectives as the reader reads them, and per context
        each configuration's highest sustained concurrency (the production table) with the winner's label."""
        sections = []
        table = self.production
        for name in self.experiment.modes():
            goals = self.experiment.slo.get(name)
            if not goals:
                continue
            mine = table[table["mode"] == name] if len(table) else table
            rows = []
            for context in sorted(mine["context"].unique()) if len(mine) else []:
                at = self.records(mine[mine["context"] == context])
                winners = [r["configuration"] for r in at if r["winner"]]
                rows.append(
                    {
                        "context": int(context),
                        "cells": {r["configuration"]: r for r in at},
                        "winners": winners,
                        # Goodputs within verdict.min_factor of each other: a tie, every one named.
                        "winner_label": " ≈ ".join(self.label(w) for w in winners) if winners else None,
                    }
                )
            sections.append(
                {
                    "mode": modes.get(name),
                    "objectives": self.objectives_text(goals),
                    "rows": rows,
                    "attainment": self.mode_rows(name),  # per cell: the share of requests within the objectives
                }
            )
        return sections

    def production_marks(self) -> dict[str, bool]:
        """Which footnotes the production tables need: a level met again after a failure, an invalid cell."""
        table = self.production
        if table.empty:
            return {"non_monotone": False, "invalid": False, "too_few": False}
        return {
            "non_monotone": bool(table["non_monotone"].astype(bool).any()),
            "invalid": bool((table["stopped_by"] == "invalid").any()),
            "too_few": bool((table["stopped_by"] == "too_few").any()),
        }

    def production_by_cost(self) -> bool:
        """Whether the production winners are the cheapest per million tokens (``cost.rank_by: cost``)."""
        return self.experiment.cost is not None and self.experiment.cost.rank_by == "cost"

    def production_prices(self) -> dict[str, Any] | None:
        """The ``cost:`` section where the production table was priced (servegrid.analysis.cost); None otherwise."""
        cost = self.experiment.cost
        table = self.production
        if (
            cost is None
            or table.empty
            or "cost_per_million_tokens" not in table
            or table["cost_per_million_tokens"].isna().all()
        ):
            return None
        return {
            "device_per_hour": cost.device_per_hour,
            "energy_per_kwh": cost.energy_per_kwh,
            "currency": cost.currency,
        }

    def spending(self) -> dict[str, Any] | None:
        """What the run's cells took (servegrid.analysis.cost.spent): per configuration, device hours per mode and
        in all, and their price with a ``cost:`` section; None before any cell."""
        table = cost.spent(self.summary, self.experiment)
        if table.empty:
            return None
        modes_seen = [m for m in self.experiment.modes() if (table["mode"] == m).any()]
        rows = []
        for name in self.experiment.configurations:
            mine = table[table["configuration"] == name]
            if mine.empty:
                continue
            rows.append(
                {
                    "label": self.label(name),
                    "hours": {m: float(mine[mine["mode"] == m]["device_hours"].sum()) for m in modes_seen},
                    "total": float(mine["device_hours"].sum()),
                    "cost": float(mine["cost"].sum()) if self.experiment.cost else None,
                }
            )
        return {
            "modes": [modes.get(m) for m in modes_seen],
            "rows": rows,
            "total": float(table["device_hours"].sum()),
            "top_ups": int(table["top_ups"].sum()),
            "cost": float(table["cost"].sum()) if self.experiment.cost else None,
            "currency": self.experiment.cost.currency if self.experiment.cost else None,
        }

    def production_leaders(self) -> list[dict[str, Any]]:
        """Who wins the production table most often: per configuration, the mode × context rows it wins
        (ties count for each), most first; with how many rows there are."""
        table = self.production
        if table.empty:
            return []
        rows = table.groupby(["mode", "context"]).ngroups
        wins = table[table["winner"].astype(bool)].groupby("configuration").size()
        order = list(self.experiment.configurations)
        ranked = sorted(wins.items(), key=lambda item: (-item[1], order.index(item[0])))
        return [{"label": self.label(name), "wins": int(count), "rows": rows} for name, count in ranked]

    def objectives_text(self, goals: Any) -> str:
        """``TPOT p90 ≤ 50 ms; TTFT p99 ≤ 2 s`` in the locale's number format."""
        parts = []
        for goal in goals:
            in_ms = goal.key.endswith("_ms")
            limit = goal.limit_s * 1000 if in_ms else goal.limit_s
            number = self.format_value(round(limit, 6))
            parts.append(
                f"{goal.metric.upper() if goal.metric != 'e2e' else 'e2e'} p{goal.percentile} ≤ {number} "
                f"{'ms' if in_ms else 's'}"
            )
        return "; ".join(parts)

    def goodput_figure(self) -> FigureSpec | None:
        return GOODPUT_FIGURE if GOODPUT_FIGURE in run_figures(self.experiment) else None

    def goodput_panels_left_out(self) -> bool:
        """Whether the goodput figure (a panel per workload with objectives and context) leaves contexts out."""
        contexts = self.summary.groupby("mode")["context"].nunique() if len(self.summary) else pd.Series()
        return any(contexts.get(mode, 0) > MAX_CONTEXT_PANELS for mode in self.experiment.slo)

    @staticmethod
    def max_context_panels() -> int:
        return MAX_CONTEXT_PANELS
