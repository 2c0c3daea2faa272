"""The report's figures (seaborn/matplotlib), drawn once per language.

One colour per configuration throughout (seaborn's colour-blind palette, in
config order); medians with their 95% bootstrap intervals as bands; numbers on
the axes in the language's own format. Each figure is written as PNG (for the
HTML report) and SVG (vector, for the PDF). Which figures exist is decided in
:mod:`servegrid.figure_list` (each mode declares its own); a figure's ``kind``
names the :class:`Painter` method that draws it.
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
from matplotlib.ticker import FixedLocator, FuncFormatter

from servegrid import atomic, modes, stats
from servegrid.catalogues import format_number, load_catalog
from servegrid.config import Experiment
from servegrid.errors import ReportError
from servegrid.figure_list import FORMATS, figure_specs
from servegrid.modes.base import FigureSpec

Gettext = Callable[[str], str]

# The kinds of figure a mode may declare (FigureSpec.kind): Painter methods taking (mode, **options);
# and those of the whole run (servegrid.figure_list.RUN_FIGURES), taking nothing.
MODE_KINDS = ("primary_by_concurrency", "probe_bars", "one_configuration_by_context")
RUN_KINDS = ("ratio_heatmap",)


class Painter:
    """Draws the figures of one language."""

    def __init__(
        self, experiment: Experiment, summary: pd.DataFrame, comparisons: pd.DataFrame, gettext: Gettext, locale: str
    ) -> None:
        self.experiment = experiment
        self.summary = summary
        self.comparisons = comparisons
        self._ = gettext
        self.locale = locale
        self.labels = {name: c.label for name, c in experiment.configurations.items()}
        self.colours = dict(zip(self.labels, sns.color_palette("colorblind", len(self.labels)), strict=True))
        self.roles = experiment.roles()

    def draw(self, mode: str | None, spec: FigureSpec) -> plt.Figure:
        """The figure ``spec`` of ``mode`` (None: a figure of the whole run)."""
        kinds = RUN_KINDS if mode is None else MODE_KINDS
        if spec.kind not in kinds:
            raise ReportError(f"figure '{spec.name}': unknown kind '{spec.kind}' (known: {', '.join(kinds)})")
        draw = getattr(self, spec.kind)
        return draw() if mode is None else draw(mode, **spec.options)

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

    def _line(self, ax: plt.Axes, rows: pd.DataFrame, label: str, colour: object, marker: str = "o") -> None:
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

    def _legend(self, fig: plt.Figure, ax: plt.Axes) -> None:
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), frameon=False)

    def _panels(self, n: int, height: float = 3.6) -> tuple[plt.Figure, list[plt.Axes]]:
        sns.set_theme(style="whitegrid", context="paper", font_scale=1.15)
        fig, axes = plt.subplots(1, n, figsize=(max(6.0, 3.9 * n + 1.2), height), squeeze=False)
        return fig, list(axes[0])

    # ---- the kinds of figure a mode declares ---------------------------------------------------
    def primary_by_concurrency(self, mode: str) -> plt.Figure:
        """The mode's primary figure vs concurrent sessions, one panel per context, one line per configuration."""
        ylabel = self._(modes.get(mode).primary.axis_label)
        data = self.summary[self.summary["mode"] == mode]
        contexts = sorted(data["context"].unique()) or [0]
        fig, axes = self._panels(len(contexts))
        for ax, context in zip(axes, contexts, strict=True):
            panel = data[data["context"] == context]
            for name, label in self.labels.items():
                rows = panel[panel["configuration"] == name]
                if len(rows):
                    self._line(ax, rows, label, self.colours[name])
            self._concurrency_axis(ax, sorted(int(c) for c in panel["concurrency"].unique()))
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            self._axes_numbers(ax)
            ax.set_title(self._context_title(mode, int(context)))
        self._legend(fig, axes[0])
        fig.tight_layout(rect=(0, 0.1, 1, 1))
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
                if not stats.missing(value):
                    ax.annotate(self.number(value), (x, value), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(np.arange(len(contexts)))
        ax.set_xticklabels([self.number(c, 0) for c in contexts])
        ax.set_xlabel(self._("shared prefix (tokens): first request (solid), second request (hatched)"))
        ax.set_ylabel(self._("TTFT (s)"))
        self._axes_numbers(ax)
        self._legend(fig, ax)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        return fig

    def one_configuration_by_context(self, mode: str, role: str, zoom: bool) -> plt.Figure:
        """The first configuration of ``role`` alone, one line per context; ``zoom`` to the non-KV-limited
        points, so that a flat curve shows as flat; KV-limited points circled."""
        data = self.summary[self.summary["mode"] == mode]
        names = [n for n, r in self.roles.items() if r == role] or list(self.experiment.configurations)[:1]
        rows_all = data[data["configuration"].isin(names)]
        contexts = sorted(rows_all["context"].unique())
        shades = sns.color_palette("mako_r" if role == "speculative" else "crest", max(1, len(contexts)))
        fig, (ax,) = self._panels(1, height=3.9)
        for shade, context in zip(shades, contexts, strict=True):
            rows = rows_all[rows_all["context"] == context]
            self._line(ax, rows, self._context_title(mode, int(context)), shade)
            limited = rows[rows["kv_limited"].astype(bool)]
            for _, point in limited.iterrows():
                where = (point["concurrency"], point["primary_p50"])
                ax.scatter(*where, s=160, facecolors="none", edgecolors="#b3261e", linewidths=2, zorder=6)
                ax.annotate(
                    self._("KV limit"), where, textcoords="offset points", xytext=(6, 6), color="#b3261e", fontsize=9
                )
        ax.set_title(self.labels[names[0]] if names else "")
        self._concurrency_axis(ax, sorted(int(c) for c in rows_all["concurrency"].unique()))
        ax.set_ylabel(self._(modes.get(mode).primary.axis_label))
        ax.set_ylim(bottom=0)
        if zoom and len(rows_all):
            unlimited = rows_all[~rows_all["kv_limited"].astype(bool)]["primary_ci_high"].fillna(
                rows_all["primary_p50"]
            )
            if len(unlimited) and unlimited.max() > 0:
                ax.set_ylim(0, float(unlimited.max()) * 1.25)
        self._axes_numbers(ax)
        ax.legend(frameon=False, fontsize=8, loc="upper left")
        fig.tight_layout()
        return fig

    # ---- figures of the whole run ------------------------------------------------------------
    def ratio_heatmap(self) -> plt.Figure:
        """Per mode: how many times the winner beat the runner-up, over context × concurrency."""
        comparisons = self.comparisons
        compared = [m for m in self.experiment.modes() if len(comparisons) and (comparisons["mode"] == m).any()]
        fig, axes = self._panels(max(1, len(compared)), height=3.4)
        caching = {n for n, r in self.roles.items() if r == "caching"}
        for ax, mode in zip(axes, compared or [None], strict=False):
            if mode is None:
                ax.axis("off")
                continue
            rows = comparisons[comparisons["mode"] == mode]
            sign = [1 if winner in caching else -1 for winner in rows["winner"]]
            signed = rows.assign(value=np.log2(rows["factor"].to_numpy(dtype=float)) * np.array(sign))
            grid = signed.pivot(index="context", columns="concurrency", values="value").sort_index(ascending=False)
            factors = rows.pivot(index="context", columns="concurrency", values="factor").reindex_like(grid)
            annotations = factors.map(lambda f: "" if f != f else self.number(f, 1) + "×")
            limit = max(1.0, float(np.nanmax(np.abs(grid.to_numpy()))) if grid.size else 1.0)
            sns.heatmap(grid, ax=ax, cmap="RdBu_r", center=0, vmin=-limit, vmax=limit, annot=annotations, fmt="",
                        cbar=False, linewidths=0.5, linecolor="white")  # fmt: skip
            ax.set_title(self._(modes.get(mode).title))
            ax.set_xlabel(self._("concurrent sessions"))
            ax.set_ylabel(self._("context (tokens)"))
            ax.set_yticklabels([self.number(int(c), 0) for c in grid.index], rotation=0)
        fig.text(0.5, 0.01, self._("red: the caching configuration wins; blue: the other one wins"), ha="center",
                 fontsize=9)  # fmt: skip
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        return fig


def draw_all(experiment: Experiment, summary_path: str, comparisons_path: str, out_dir: Path, lang: str) -> list[Path]:
    # The report's catalogues carry the figures' words too.
    translations, locale = load_catalog(lang)
    painter = Painter(
        experiment, pd.read_parquet(summary_path), pd.read_parquet(comparisons_path), translations.gettext, str(locale)
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for mode, spec in figure_specs(experiment):
        fig = painter.draw(mode, spec)
        for ext in FORMATS:
            target = out_dir / f"{spec.name}.{ext}"
            with atomic.atomic_path(target) as tmp:
                fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight", metadata=_deterministic_metadata(ext))
            written.append(target)
        plt.close(fig)
    return written


def _deterministic_metadata(ext: str) -> dict[str, str | None]:
    # No creation dates in the files: the same data draws the same bytes.
    return {"Software": None} if ext == "png" else {"Date": None}
