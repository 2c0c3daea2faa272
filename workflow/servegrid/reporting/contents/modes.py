"""The report's sections per workload mode, the figures across the whole grid, and the gateway section's figure."""

from __future__ import annotations

from typing import Any

from servegrid import modes
from servegrid.modes.base import FigureSpec
from servegrid.reporting.contents.shared import Contents
from servegrid.reporting.figure_files import (
    GATEWAY_FIGURE,
    GOODPUT_FIGURE,
    PANEL_KINDS,
    RATE_FIGURE,
    mode_figures,
    run_figures,
    shown_contexts,
)


class ModeContents(Contents):
    def mode_sections(self) -> list[dict[str, Any]]:
        """One report section per enabled mode: the mode, its description's values (formatted) and its rows."""
        sections = []
        for name in self.experiment.modes():
            mode, workload = modes.get(name), self.experiment.workload_view(name)
            params = {key: self.format_value(value) for key, value in mode.describe(workload).items()}
            sections.append(
                {
                    "mode": mode,
                    "params": params,
                    "rows": self.mode_rows(name),
                    "concurrency": workload["concurrency"],
                    "figures": mode_figures(self.experiment, name),
                }
            )
        return sections

    def grid_figures(self) -> tuple[FigureSpec, ...]:
        """The run's figures shown across the grid: every run figure but goodput (the production section's)."""
        shown_elsewhere = (GOODPUT_FIGURE, GATEWAY_FIGURE, RATE_FIGURE)  # production, gateway, open-loop sections
        return tuple(spec for spec in run_figures(self.experiment) if spec not in shown_elsewhere)

    def panels_shown(self, mode: str, spec: FigureSpec) -> dict[str, str] | None:
        """For a figure of one panel per context that shows only some of them (figure_list.shown_contexts):
        which ones, and of how many (formatted), said after its caption; None when it shows every one."""
        measured = self.summary.loc[self.summary["mode"] == mode, "context"].unique()
        shown = shown_contexts(measured)
        if spec.kind not in PANEL_KINDS or len(shown) == len(measured):
            return None
        return {
            "shown": ", ".join(self.formatter.integer(c) for c in shown),
            "total": self.formatter.integer(len(measured)),
        }

    def gateway_figure(self) -> FigureSpec:
        """The figure of the section "through the gateway" (report/templates/gateway.html.j2)."""
        return GATEWAY_FIGURE

    def rate_figure(self) -> FigureSpec:
        """The figure of the section "open loop" (report/templates/open_loop.html.j2)."""
        return RATE_FIGURE
