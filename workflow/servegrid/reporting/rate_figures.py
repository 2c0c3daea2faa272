"""The figure of the open-loop cells: latency and goodput against the offered rate (docs/open-loop.md).

:class:`RateFigures` is the part of :class:`servegrid.reporting.figures.Painter` that draws it, with the Painter's
colours, markers, number formats and legend; it reads the summary's open-loop rows (``open_summary``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.ticker import FixedLocator, FuncFormatter
from matplotlib.typing import ColorType

from servegrid import modes
from servegrid.analysis.requests_table import with_window
from servegrid.config import Experiment
from servegrid.modes.trace_file import Window


class RateFigures:
    """The open-loop figure; a mixin of :class:`servegrid.reporting.figures.Painter`, which sets these."""

    experiment: Experiment
    open_summary: pd.DataFrame
    labels: dict[str, str]
    colours: dict[str, ColorType]
    markers: dict[str, str]
    _: Callable[[str], str]

    if TYPE_CHECKING:  # the Painter's helpers this part draws with

        def number(self, value: float, digits: int | None = None) -> str: ...

        def _axes_numbers(self, ax: plt.Axes) -> None: ...

        def _context_title(self, mode: str, context: int) -> str: ...

        def _legend_and_layout(self, fig: plt.Figure, bottom: float) -> None: ...

    def _window_title(self, label: str) -> str:
        """A trace window's panel title: "seconds 600–900 of the trace", "from second 600 of the trace"."""
        window = Window.from_label(label)
        start = self.number(window.start_s, 0 if window.start_s.is_integer() else 1)
        if window.duration_s is None:
            return self._("from second %(start)s of the trace") % {"start": start}
        end = window.start_s + window.duration_s
        return self._("seconds %(start)s–%(end)s of the trace") % {
            "start": start,
            "end": self.number(end, 0 if end.is_integer() else 1),
        }

    def latency_by_rate(self) -> plt.Figure:
        """Per mode and context with open-loop cells, a column of two panels: TTFT p50 (solid) and p90 (dashed)
        against the offered rate, and the goodput (requests/s within the objectives; without objectives, those
        answered) against it, the offered rate itself dotted. Saturated cells are ringed, invalid ones crossed."""
        data = with_window(self.open_summary)
        window_order = [label for w in self.experiment.workloads.values() for label in w.windows]
        # A trace's windows are different traffic: a column each.
        groups = sorted(
            {(str(m), int(c), str(w)) for m, c, w in zip(data["mode"], data["context"], data["window"], strict=True)},
            key=lambda g: (
                self.experiment.modes().index(g[0]) if g[0] in self.experiment.modes() else 99,
                g[1],
                window_order.index(g[2]) if g[2] in window_order else 99,
            ),
        )
        sns.set_theme(style="whitegrid", context="paper", font_scale=1.15)
        columns = max(1, len(groups))
        fig, grid = plt.subplots(2, columns, figsize=(max(6.0, 3.9 * columns + 1.2), 7.2), squeeze=False)
        for column, (mode, context, window) in enumerate(groups):
            top, bottom = grid[0][column], grid[1][column]
            cells = data[(data["mode"] == mode) & (data["context"] == context) & (data["window"] == window)]
            rates = sorted(float(r) for r in cells["offered_rate"].unique())
            for name, label in self.labels.items():
                rows = cells[cells["configuration"] == name].sort_values("offered_rate")
                if rows.empty:
                    continue
                x = rows["offered_rate"].to_numpy(dtype=float)
                style = {"color": self.colours[name], "marker": self.markers[name], "linewidth": 2}
                top.plot(x, rows["ttft_s_p50"].to_numpy(dtype=float) * 1e3, label=label, **style)
                top.plot(
                    x,
                    rows["ttft_s_p90"].to_numpy(dtype=float) * 1e3,
                    linestyle="--",
                    alpha=0.7,
                    **{**style, "linewidth": 1.5},
                )
                goodput = rows["goodput_rps"].where(rows["goodput_rps"].notna(), rows["achieved_rate"])
                bottom.plot(x, goodput.to_numpy(dtype=float), label=label, **style)
                for ax, y in (
                    (top, rows["ttft_s_p50"].to_numpy(dtype=float) * 1e3),
                    (bottom, goodput.to_numpy(dtype=float)),
                ):
                    saturated = rows["saturated"].fillna(False).astype(bool).to_numpy()
                    invalid = ~rows["valid"].astype(bool).to_numpy()
                    ax.scatter(
                        x[saturated],
                        y[saturated],
                        s=220,
                        facecolors="none",
                        edgecolors="black",
                        linewidths=1.5,
                        zorder=6,
                        label=self._("saturated"),
                    )
                    ax.scatter(x[invalid], y[invalid], marker="x", s=90, color="black", zorder=6)
            bottom.plot(rates, rates, linestyle=":", color="grey", label=self._("offered rate"))
            for ax in (top, bottom):
                ax.set_xscale("log")
                ax.xaxis.set_major_locator(FixedLocator(rates or [1]))
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: self.number(v)))
                ax.xaxis.set_minor_locator(FixedLocator([]))
                ax.set_ylim(bottom=0)
                self._axes_numbers(ax)
            windowed = any(w and m == mode for m, _c, w in groups)  # beside a window's column, say "whole trace"
            where = (
                self._window_title(window)
                if window
                else self._("the whole trace")
                if windowed
                else self._context_title(mode, context)
            )
            top.set_title(f"{self._(modes.get(mode).short_title)}\n{where}", fontsize=9)
            top.set_ylabel(self._("TTFT, ms (p50 solid, p90 dashed)"))
            bottom.set_ylabel(self._("requests/s within the objectives"))
            bottom.set_xlabel(self._("offered rate, requests/s"))
        self._legend_and_layout(fig, 0.07)
        return fig
