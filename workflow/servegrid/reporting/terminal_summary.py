"""The plain-text summary of a run: the verdict, the cells to look at, where the reports are.

Snakemake prints it when a run succeeds (``onsuccess``), as the last thing on the terminal, and
``servegrid summary`` prints it at any time. It reads the Parquet tables alone (no figure, no report),
and it is in English: the reports carry the translations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from servegrid import modes, paths
from servegrid.analysis.aggregation import refused_configurations
from servegrid.config import Experiment
from servegrid.errors import UnknownModeError
from servegrid.records import table_format
from servegrid.stats import intervals

OUTCOME = {
    "win": "wins",
    "mixed": "wins most",
    "shared": "lead together",
    "tie": "tie",
    "kv_limit": "neither",
    "no_data": "no data",
}


def _class_title(class_id: str) -> str:
    if class_id == "kv_limit":
        return "KV-cache capacity"
    try:
        return modes.get(class_id).short_title
    except UnknownModeError:  # a class of the user's own (verdict.classes): its id is its name
        return class_id


def _factor(row: dict[str, Any]) -> str:
    if row["outcome"] == "kv_limit":
        return f"the pool, from {int(row['min_context']):,} tokens x {int(row['min_concurrency'])} sessions"
    if intervals.missing(row.get("factor_min")):
        return ""
    low, high = row["factor_min"], row["factor_max"]
    text = f"{low:.2f}x" if abs(high - low) < 0.005 else f"{low:.2f}-{high:.2f}x"
    if not intervals.missing(row.get("factor_min_ci_low")) and not intervals.missing(row.get("factor_max_ci_high")):
        text += f" (95% CI {row['factor_min_ci_low']:.2f}-{row['factor_max_ci_high']:.2f}x)"
    return text


def table(rows: list[list[str]]) -> list[str]:
    """Rows of cells as aligned text (the first row is the header, underlined)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]


def text(experiment: Experiment) -> str:
    """The summary, from the tables under ``results/`` (those of the last aggregation)."""
    summary_path, verdict_path = Path(paths.SUMMARY_TABLE), Path(paths.VERDICT_TABLE)
    if not summary_path.exists() or not verdict_path.exists():
        return f"servegrid: no tables yet ({paths.SUMMARY_TABLE}); run the pipeline's report target first"
    summary = table_format.read(summary_path)
    verdict = table_format.read(verdict_path)
    invalid = summary[~summary["valid"].astype(bool)]
    imprecise = int(summary["precise"].eq(False).sum()) if "precise" in summary else 0  # None: a fixed count
    lines = [
        f"servegrid: {len(summary)} cells, {len(invalid)} invalid, {imprecise} imprecise (a ceiling reached first), "
        f"{int(summary['kv_limited'].astype(bool).sum())} at the KV-cache capacity",
        "",
        "Verdict",
    ]
    rows = [["workload", "outcome", "configuration", "by"]]
    for row in verdict.to_dict("records"):
        if row["outcome"] == "no_data":
            continue
        winner = "" if intervals.missing(row.get("winner")) else str(row["winner"]).replace(",", " + ")
        rows.append([_class_title(row["class_id"]), OUTCOME.get(row["outcome"], row["outcome"]), winner, _factor(row)])
    lines += table(rows) if len(rows) > 1 else ["  no workload class has data (closed-loop cells)"]
    lines += _rate_lines()
    lines += _gateway_lines(experiment)
    lines += _refused_lines()
    lines += _older_format_lines(summary)
    if len(invalid):
        lines += ["", "Invalid cells (measured, not compared):"]
        lines += [f"  {r['cell_id']}: {r['invalid_reasons']}" for r in invalid.to_dict("records")]
    reports = [
        paths.REPORT_PATTERN.format(lang=lang, ext=ext)
        for lang in experiment.languages
        for ext in ("html", "pdf")
        if Path(paths.REPORT_PATTERN.format(lang=lang, ext=ext)).exists()
    ]
    lines += ["", "Reports:", *(f"  {p}" for p in reports)] if reports else ["", "No report built yet."]
    return "\n".join(lines)


