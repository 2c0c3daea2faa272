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

import numpy as np
import pandas as pd

from servegrid import stats
from servegrid.aggregate import CELL_KEYS, PRIMARY

GROUP_KEYS = ["mode", "context", "concurrency"]


def primary_values(requests: pd.DataFrame, configuration: str, mode: str, context: int, concurrency: int) -> np.ndarray:
    primary = PRIMARY[mode]
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
        higher = bool(PRIMARY[mode].higher_is_better)
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
                "winner_label": best["label"],
                "winner_p50": float(best["primary_p50"]),
                "runner_up": runner_up["configuration"],
                "runner_up_label": runner_up["label"],
                "runner_up_p50": float(runner_up["primary_p50"]),
                "factor": float(factor),
                "factor_ci_low": low,
                "factor_ci_high": high,
                "tie": bool(low is not None and low <= 1.0),
                "kv_limited": bool(best["kv_limited"] or runner_up["kv_limited"]),
            }
        )
    return pd.DataFrame(rows)


__all__ = ["CELL_KEYS", "GROUP_KEYS", "compare", "primary_values"]
