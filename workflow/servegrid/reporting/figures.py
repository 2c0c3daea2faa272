"""The report's figures (seaborn/matplotlib), drawn once per language.

One colour and one marker per configuration throughout (seaborn's colour-blind
palette, in config order), so that lines stay apart in grey print; medians with
their 95% bootstrap intervals as bands; numbers on the axes in the language's
own format. Each figure is written once, as PNG at
:data:`~servegrid.reporting.figure_files.FIGURE_DPI`, for both reports. Which figures exist is decided in
:mod:`servegrid.reporting.figure_files` (each mode declares its own); a figure's
``kind`` names the :class:`Painter` method that draws it.

The figures of the whole run (the baseline heatmap, the latency distributions, goodput) are drawn by
:class:`servegrid.reporting.run_figures.RunFigures`, which the Painter extends (and the open-loop and trace ones by
its other mixins): colours, markers, number formats and legends stay decided in one place, here. The modes' own
drawings stay beside those shared helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers or CI

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.artist import Artist
from matplotlib.ticker import FixedLocator, FuncFormatter
from matplotlib.typing import ColorType

from servegrid import atomic, modes
from servegrid.analysis.requests_table import closed_loop
from servegrid.config import Experiment
from servegrid.errors import ReportError
from servegrid.modes.base import FigureSpec
from servegrid.paths import RunTables
from servegrid.records import table_format
from servegrid.reporting import figure_files
from servegrid.reporting.catalogues import format_number, load_catalog
from servegrid.reporting.figure_files import FIGURE_DPI, FORMATS, TABLES_READ, figure_specs, shown_contexts
from servegrid.reporting.rate_figures import RateFigures
from servegrid.reporting.run_figures import RunFigures
from servegrid.reporting.trace_figures import TraceFigures
from servegrid.stats import intervals

Gettext = Callable[[str], str]

# The kinds of figure a mode may declare (FigureSpec.kind): Painter methods taking (mode, **options);
# and those of the whole run (servegrid.reporting.figure_files.RUN_FIGURES), taking nothing.
MODE_KINDS = (*figure_files.CLOSED_LOOP_KINDS, "trace_shape")
RUN_KINDS = ("ratio_heatmap", "goodput_by_concurrency", "latency_cdfs", "gateway_added_latency", "latency_by_rate")
# One marker per configuration besides its colour, in config order: lines stay apart in grey print.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


class Painter(RunFigures, RateFigures, TraceFigures):
    """Draws the figures of one language: the modes' own here, the whole run's in :class:`RunFigures`."""

    def __init__(
        self,
        experiment: Experiment,
        summary: pd.DataFrame,
        comparisons: pd.DataFrame,
        gettext: Gettext,
        locale: str,
        lang: str,
        requests: pd.DataFrame | None = None,
        gateway: pd.DataFrame | None = None,
        open_summary: pd.DataFrame | None = None,
    ) -> None:
        self.experiment = experiment
        self.open_summary = open_summary if open_summary is not None else pd.DataFrame()  # open-loop cells' rows
        self.gateway = gateway if gateway is not None else pd.DataFrame()
        self.summary = summary
        self.requests = requests if requests is not None else pd.DataFrame()
        self.comparisons = comparisons
        self._ = gettext
        self.locale = locale
        self.labels = {name: experiment.label(name, lang) for name in experiment.configurations}
        self.colours = dict(zip(self.labels, sns.color_palette("colorblind", len(self.labels)), strict=True))
        self.markers = dict(zip(self.labels, MARKERS, strict=False))

    def draw(self, mode: str | None, spec: FigureSpec) -> plt.Figure:
        """The figure ``spec`` of ``mode`` (None: a figure of the whole run)."""
        kinds = RUN_KINDS if mode is None else MODE_KINDS
        if spec.kind not in kinds:
            raise ReportError(f"figure '{spec.name}': unknown kind '{spec.kind}' (known: {', '.join(kinds)})")
        draw = getattr(self, spec.kind)
        figure: plt.Figure = draw() if mode is None else draw(mode, **spec.options)
        return figure

    # ---- helpers -------------------------------------------------------------------
    def number(self, value: float, digits: int | None = None) -> str:
        if digits is None:
            digits = 0 if abs(value) >= 100 or float(value).is_integer() else (1 if abs(value) >= 10 else 2)
        return format_number(value, digits, self.locale)

    def _axes_numbers(self, ax: plt.Axes) -> None:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: self.number(v)))

    def _concurrency_axis(self, ax: plt.Axes, values: list[int]) -> None:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(values or [1]))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: self.number(v, 0)))
        ax.xaxis.set_minor_locator(FixedLocator([]))
        ax.set_xlabel(self._("concurrent sessions"))

    def _context_title(self, mode: str, context: int) -> str:
        return self._(modes.get(mode).context_title) % {"tokens": self.number(context, 0)}

    def _line(self, ax: plt.Axes, rows: pd.DataFrame, label: str, colour: ColorType, marker: str = "o") -> None:
        rows = rows.sort_values("concurrency")
        x = rows["concurrency"].to_numpy(dtype=float)
        y = rows["primary_p50"].to_numpy(dtype=float)
        low = rows["primary_ci_low"].to_numpy(dtype=float)
        high = rows["primary_ci_high"].to_numpy(dtype=float)
        ax.plot(x, y, marker=marker, label=label, color=colour, linewidth=2)
        band = ~np.isnan(low) & ~np.isnan(high)
        if band.any():
            ax.fill_between(x[band], low[band], high[band], color=colour, alpha=0.18, linewidth=0)
        invalid = rows[~rows["valid"].astype(bool)]
        if len(invalid):
            ax.scatter(invalid["concurrency"], invalid["primary_p50"], marker="x", s=90, color="black", zorder=5)
        # A cell too small for a median (servegrid.stats.sampling) has no point: a hollow marker on the axis says so.
        few = rows[rows["primary_p50"].isna()]
        if len(few):
            on_axis = np.full(len(few), 0.04)  # in axes units: just above the x axis
            ax.scatter(
                few["concurrency"],
                on_axis,
                transform=ax.get_xaxis_transform(),
                marker=marker,
                s=60,
                facecolors="none",
                edgecolors=[colour],
                linewidths=1.5,
                zorder=5,
                clip_on=False,
            )
            ax.scatter([], [], marker="o", facecolors="none", edgecolors="grey", label=self._("n too small"))

    def _legend_and_layout(self, fig: plt.Figure, bottom: float) -> None:
        """One legend for the figure, from every panel (a configuration missing from the first one is
        still named), each label once, in the ``bottom`` share of the figure kept free below the panels
        (a legend of many rows grows downwards, past the figure's edge: the saved file includes it)."""
        seen: dict[str, Artist] = {}
        for axis in fig.axes:
            for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
                seen.setdefault(label, handle)
        if seen:
            # As many columns as the figure's width holds at the longest label (about 13 characters an inch),
            # at most three: a wider legend would widen the saved figure and shrink it on the page.
            longest = max(len(label) for label in seen)
            columns = max(1, min(3, len(seen), int(fig.get_figwidth() * 13 // (longest + 4))))
            fig.legend(
                list(seen.values()),
                list(seen),
                loc="upper center",
                bbox_to_anchor=(0.5, bottom),
                ncol=columns,
                frameon=False,
            )
        fig.tight_layout(rect=(0, bottom, 1, 1))

    @staticmethod
    def _wrapped(n: int) -> tuple[plt.Figure, list[plt.Axes], int]:
        """``n`` panels, three to a row: the figure, its axes in reading order, and how many rows."""
        columns = max(1, min(3, n))
        rows = max(1, -(-n // columns))
        sns.set_theme(style="whitegrid", context="paper", font_scale=1.15)
        fig, grid = plt.subplots(rows, columns, figsize=(3.9 * columns + 1.2, 3.4 * rows + 0.6), squeeze=False)
        return fig, list(grid.flat), rows

    def _panels(self, n: int, height: float = 3.6) -> tuple[plt.Figure, list[plt.Axes]]:
        sns.set_theme(style="whitegrid", context="paper", font_scale=1.15)
        fig, axes = plt.subplots(1, n, figsize=(max(6.0, 3.9 * n + 1.2), height), squeeze=False)
        return fig, list(axes[0])

    # ---- the kinds of figure a mode declares ---------------------------------------------------
    def primary_by_concurrency(self, mode: str) -> plt.Figure:
        """The mode's primary figure vs concurrent sessions, one panel per context, one line per configuration."""
        ylabel = self._(modes.get(mode).primary.axis_label)
        data = self.summary[self.summary["mode"] == mode]
        contexts = shown_contexts(data["context"].unique()) or [0]
        fig, axes = self._panels(len(contexts))
        for ax, context in zip(axes, contexts, strict=True):
            panel = data[data["context"] == context]
            for name, label in self.labels.items():
                rows = panel[panel["configuration"] == name]
                if len(rows):
                    self._line(ax, rows, label, self.colours[name], self.markers[name])
            self._concurrency_axis(ax, sorted(int(c) for c in panel["concurrency"].unique()))
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            self._axes_numbers(ax)
            ax.set_title(self._context_title(mode, int(context)))
        self._legend_and_layout(fig, 0.1)
        return fig

    def probe_bars(self, mode: str) -> plt.Figure:
        """First vs second request on a fresh prefix, per prefix length: cache hit vs re-prefill."""
        data = self.summary[(self.summary["mode"] == mode) & self.summary["probe_first_ttft_s"].notna()]
        data = data.sort_values("concurrency").groupby(["configuration", "context"], sort=False).head(1)
        contexts = sorted(data["context"].unique())
        names = [n for n in self.experiment.configurations if n in set(data["configuration"])]
        fig, (ax,) = self._panels(1)
        width = 0.8 / max(1, 2 * len(names))
        for i, name in enumerate(names):
            label = self.labels[name]
            rows = data[data["configuration"] == name].set_index("context").reindex(contexts)
            base = np.arange(len(contexts)) + (2 * i - len(names) + 0.5) * width
            ax.bar(base, rows["probe_first_ttft_s"], width, color=self.colours[name], label=label)
            ax.bar(base + width, rows["probe_second_ttft_s"], width, color=self.colours[name], alpha=0.45, hatch="//")
            for x, value in zip(base + width, rows["probe_second_ttft_s"], strict=True):
                if not intervals.missing(value):
                    ax.annotate(self.number(value), (x, value), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(np.arange(len(contexts)))
        ax.set_xticklabels([self.number(c, 0) for c in contexts])
        ax.set_xlabel(self._("shared prefix (tokens): first request (solid), second request (hatched)"))
        ax.set_ylabel(self._("TTFT (s)"))
        self._axes_numbers(ax)
        self._legend_and_layout(fig, 0.1)
        return fig

    def each_configuration_by_context(self, mode: str) -> plt.Figure:
        """One panel per configuration, one line per context, each panel on its own scale (so that a flat
        curve shows as flat); KV-limited points circled."""
        data = self.summary[self.summary["mode"] == mode]
        names = [n for n in self.labels if (data["configuration"] == n).any()] or list(self.labels)[:1]
        contexts = sorted(data["context"].unique())
        shades = sns.color_palette("crest", max(1, len(contexts)))
        fig, axes, rows_n = self._wrapped(len(names))
        for ax, name in zip(axes, names, strict=False):
            rows_all = data[data["configuration"] == name]
            for shade, context in zip(shades, contexts, strict=False):
                rows = rows_all[rows_all["context"] == context]
                if len(rows):
                    self._line(ax, rows, self._context_title(mode, int(context)), shade, self.markers[name])
            for _, point in rows_all[rows_all["kv_limited"].astype(bool)].iterrows():
                where = (point["concurrency"], point["primary_p50"])
                ax.scatter(*where, s=160, facecolors="none", edgecolors="#b3261e", linewidths=2, zorder=6)
                ax.annotate(
                    self._("KV limit"), where, textcoords="offset points", xytext=(6, 6), color="#b3261e", fontsize=9
                )
            ax.set_title(self.labels[name], fontsize=10)
            self._concurrency_axis(ax, sorted(int(c) for c in data["concurrency"].unique()))
            ax.set_ylabel(self._(modes.get(mode).primary.axis_label))
            ax.set_ylim(bottom=0)
            # Zoomed to the points that did not run into the KV capacity: one such corner would flatten the
            # rest (a flat curve must show as flat); the clipped points keep their red circle at the edge.
            free = rows_all[~rows_all["kv_limited"].astype(bool)]
            top = free["primary_ci_high"].fillna(free["primary_p50"]).max() if len(free) else np.nan
            if not np.isnan(top) and top > 0:
                ax.set_ylim(0, float(top) * 1.25)
            self._axes_numbers(ax)
        for ax in axes[len(names) :]:
            ax.axis("off")
        self._legend_and_layout(fig, 0.1 / rows_n)
        return fig

    def throughput_latency(self, mode: str) -> plt.Figure:
        """Total output tokens/s against decode tokens/s per session (the Pareto view), one panel per context,
        one curve per configuration through its concurrencies, each point labelled with its sessions."""
        data = self.summary[self.summary["mode"] == mode]
        contexts = shown_contexts(data["context"].unique()) or [0]
        fig, axes = self._panels(len(contexts), height=3.9)
        for ax, context in zip(axes, contexts, strict=True):
            panel = data[data["context"] == context]
            for name, label in self.labels.items():
                rows = panel[panel["configuration"] == name].sort_values("concurrency")
                if rows.empty:
                    continue
                x = rows["output_tps_total"].to_numpy(dtype=float)
                y = rows["decode_tps_p50"].to_numpy(dtype=float)
                ax.plot(x, y, marker=self.markers[name], color=self.colours[name], label=label, linewidth=2)
                for xi, yi, sessions in zip(x, y, rows["concurrency"], strict=True):
                    if not (np.isnan(xi) or np.isnan(yi)):
                        ax.annotate(
                            self.number(int(sessions), 0),
                            (xi, yi),
                            textcoords="offset points",
                            xytext=(5, 4),
                            fontsize=8,
                            color=self.colours[name],
                        )
            ax.set_xlabel(self._("total output tokens/s (server)"))
            ax.set_ylabel(self._("decode tokens/s per session (p50)"))
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: self.number(v)))
            self._axes_numbers(ax)
            ax.set_title(self._context_title(mode, int(context)))
        self._legend_and_layout(fig, 0.1)
        return fig


def draw_all(experiment: Experiment, tables: RunTables, out_dir: Path, lang: str) -> list[Path]:
    """Every figure of the run in ``lang`` (PNG) into ``out_dir``; returns the files written."""
    # The report's catalogues carry the figures' words too.
    translations, locale = load_catalog(lang)
    # Drawn by concurrency: closed-loop cells; the open-loop ones by rate (RateFigures), from the summary's other rows.
    everything = {name: table_format.read(path) for name, path in tables.named(TABLES_READ).items()}
    read = {name: closed_loop(frame) for name, frame in everything.items()}
    summary = everything["summary"]
    open_rows = summary[summary["open_loop"].fillna(False).astype(bool)] if "open_loop" in summary else summary[:0]
    painter = Painter(
        experiment,
        read["summary"],
        read["comparisons"],
        translations.gettext,
        str(locale),
        lang,
        read["requests"],
        read["gateway"],
        open_rows,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for mode, spec in figure_specs(experiment):
        fig = painter.draw(mode, spec)
        for ext in FORMATS:
            target = out_dir / f"{spec.name}.{ext}"
            with atomic.atomic_path(target) as tmp:
                fig.savefig(tmp, format=ext, dpi=FIGURE_DPI, bbox_inches="tight", metadata=_deterministic_metadata(ext))
            written.append(target)
        plt.close(fig)
    return written


def _deterministic_metadata(ext: str) -> dict[str, str | None]:
    # No creation dates in the files: the same data draws the same bytes.
    return {"Software": None} if ext == "png" else {"Date": None}
