"""Two runs side by side: for the cells they share, how far each primary figure moved, and whether beyond noise.

``servegrid compare OLD NEW`` reads each run's ``tables/`` (its ``summary.parquet`` and ``requests.parquet``,
as the aggregate step wrote them under ``results/``): an engine upgrade, a new flag, last month's run. Per
shared cell (configuration × mode × context × concurrency) it gives the ratio NEW / OLD of the primary
figure's median and that ratio's 95% bootstrap interval, both runs' samples resampled independently (the
verdict's method, servegrid.analysis.verdict.CellSamples). A cell *moved* when the interval excludes 1 and the ratio
is at least ``min_factor`` away from it (verdict.min_factor: a 1% shift that a long run resolves is not news);
it moved for the *better* or the *worse* by its mode's direction (decode speed up is better, TTFT down is).
A cell whose server launch changed between the runs (its spec hash) is marked so: that is where to look first.

Open-loop cells (``ctx<context>_r<rate>``) are matched by their rate. Their requests queue behind each other, so
resampling them as independent would give too narrow an interval: such a cell moved when the two runs' batch-medians
intervals of its median (the summary's, servegrid.stats.correlated) do not overlap and the ratio is at least
``min_factor`` away from 1; it has no interval of the ratio.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from servegrid import atomic, modes
from servegrid.analysis.requests_table import closed_loop, with_window
from servegrid.analysis.verdict import CellSamples
from servegrid.errors import ConfigError
from servegrid.records import table_format
from servegrid.records.cell_spec import rate_label
from servegrid.reporting import terminal_summary
from servegrid.stats import intervals

# rate 0: a closed-loop cell; window "": not a trace window's cell
KEYS = ["configuration", "mode", "context", "concurrency", "rate", "window"]
COLUMNS = [
    *KEYS,
    "cell",
    "metric",
    "old_p50",
    "new_p50",
    "old_n",
    "new_n",
    "ratio",
    "ratio_ci_low",
    "ratio_ci_high",
    "moved",
    "direction",
    "spec_changed",
]


def _run_tables(run: Path | str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A run's summary and requests tables: ``run`` is its results folder (or the tables folder itself)."""
    folder = Path(run)
    tables = folder / "tables" if (folder / "tables").is_dir() else folder
    try:
        return table_format.read(tables / "summary.parquet"), table_format.read(tables / "requests.parquet")
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ConfigError(
            f"{run}: no summary.parquet and requests.parquet to compare ({exc}); give a run's results folder"
        ) from exc


