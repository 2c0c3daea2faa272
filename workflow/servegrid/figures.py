"""Figures (seaborn): one consistent colour per configuration, 95% CI bars.

Each figure is written as PNG (for the HTML report) and SVG (vector, for the
PDF). Which figures exist depends only on the enabled modes, so Snakemake
knows the outputs before anything is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers or CI

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from servegrid import atomic
from servegrid.config import Experiment

FORMATS = ("png", "svg")


@dataclass(frozen=True)
class FigureSpec:
    name: str
    mode: str
    y_column: str
    y_label: str  # English axis label; figures carry units and data, prose lives in the report


FIGURES = (
    FigureSpec("decode_tps", "decode", "primary_p50", "decode tokens/s per session (p50)"),
    FigureSpec("single_turn_ttft", "single_turn", "primary_p50", "TTFT p50 (s)"),
    FigureSpec("multi_turn_ttft", "multi_turn", "primary_p50", "turn-2 TTFT p50 (s)"),
)


def figure_specs(experiment: Experiment) -> list[FigureSpec]:
    return [f for f in FIGURES if f.mode in experiment.modes()]


def figure_paths(experiment: Experiment, out_dir: str) -> list[str]:
    return [f"{out_dir}/{f.name}.{ext}" for f in figure_specs(experiment) for ext in FORMATS]


def palette(experiment: Experiment) -> dict[str, tuple[float, float, float]]:
    labels = [c["label"] for c in experiment.configurations.values()]
    return dict(zip(labels, sns.color_palette("colorblind", len(labels)), strict=True))


def _context_title(mode: str, context: int) -> str:
    what = {"decode": "prompt", "single_turn": "shared prefix", "multi_turn": "base context"}[mode]
    return f"{what} {context:,} tokens".replace(",", " ")


def draw(spec: FigureSpec, summary: pd.DataFrame, experiment: Experiment, out_dir: Path) -> None:
    data = summary[(summary["mode"] == spec.mode)].copy()
    contexts = sorted(data["context"].unique()) if len(data) else [0]
    colours = palette(experiment)
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.1)
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts) + 1.5, 3.6), squeeze=False, sharey=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        panel = data[data["context"] == context]
        for label, rows in panel.groupby("label", sort=False):
            rows = rows.sort_values("concurrency")
            y = rows[spec.y_column].to_numpy(dtype=float)
            low = rows["primary_ci_low"].to_numpy(dtype=float)
            high = rows["primary_ci_high"].to_numpy(dtype=float)
            err = np.vstack([np.where(np.isnan(low), 0, y - low), np.where(np.isnan(high), 0, high - y)])
            ax.errorbar(
                rows["concurrency"],
                y,
                yerr=err,
                marker="o",
                capsize=3,
                label=label,
                color=colours.get(label),
            )
            invalid = rows[~rows["valid"].astype(bool)]
            if len(invalid):
                ax.scatter(invalid["concurrency"], invalid[spec.y_column], marker="x", s=80, color="black", zorder=5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(panel["concurrency"].unique()) if len(panel) else [1])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(spec.y_label)
        ax.set_ylim(bottom=0)
        if len(contexts) > 1 or spec.mode != "decode":
            ax.set_title(_context_title(spec.mode, int(context)))
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False, bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    for ext in FORMATS:
        with atomic.atomic_path(out_dir / f"{spec.name}.{ext}") as tmp:
            fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight", metadata=_deterministic_metadata(ext))
    plt.close(fig)


def _deterministic_metadata(ext: str) -> dict[str, str | None]:
    # No creation dates in the files: the same data draws the same bytes.
    return {"Software": None} if ext == "png" else {"Date": None}


def draw_all(experiment: Experiment, summary_path: str, out_dir: Path) -> list[Path]:
    summary = pd.read_parquet(summary_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    for spec in figure_specs(experiment):
        draw(spec, summary, experiment, out_dir)
    return [Path(p) for p in figure_paths(experiment, str(out_dir))]
