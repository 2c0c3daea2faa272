"""Who wins each cell group, and by how much, computed from the data.

A cell group is one mode × context × concurrency measured on several
configurations. The winner is the configuration with the best primary figure
(p50); the factor is how many times better it is than the runner-up (always
≥ 1). The 95% interval of that factor comes from bootstrapping both
configurations' requests; when it includes 1 the group is a tie. When either
cell ran into the KV-cache capacity the group is "neither — KV limit": the
figure then measures the pool, not the configuration.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from servegrid import modes, stats
from servegrid.config import ClassRule, VerdictRules

__all__ = ["ClassRule", "VerdictRules", "classify", "compare", "crossovers", "decisive", "primary_values"]

GROUP_KEYS = ["mode", "context", "concurrency"]


def primary_values(requests: pd.DataFrame, configuration: str, mode: str, context: int, concurrency: int) -> np.ndarray:
    primary = modes.get(mode).primary
    rows = requests[
        (requests["configuration"] == configuration)
        & (requests["mode"] == mode)
        & (requests["context"] == context)
        & (requests["concurrency"] == concurrency)
        & (requests["phase"] == "measured")
        & requests["valid"]
    ]
    if primary.turn is not None:
        rows = rows[rows["turn"] == primary.turn]
    return rows[primary.column].to_numpy(dtype=float)


def compare(summary: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """One row per cell group with at least two valid configurations."""
    rows = []
    if summary.empty:
        return pd.DataFrame()
    for (mode, context, concurrency), group in summary.groupby(GROUP_KEYS, sort=False):
        candidates = group[group["valid"] & group["primary_p50"].notna()]
        if len(candidates) < 2:
            continue
        higher = bool(modes.get(mode).primary.higher_is_better)
        ranked = candidates.sort_values("primary_p50", ascending=not higher)
        best, runner_up = ranked.iloc[0], ranked.iloc[1]
        best_values = primary_values(requests, best["configuration"], mode, context, concurrency)
        other_values = primary_values(requests, runner_up["configuration"], mode, context, concurrency)
        if higher:
            factor = best["primary_p50"] / runner_up["primary_p50"]
            low, high = stats.ratio_of_medians_ci(best_values, other_values)
        else:
            factor = runner_up["primary_p50"] / best["primary_p50"]
            low, high = stats.ratio_of_medians_ci(other_values, best_values)
        rows.append(
            {
                "mode": mode,
                "context": int(context),
                "concurrency": int(concurrency),
                "metric": best["primary_metric"],
                "winner": best["configuration"],
                "winner_p50": float(best["primary_p50"]),
                "runner_up": runner_up["configuration"],
                "runner_up_p50": float(runner_up["primary_p50"]),
                "factor": float(factor),
                "factor_ci_low": low,
                "factor_ci_high": high,
                "tie": bool(low is not None and low <= 1.0),
                "kv_limited": bool(best["kv_limited"] or runner_up["kv_limited"]),
            }
        )
    return pd.DataFrame(rows)


# ---- the verdict engine: workload classes, each with a winner and a range --------------------


def decisive(group: dict[str, Any], rules: VerdictRules) -> bool:
    """A group that names a winner: not KV-limited, not a tie, and won by at least min_factor."""
    return not group["kv_limited"] and not group["tie"] and group["factor"] >= rules.min_factor


def classify(comparisons: pd.DataFrame, rules: VerdictRules, roles: dict[str, str]) -> pd.DataFrame:
    """One row per workload class: its outcome, winner and the range of factors it won by.

    Each group goes to the first class whose rule matches it. Outcomes:
    ``win`` (one configuration wins every decisive group), ``mixed`` (it wins
    most of them), ``tie`` (no decisive group), ``kv_limit`` (every group hit
    the KV capacity: neither wins), ``no_data``.
    """
    groups = comparisons.to_dict("records") if len(comparisons) else []
    assigned: dict[str, list[dict[str, Any]]] = {rule.id: [] for rule in rules.classes}
    for group in groups:
        for rule in rules.classes:
            if rule.matches(group):
                assigned[rule.id].append(group)
                break
    rows = []
    for rule in rules.classes:
        members = assigned[rule.id]
        row: dict[str, Any] = {
            "class_id": rule.id,
            "modes": ",".join(sorted({g["mode"] for g in members})),
            "n_groups": len(members),
            "n_decisive": 0,
            "outcome": "no_data",
            "winner": None,
            "winner_role": None,
            "wins": 0,
            "factor_min": None,
            "factor_max": None,
            "factor_min_ci_low": None,
            "factor_max_ci_high": None,
            "range_style": None,
            "min_context": min((g["context"] for g in members), default=None),
            "min_concurrency": min((g["concurrency"] for g in members), default=None),
        }
        wins = [g for g in members if decisive(g, rules)]
        row["n_decisive"] = len(wins)
        if members and all(g["kv_limited"] for g in members):
            row["outcome"] = "kv_limit"
        elif members and not wins:
            row["outcome"] = "tie"
        elif wins:
            counts: dict[str, int] = {}
            for g in wins:
                counts[g["winner"]] = counts.get(g["winner"], 0) + 1
            winner = max(counts, key=lambda name: (counts[name], -list(counts).index(name)))
            won = [g for g in wins if g["winner"] == winner]
            lowest = min(won, key=lambda g: g["factor"])
            highest = max(won, key=lambda g: g["factor"])
            row.update(
                outcome="win" if counts[winner] == len(wins) else "mixed",
                winner=winner,
                winner_role=roles.get(winner, "other"),
                wins=counts[winner],
                factor_min=float(lowest["factor"]),
                factor_max=float(highest["factor"]),
                factor_min_ci_low=_none_if_nan(lowest.get("factor_ci_low")),
                factor_max_ci_high=_none_if_nan(highest.get("factor_ci_high")),
                range_style="up_to" if highest["factor"] / lowest["factor"] > rules.range_style_ratio else "range",
            )
        rows.append(row)
    return pd.DataFrame(rows)


def crossovers(comparisons: pd.DataFrame, roles: dict[str, str], rules: VerdictRules) -> pd.DataFrame:
    """Per mode: the smallest context × concurrency at which the caching configuration beats
    the speculative one (by work asked for: context × concurrency), or none in this grid."""
    caching = [name for name, role in roles.items() if role == "caching"]
    speculative = [name for name, role in roles.items() if role == "speculative"]
    rows = []
    if not caching or not speculative or comparisons.empty:
        return pd.DataFrame(rows, columns=["mode", "found", "context", "concurrency", "factor", "groups"])
    for mode, groups in comparisons.groupby("mode", sort=False):
        pairs = groups[groups["winner"].isin(caching + speculative) & groups["runner_up"].isin(caching + speculative)]
        overtaken = [
            g
            for g in pairs.to_dict("records")
            if g["winner"] in caching and g["runner_up"] in speculative and decisive(g, rules)
        ]
        first = min(overtaken, key=lambda g: (g["context"] * g["concurrency"], g["context"]), default=None)
        rows.append(
            {
                "mode": mode,
                "found": first is not None,
                "context": first["context"] if first else None,
                "concurrency": first["concurrency"] if first else None,
                "factor": first["factor"] if first else None,
                "groups": len(pairs),
            }
        )
    return pd.DataFrame(rows)


def _none_if_nan(value: Any) -> float | None:
    return None if stats.missing(value) else float(value)