def _rate_lines() -> list[str]:
    """The verdict in rates (open-loop cells, rates.parquet): each configuration's highest sustained offered rate
    (a replayed trace: and speedup), the next one measured, and what stopped it there."""
    rates_path = Path(paths.RATES_TABLE)
    rates = table_format.read(rates_path) if rates_path.exists() else pd.DataFrame()
    if rates.empty:
        return []

    def rate(value: Any, speedup: Any) -> str:
        if intervals.missing(value):
            return "none"
        return f"{value:.2f}/s" + ("" if intervals.missing(speedup) else f" ({speedup:g}x)")

    rows = [["workload", "context/window", "configuration", "sustains", "not at", "stopped by"]]
    for r in rates.to_dict("records"):
        trace = not (intervals.missing(r.get("sustainable_speedup")) and intervals.missing(r.get("speedup_below")))
        rows.append(
            [
                modes.get(r["mode"]).short_title,
                (r.get("window") or "-") if trace else f"{int(r['context']):,}",
                r["configuration"] + (" *" if r["winner"] else ""),
                rate(r["sustainable_rate"], r.get("sustainable_speedup")),
                rate(r["capacity_below"], r.get("speedup_below"))
                if not intervals.missing(r["capacity_below"])
                else "-",
                "" if intervals.missing(r.get("stopped_by")) else str(r["stopped_by"]),
            ]
        )
    return ["", "Verdict in rates (open loop; * the highest)", *table(rows)]


def _older_format_lines(summary: pd.DataFrame) -> list[str]:
    """Cells read from an older cell-file format that lacks some of today's columns: kept and compared, and which
    columns re-measuring them would fill (servegrid.records.cell_format)."""
    if "older_format_lacks" not in summary:
        return []
    older = summary[summary["older_format_lacks"].fillna("").astype(str) != ""]
    if older.empty:
        return []
    heading = (
        f"Read from an older cell-file format ({len(older)} cells, kept and compared; re-measure a cell with "
        "--forcerun <its file> to get what it lacks):"
    )
    lines = ["", heading]
    for lacking, cells in older.groupby("older_format_lacks", sort=False):
        shown = ", ".join(cells["cell_id"].head(3)) + (f" and {len(cells) - 3} more" if len(cells) > 3 else "")
        lines.append(f"  {shown}: lacks {lacking}")
    return lines


def _refused_lines() -> list[str]:
    """The configurations whose engine died at its first request on every server it got, with its reason."""
    servers_path = Path(paths.SERVERS_TABLE)
    servers = table_format.read(servers_path) if servers_path.exists() else pd.DataFrame()
    refused = refused_configurations(servers)
    if not refused:
        return []
    cells = servers.groupby("configuration")["cells"].sum()
    lines = [f"  {name} ({int(cells[name])} cells): {reason}" for name, reason in refused.items()]
    return ["", "Refused by the engine (not measured; the verdict compares the others):", *lines]


def _gateway_lines(experiment: Experiment) -> list[str]:
    """With route: both, what the gateway added (per concurrency, the median over its cells of each cell's added
    p50, and the range) and the workload classes whose verdict it changes (servegrid.analysis.gateway_cost)."""
    added_path, changes_path = Path(paths.GATEWAY_TABLE), Path(paths.GATEWAY_VERDICT_TABLE)
    if experiment.route != "both" or not added_path.exists():
        return []
    added = table_format.read(added_path)
    if added.empty:
        return []
    lines = [
        "",
        f"Through the gateway ({len(added)} cells both ways): added p50 by concurrency, median over its cells "
        "[min, max]",
    ]
    for figure, name in (("ttft", "TTFT"), ("tpot", "per-token ITL (TPOT)"), ("e2e", "e2e")):
        parts = []
        for sessions, cells in added.groupby("concurrency"):
            values = cells[f"{figure}_added_p50_s"].astype(float).dropna() * 1e3
            if len(values):
                parts.append(f"{int(sessions)} x: {values.median():+.1f} ms [{values.min():+.1f}, {values.max():+.1f}]")
        if parts:
            lines.append(f"  {name}: " + "; ".join(parts))
    changes = table_format.read(changes_path) if changes_path.exists() else pd.DataFrame()
    changed = changes[changes["changed"].astype(bool)] if len(changes) else changes
    lines.append(
        "  verdict unchanged through it"
        if changed.empty
        else "  verdict changed through it: " + ", ".join(_class_title(c) for c in changed["class_id"])
    )
    return lines
