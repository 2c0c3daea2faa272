"""The figures of the whole run: each configuration against the baseline, the latency distributions at
each mode's heaviest load, goodput within the objectives, and what the gateway adds (route: both).

:class:`RunFigures` is the part of :class:`servegrid.reporting.figures.Painter` that draws them; it uses the
Painter's colours, markers, number formats and legend (declared below, set by the Painter).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.colors import Normalize
from matplotlib.ticker import FuncFormatter
from matplotlib.typing import ColorType
from seaborn.utils import relative_luminance

from servegrid import modes
from servegrid.config import Experiment
from servegrid.records.per_request import per_token_itl
from servegrid.reporting.figure_files import shown_contexts

DASHES = ("-", "--", "-.", ":")  # for lines without markers (distributions)


class RunFigures:
    """The run's figures; a mixin of :class:`servegrid.reporting.figures.Painter`, which sets these."""

    experiment: Experiment
    summary: pd.DataFrame
    requests: pd.DataFrame
    gateway: pd.DataFrame
    labels: dict[str, str]
    colours: dict[str, ColorType]
    markers: dict[str, str]
    _: Callable[[str], str]

    if TYPE_CHECKING:  # the Painter's helpers this part draws with

        def number(self, value: float, digits: int | None = None) -> str: ...

        def _axes_numbers(self, ax: plt.Axes) -> None: ...

        def _concurrency_axis(self, ax: plt.Axes, values: list[int]) -> None: ...

        def _context_title(self, mode: str, context: int) -> str: ...

        def _legend_and_layout(self, fig: plt.Figure, bottom: float) -> None: ...

        @staticmethod
        def _wrapped(n: int) -> tuple[plt.Figure, list[plt.Axes], int]: ...

        def _panels(self, n: int, height: float = 3.6) -> tuple[plt.Figure, list[plt.Axes]]: ...

    def latency_cdfs(self) -> plt.Figure:
        """Per mode, its heaviest cell group (largest context, then most sessions): the distribution of every
        configuration's TTFT (the mode's primary turn) and of its per-token inter-token latency."""
        sns.set_theme(style="whitegrid", context="paper", font_scale=1.15)
        fig, grid = plt.subplots(
            2,
            max(1, len(self.experiment.modes())),
            squeeze=False,
            figsize=(3.9 * max(1, len(self.experiment.modes())) + 1.2, 7.0),
        )
        requests = self.requests
        for column, mode in enumerate(self.experiment.modes()):
            ttft_ax, itl_ax = grid[0][column], grid[1][column]
            cells = self.summary[self.summary["mode"] == mode]
            if cells.empty or requests.empty:
                for ax in (ttft_ax, itl_ax):
                    ax.axis("off")
                continue
            valid_cells = cells[cells["valid"].astype(bool)]
            cells = valid_cells if len(valid_cells) else cells  # the heaviest load measured validly, if any
            context = int(cells["context"].max())
            concurrency = int(cells.loc[cells["context"] == context, "concurrency"].max())
            rows = requests[
                (requests["mode"] == mode)
                & (requests["context"] == context)
                & (requests["concurrency"] == concurrency)
                & (requests["phase"] == "measured")
                & requests["valid"].astype(bool)
            ]
            turn = modes.get(mode).primary.turn
            for name, label in self.labels.items():
                mine = rows[rows["configuration"] == name]
                if mine.empty:
                    continue
                dash = DASHES[list(self.labels).index(name) % len(DASHES)]
                style = {"color": self.colours[name], "label": label, "linewidth": 2, "linestyle": dash}
                ttft = mine if turn is None else mine[mine["turn"] == turn]
                sns.ecdfplot(x=ttft["ttft_s"].to_numpy(dtype=float), ax=ttft_ax, **style)
                itl = np.concatenate(
                    [per_token_itl(t, k) for t, k in zip(mine["chunk_times_s"], mine["chunk_tokens"], strict=True)]
                    or [np.empty(0)]
                )
                if itl.size:
                    sns.ecdfplot(x=itl * 1000, ax=itl_ax, **style)
            sessions = self._("%(sessions)s concurrent sessions") % {"sessions": self.number(concurrency, 0)}
            ttft_ax.set_title(
                f"{self._(modes.get(mode).short_title)}\n{self._context_title(mode, context)}, {sessions}", fontsize=9
            )
            ttft_ax.set_xlabel(self._("TTFT (s)"))
            itl_ax.set_xlabel(self._("inter-token latency per token (ms)"))
            for ax in (ttft_ax, itl_ax):
                ax.set_ylabel(self._("share of requests") if ax is ttft_ax else self._("share of tokens"))
                ax.set_xlim(left=0)
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: self.number(v)))
                self._axes_numbers(ax)
        self._legend_and_layout(fig, 0.06)
        return fig

    def goodput_by_concurrency(self) -> plt.Figure:
        """Goodput (requests/s within the objectives) vs concurrency, one panel per mode with objectives and
        context, one line per configuration."""
        panels = [
            (mode, int(context))
            for mode in self.experiment.modes()
            if mode in self.experiment.slo
            for context in shown_contexts(self.summary.loc[self.summary["mode"] == mode, "context"].unique())
        ]
        fig, axes, rows_n = self._wrapped(len(panels))
        for ax, (mode, context) in zip(axes, panels, strict=False):
            cells = self.summary[(self.summary["mode"] == mode) & (self.summary["context"] == context)]
            for name, label in self.labels.items():
                rows = cells[cells["configuration"] == name].sort_values("concurrency")
                if len(rows):
                    ax.plot(
                        rows["concurrency"],
                        rows["goodput_rps"].astype(float),
                        marker=self.markers[name],
                        color=self.colours[name],
                        label=label,
                        linewidth=2,
                    )
                    invalid = rows[~rows["valid"].astype(bool)]  # marked × as in every other figure
                    ax.scatter(
                        invalid["concurrency"],
                        invalid["goodput_rps"].astype(float),
                        marker="x",
                        s=90,
                        color="black",
                        zorder=5,
                    )
            self._concurrency_axis(ax, sorted(int(c) for c in cells["concurrency"].unique()))
            ax.set_ylabel(self._("requests/s within the objectives"))
            ax.set_ylim(bottom=0)
            self._axes_numbers(ax)
            ax.set_title(f"{self._(modes.get(mode).short_title)}\n{self._context_title(mode, context)}", fontsize=9)
        for ax in axes[len(panels) :]:
            ax.axis("off")
        self._legend_and_layout(fig, 0.1 / rows_n)
        return fig

    def ratio_heatmap(self) -> plt.Figure:
        """Each configuration against the baseline: how many times better (or worse) its primary p50 is,
        one row of panels per configuration, one panel per mode, context × concurrency in each."""
        baseline = self.experiment.baseline()
        others = [n for n in self.labels if n != baseline]
        compared = list(self.experiment.modes())
        sns.set_theme(style="whitegrid", context="paper", font_scale=1.15)
        if not others:
            fig, (ax,) = self._panels(1, height=1.6)
            ax.axis("off")
            ax.text(0.5, 0.5, self._("One configuration: nothing to compare."), ha="center", va="center")
            return fig
        row_height = min(3.0, 13.0 / len(others))  # many configurations: flatter rows, so the page holds them
        fig, grid = plt.subplots(
            len(others),
            len(compared),
            figsize=(3.9 * len(compared) + 1.2, row_height * len(others) + 0.8),
            squeeze=False,
        )
        valid = self.summary[self.summary["valid"].astype(bool)] if len(self.summary) else self.summary
        for row, name in enumerate(others):
            for column, mode in enumerate(compared):
                ax = grid[row][column]
                ratios = self._ratios(valid, mode, name, baseline)
                if row == 0:
                    ax.set_title(self._(modes.get(mode).short_title), fontsize=10)
                # The configuration names its row, on the left: panel titles would run into each other.
                ylabel = self._("context (tokens)")
                ylabel = f"{textwrap.fill(self.labels[name], 28)}\n\n{ylabel}" if column == 0 else ylabel
                if ratios.empty:
                    ax.set_xticks([])
                    ax.set_yticks([])
                    ax.grid(False)
                    ax.set_ylabel(ylabel)
                    ax.text(0.5, 0.5, self._("no valid cells to compare"), ha="center", va="center", color="#666666")
                    continue
                self._heatmap(ax, ratios)
                ax.set_xlabel(self._("concurrent sessions"))
                ax.set_ylabel(ylabel)
        legend = self._("against %(baseline)s: blue better, red worse") % {"baseline": self.labels[baseline]}
        fig.text(0.5, 0.01, legend, ha="center", fontsize=9)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        return fig

    def _heatmap(self, ax: plt.Axes, ratios: pd.DataFrame) -> None:
        """The ratios as coloured cells on a log scale centred on 1×, each labelled with its factor, the first
        row on top. Drawn with matplotlib's own mesh rather than seaborn's heatmap, which draws the whole figure
        once per panel (to see whether its tick labels overlap): with one panel per mode and configuration the
        figure took longer than all the others together (docs/scale.md)."""
        values = np.log2(ratios.to_numpy(dtype=float))
        limit = max(1.0, float(np.nanmax(np.abs(values))))
        colours, scale = plt.get_cmap("RdBu"), Normalize(-limit, limit)
        ax.pcolormesh(np.ma.masked_invalid(values), cmap=colours, norm=scale, edgecolors="white", linewidth=0.5)
        rows, columns = values.shape
        ax.set_xlim(0, columns)
        ax.set_ylim(rows, 0)
        ax.set_xticks(
            np.arange(columns) + 0.5,
            [self.number(int(c), 0) for c in ratios.columns],
            rotation=90 if columns > 8 else 0,
        )
        ax.set_yticks(np.arange(rows) + 0.5, [self.number(int(c), 0) for c in ratios.index])
        ax.grid(False)
        for spine in ax.spines.values():
            spine.set_visible(False)
        for (row, column), value in np.ndenumerate(values):
            if not np.isnan(value):  # dark text on light cells, white on dark ones (seaborn's own threshold)
                light = relative_luminance(colours(scale(value))) > 0.408
                ax.text(
                    column + 0.5,
                    row + 0.5,
                    self.number(float(ratios.iat[row, column]), 1) + "×",
                    ha="center",
                    va="center",
                    color=".15" if light else "w",
                )

    @staticmethod
    def _ratios(valid: pd.DataFrame, mode: str, name: str, baseline: str) -> pd.DataFrame:
        """context × concurrency: how many times better ``name``'s primary p50 is than ``baseline``'s."""
        cells = valid[valid["mode"] == mode] if len(valid) else valid
        if cells.empty:
            return pd.DataFrame()
        pivot = cells.pivot_table(index="context", columns="concurrency", values="primary_p50", aggfunc="first")
        by_conf = {
            n: cells[cells["configuration"] == n].pivot(index="context", columns="concurrency", values="primary_p50")
            for n in (name, baseline)
        }
        mine, theirs = (by_conf[n].reindex_like(pivot) for n in (name, baseline))
        ratio = mine / theirs if modes.get(mode).primary.higher_is_better else theirs / mine
        ratio = ratio.dropna(how="all").dropna(axis=1, how="all")
        return ratio.sort_index(ascending=False)

    def gateway_added_latency(self) -> plt.Figure:
        """What the gateway adds to the median TTFT, per-token ITL (TPOT) and e2e: one row of panels per figure,
        one panel per mode, x = each cell group (context / sessions), one line per configuration with its
        95% interval (servegrid.analysis.gateway_cost)."""
        figures = (("ttft", self._("TTFT")), ("tpot", self._("per-token ITL")), ("e2e", self._("end-to-end")))
        compared = [m for m in self.experiment.modes() if len(self.gateway) and (self.gateway["mode"] == m).any()]
        sns.set_theme(style="whitegrid", context="paper", font_scale=1.15)
        if not compared:
            fig, (ax,) = self._panels(1, height=1.6)
            ax.axis("off")
            ax.text(0.5, 0.5, self._("No cell was measured both ways."), ha="center", va="center")
            return fig
        fig, grid = plt.subplots(
            len(figures), len(compared), figsize=(3.9 * len(compared) + 1.2, 2.8 * len(figures) + 0.8), squeeze=False
        )
        for column, mode in enumerate(compared):
            cells = self.gateway[self.gateway["mode"] == mode]
            groups = sorted({(int(c), int(s)) for c, s in zip(cells["context"], cells["concurrency"], strict=True)})
            position = {group: i for i, group in enumerate(groups)}
            for row, (name, title) in enumerate(figures):
                ax = grid[row][column]
                for configuration, label in self.labels.items():
                    rows = cells[cells["configuration"] == configuration]
                    if rows.empty:
                        continue
                    rows = rows.assign(
                        x=[
                            position[(int(c), int(s))]
                            for c, s in zip(rows["context"], rows["concurrency"], strict=True)
                        ]
                    ).sort_values("x")
                    y = rows[f"{name}_added_p50_s"].to_numpy(dtype=float) * 1e3
                    low = rows[f"{name}_added_p50_ci_low_s"].to_numpy(dtype=float) * 1e3
                    high = rows[f"{name}_added_p50_ci_high_s"].to_numpy(dtype=float) * 1e3
                    spread = [np.abs(y - low), np.abs(high - y)]
                    ax.errorbar(
                        rows["x"],
                        y,
                        yerr=spread,
                        marker=self.markers[configuration],
                        label=label,
                        color=self.colours[configuration],
                        linewidth=2,
                        capsize=3,
                    )
                ax.axhline(0, color="#444444", linewidth=0.8)
                ax.set_xticks(range(len(groups)))
                ax.set_xticklabels([f"{self.number(c, 0)} / {s}" for c, s in groups], rotation=30, fontsize=8)
                ax.set_ylabel(self._("%(figure)s added (ms)") % {"figure": title})
                self._axes_numbers(ax)
                if row == 0:
                    ax.set_title(self._(modes.get(mode).short_title), fontsize=10)
                if row == len(figures) - 1:
                    ax.set_xlabel(self._("context (tokens) / concurrent sessions"))
        self._legend_and_layout(fig, 0.08 / len(figures) * 2)
        return fig
