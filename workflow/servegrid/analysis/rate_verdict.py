"""The verdict in rates: per mode, context and configuration, the highest offered rate it sustains, and how the
configurations' sustainable rates compare (docs/open-loop.md, "The verdict in rates"). A replayed trace's cells are
judged alike, their offered rates being the trace's times each speedup: the row also names the speedups.

An open-loop cell **sustains** its offered rate when it is valid, not saturated, meets its mode's objectives
(``slo:``, judged as for the production table: servegrid.analysis.slo) and its goodput (requests that met every
objective, per second of the measured window) is at least ``verdict.goodput_share`` of the rate its schedule offered
in that window (``scheduled_rate``: the seeded arrivals' own rate there, the same for every configuration; a few
dozen Poisson arrivals stray well off the nominal rate, by ±18% at 30). A configuration's **sustainable rate** is
the highest offered rate that it and every lower rate sustain; its capacity lies between that rate and the next rate
measured, which it did not sustain (none: "at least"). A mode without objectives is judged by goodput alone, every
answered request counting.

The ratio of two configurations' sustainable rates gets a 95% bootstrap interval: each cell's measured requests
are resampled (2,000 times, a seed per cell), each resample judged as above, and the sustainable rates recomputed
from the resampled cells. The rates are the grid's, so the interval moves in the grid's steps.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pandas as pd

from servegrid.analysis import slo
from servegrid.analysis.requests_table import CELL_KEYS, SERIES_KEYS, with_window
from servegrid.config.sections import Objective
from servegrid.stats import intervals, sampling

COLUMNS = [
    "mode",
    "context",
    "window",
    "configuration",
    "sustainable_rate",
    "capacity_below",
    "stopped_by",
    "measured_rates",
    "sustained_rates",
    "goodput_rps",
    "winner",
    "ratio_to_baseline",
    "ratio_ci_low",
    "ratio_ci_high",
    "sustainable_speedup",
    "speedup_below",
]
RESAMPLES = 2000


def cell_sustains(row: dict[str, Any], share: float) -> tuple[bool, str | None]:
    """Whether one open-loop cell sustains its offered rate, and if not, what stopped it."""
    if not row.get("valid"):
        return False, "invalid"
    if row.get("saturated"):
        return False, "saturated"
    if row.get("slo_met") is False:
        return False, "objectives"
    if row.get("slo_met") is None and row.get("slo_attainment") is not None:
        return False, "too_few"
    goodput = row.get("goodput_rps")
    if goodput is None or pd.isna(goodput):  # no objectives: every answered request counts
        goodput = row.get("achieved_rate")
    if goodput is None or pd.isna(goodput) or goodput < share * _scheduled(row):
        return False, "goodput"
    return True, None


def _scheduled(row: dict[str, Any]) -> float:
    """The rate the seeded schedule offered in the cell's measured window (load_columns), else the nominal one."""
    value = row.get("scheduled_rate")
    return float(row["offered_rate"]) if value is None or pd.isna(value) else float(value)


def _sustained(rates: list[float], passes: list[bool]) -> int:
    """How many of the lowest rates pass, without a gap."""
    held = 0
    while held < len(passes) and passes[held]:
        held += 1
    return held


def rate_table(
    summary: pd.DataFrame,
    requests: pd.DataFrame,
    order: list[str],
    objectives: dict[str, tuple[Objective, ...]],
    share: float,
    min_factor: float = 1.05,
) -> pd.DataFrame:
    """One row per mode × context (× a trace's window) × configuration of the open-loop cells (empty without any)."""
    if summary.empty or "open_loop" not in summary or not summary["open_loop"].fillna(False).astype(bool).any():
        return pd.DataFrame(columns=COLUMNS)
    cells = with_window(summary[summary["open_loop"].fillna(False).astype(bool)])
    measured = with_window(requests[requests["phase"] == "measured"] if len(requests) else requests)
    by_cell = {key: rows for key, rows in measured.groupby(CELL_KEYS, sort=False)} if len(measured) else {}
    rows: list[dict[str, Any]] = []
    # A trace's windows are different traffic: each its own sweep of speedups.
    for (mode, context, window), group in cells.groupby(SERIES_KEYS, sort=False):
        goals = objectives.get(str(mode), ())
        names = [name for name in order if (group["configuration"] == name).any()]
        resampled: dict[str, np.ndarray] = {}
        for name in names:
            own = group[group["configuration"] == name].sort_values("offered_rate").to_dict("records")
            rates = [float(r["offered_rate"]) for r in own]
            judged = [cell_sustains(r, share) for r in own]
            held = _sustained(rates, [ok for ok, _ in judged])
            goodput = own[held - 1].get("goodput_rps") if held else None
            rows.append(
                {
                    "mode": mode,
                    "context": int(context),
                    "window": str(window),
                    "configuration": name,
                    "sustainable_rate": rates[held - 1] if held else None,
                    "capacity_below": rates[held] if held < len(rates) else None,
                    "stopped_by": judged[held][1] if held < len(rates) else None,
                    "measured_rates": ",".join(f"{r:g}" for r in rates),
                    "sustained_rates": ",".join(f"{r:g}" for r, (ok, _) in zip(rates, judged, strict=True) if ok),
                    "goodput_rps": None if goodput is None or pd.isna(goodput) else float(goodput),
                    "winner": False,
                    "ratio_to_baseline": None,
                    "ratio_ci_low": None,
                    "ratio_ci_high": None,
                    # A replayed trace: the same in the trace's speedups (its offered rates: the trace's times these).
                    "sustainable_speedup": _speedup(own[held - 1]) if held else None,
                    "speedup_below": _speedup(own[held]) if held < len(rates) else None,
                }
            )
            resampled[name] = _resampled_sustainable(own, by_cell, goals, share)
        group_rows = rows[len(rows) - len(names) :]
        _mark_winners(group_rows, min_factor)
        _ratios(group_rows, resampled)
    return pd.DataFrame(rows, columns=COLUMNS)