def compare_runs(old: Path | str, new: Path | str, min_factor: float = 1.05) -> pd.DataFrame:
    """One row per cell both runs measured validly with a median (see the module docstring)."""
    (old_summary, old_requests), (new_summary, new_requests) = _run_tables(old), _run_tables(new)
    for frame in (old_summary, new_summary):  # tables from before rates existed: every cell closed loop
        if "rate" not in frame:
            frame["rate"] = 0.0
    old_summary, new_summary = with_window(old_summary), with_window(new_summary)  # ... and before windows
    # Resampled as independent samples: the closed-loop cells only (CellSamples keys cells by sessions).
    old_samples = CellSamples(closed_loop(old_requests), salt="old")
    new_samples = CellSamples(closed_loop(new_requests), salt="new")
    usable = ["valid", "primary_p50"]
    old_cells = old_summary[old_summary[usable[0]].astype(bool) & old_summary[usable[1]].notna()]
    new_cells = new_summary[new_summary[usable[0]].astype(bool) & new_summary[usable[1]].notna()]
    both = old_cells.merge(new_cells, on=KEYS, suffixes=("_old", "_new"))
    rows: list[dict[str, Any]] = []
    for cell in both.to_dict("records"):
        key = (str(cell["configuration"]), str(cell["mode"]), int(cell["context"]), int(cell["concurrency"]))
        ratio = cell["primary_p50_new"] / cell["primary_p50_old"]
        if cell["rate"]:  # open loop: the two runs' own intervals, which allow for correlated samples
            low = high = None
            apart = _disjoint(cell, "old", "new") or _disjoint(cell, "new", "old")
            moved = apart and max(ratio, 1 / ratio) >= min_factor
        else:
            low, high = new_samples.ratio_ci(key, key, old_samples)
            moved = (
                low is not None and high is not None and (low > 1 or high < 1) and max(ratio, 1 / ratio) >= min_factor
            )
        higher_is_better = modes.get(cell["mode"]).primary.higher_is_better
        rows.append(
            {
                **{k: cell[k] for k in KEYS},
                "cell": f"{cell['configuration']}/{cell['mode']}/ctx{cell['context']}_{_load(cell)}",
                "metric": cell["primary_metric_new"],
                "old_p50": cell["primary_p50_old"],
                "new_p50": cell["primary_p50_new"],
                "old_n": cell["primary_n_old"],
                "new_n": cell["primary_n_new"],
                "ratio": ratio,
                "ratio_ci_low": low,
                "ratio_ci_high": high,
                "moved": bool(moved),
                "direction": None if not moved else "better" if (ratio > 1) == higher_is_better else "worse",
                "spec_changed": cell["spec_hash_old"] != cell["spec_hash_new"],
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def _disjoint(cell: dict[str, Any], below: str, above: str) -> bool:
    """The ``below`` run's interval of the median lies wholly under the ``above`` run's."""
    high, low = cell[f"primary_ci_high_{below}"], cell[f"primary_ci_low_{above}"]
    return not intervals.missing(high) and not intervals.missing(low) and high < low


def text(frame: pd.DataFrame, old: str, new: str) -> str:
    """The comparison as a terminal table, the cells that moved first."""
    if frame.empty:
        return f"servegrid compare: {old} and {new} share no valid cell with a median"
    moved = frame[frame["moved"]]
    lines = [
        f"servegrid compare: {len(frame)} cells in both runs, {len(moved)} moved beyond noise (old: {old}, new: {new})",
        "",
    ]
    rows = [["cell", "metric", "old p50", "new p50", "new / old (95% CI)", "moved", "launch changed"]]
    ordered = pd.concat([moved, frame[~frame["moved"]]])
    for r in ordered.to_dict("records"):
        interval = (
            "" if intervals.missing(r["ratio_ci_low"]) else f" ({r['ratio_ci_low']:.3f}-{r['ratio_ci_high']:.3f})"
        )
        rows.append(
            [
                str(r["cell"]),
                str(r["metric"]),
                f"{r['old_p50']:.4g}",
                f"{r['new_p50']:.4g}",
                f"{r['ratio']:.3f}x{interval}",
                r["direction"] if isinstance(r["direction"], str) else "-",
                "yes" if r["spec_changed"] else "",
            ]
        )
    return "\n".join(lines + terminal_summary.table(rows))


def write_html(frame: pd.DataFrame, old: str, new: str, lang: str, out: Path | str) -> None:
    """The comparison as an HTML page in ``lang``, in the report's style and words (report/templates)."""
    from servegrid.reporting import document

    env, fmt, _ = document.environment(lang)
    html = env.get_template("compare.html.j2").render(
        html_lang=str(fmt.locale).replace("_", "-"),
        css=(document.TEMPLATES / "style.css").read_text(encoding="utf-8"),
        old=old,
        new=new,
        rows=pd.concat([frame[frame["moved"]], frame[~frame["moved"]]]).to_dict("records"),
        moved=int(frame["moved"].sum()) if len(frame) else 0,
        modes={m.name: m for m in modes.registered()},
    )
    atomic.write_text(out, html)


def _load(row: dict[str, Any]) -> str:
    speedup = row.get("speedup", row.get("speedup_new"))  # merged rows carry each run's
    if speedup is not None and not pd.isna(speedup):  # a replayed trace's cell: named by its speedup and window
        return f"x{rate_label(float(speedup))}" + (f"_{row['window']}" if row.get("window") else "")
    return f"r{rate_label(float(row['rate']))}" if row.get("rate") else f"c{row['concurrency']}"