def _speedup(row: dict[str, Any]) -> float | None:
    value = row.get("speedup")
    return None if value is None or pd.isna(value) else float(value)


def _mark_winners(group: list[dict[str, Any]], min_factor: float) -> None:
    """The highest sustainable rate wins; equal rates, the higher goodput there (within min_factor: a tie)."""
    contenders = [r for r in group if r["sustainable_rate"] is not None]
    if not contenders:
        return
    most = max(r["sustainable_rate"] for r in contenders)
    top = [r for r in contenders if r["sustainable_rate"] == most]
    best = max(r["goodput_rps"] or 0.0 for r in top)
    for r in top:
        r["winner"] = (r["goodput_rps"] or 0.0) * min_factor >= best


def _ratios(group: list[dict[str, Any]], resampled: dict[str, np.ndarray]) -> None:
    """Each configuration's sustainable rate over the first configuration's (the group's baseline), with its
    bootstrap interval; None where either sustains no rate."""
    baseline = group[0]
    for row in group[1:]:
        if row["sustainable_rate"] is None or baseline["sustainable_rate"] is None:
            continue
        row["ratio_to_baseline"] = row["sustainable_rate"] / baseline["sustainable_rate"]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = resampled[row["configuration"]] / resampled[baseline["configuration"]]
        ratios = ratios[np.isfinite(ratios) & (ratios > 0)]
        if ratios.size >= RESAMPLES // 2:  # most resamples sustain a rate on both sides
            tail = (1 - intervals.CONFIDENCE) / 2 * 100
            row["ratio_ci_low"], row["ratio_ci_high"] = (float(v) for v in np.percentile(ratios, (tail, 100 - tail)))


def _resampled_sustainable(
    own: list[dict[str, Any]],
    by_cell: dict[tuple[Any, ...], pd.DataFrame],
    goals: tuple[Objective, ...],
    share: float,
) -> np.ndarray:
    """The configuration's sustainable rate in each of RESAMPLES resamples of its cells' requests (0: none)."""
    passes = np.zeros((len(own), RESAMPLES), dtype=bool)
    for i, row in enumerate(own):
        key = tuple(row[k] for k in CELL_KEYS)  # the cell's own key
        requests = by_cell.get(key)
        fixed_ok, _ = cell_sustains({**row, "slo_met": True, "goodput_rps": float("inf")}, share)
        if requests is None or requests.empty or not fixed_ok:  # invalid or saturated: in every resample
            continue
        rng = np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))
        picks = rng.integers(0, len(requests), (RESAMPLES, len(requests)))
        window_s = float(row.get("duration_s") or 0.0)
        if goals:
            met_all = slo.met_by_request(requests, goals)[picks]
            judged = np.ones(RESAMPLES, dtype=bool)
            for goal in goals:
                within = slo.met_by_request(requests, (goal,))[picks].sum(axis=1)
                judged &= within * 100 >= goal.percentile * len(requests)
            if any(not sampling.tail_allowed(len(requests), g.percentile / 100) for g in goals):
                judged[:] = False
        else:
            met_all = requests["error"].isna().to_numpy()[picks]
            judged = np.ones(RESAMPLES, dtype=bool)
        goodput = met_all.sum(axis=1) / window_s if window_s > 0 else np.zeros(RESAMPLES)
        passes[i] = judged & (goodput >= share * _scheduled(row))
    rates = np.array([float(r["offered_rate"]) for r in own])
    held = np.cumprod(passes, axis=0).sum(axis=0)  # the lowest rates passing, without a gap, per resample
    return np.where(held > 0, rates[np.maximum(held - 1, 0)], 0.0)
