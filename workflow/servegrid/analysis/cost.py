"""What a configuration's tokens cost at the highest load it sustains within the objectives (issue 43): its devices'
hourly price over the tokens it served per hour there, plus, where its GPUs reported their energy, the energy's price
per token. Priced per million tokens, prompt and output together and output alone, in the ``cost:`` section's currency.

The figures come from the production table's sustained cell (servegrid.analysis.slo.production): its throughput is the
server's work at that load, so a configuration that sustains more sessions spreads the same hourly price over more
tokens.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from servegrid.config import Experiment

COST_COLUMNS = [
    "devices",
    "input_tps",
    "output_tps",
    "joules_per_token",
    "cost_per_million_tokens",
    "cost_per_million_output_tokens",
    "currency",
]
JOULES_PER_KWH = 3.6e6


def devices(experiment: Experiment, configuration: str) -> int:
    """The devices an hour of the configuration pays for: its GPUs, or its host as one where it has none."""
    return max(1, len(experiment.configurations[configuration].gpus))


def price(production: pd.DataFrame, summary: pd.DataFrame, experiment: Experiment) -> pd.DataFrame:
    """``production`` with :data:`COST_COLUMNS`: the sustained cell's throughput, and with a ``cost:`` section its
    price per million tokens (None where nothing is sustained, or the run is not priced)."""
    out = production.copy()
    rows = [_priced(row, summary, experiment) for row in production.to_dict("records")]
    for column in COST_COLUMNS:
        out[column] = [r[column] for r in rows] if rows else pd.Series(dtype=object)
    return out


def rerank(priced: pd.DataFrame, min_factor: float) -> pd.DataFrame:
    """The production winners by price (``cost.rank_by: cost``): per mode and context, the configuration whose million
    tokens cost least at the load it sustains; prices within ``min_factor`` of the lowest are a tie, each a winner. A
    configuration that sustains nothing has no price and never wins."""
    out = priced.copy()
    if out.empty:
        return out
    out["winner"] = False
    for _, group in out.groupby(["mode", "context"]):
        prices = group["cost_per_million_tokens"].dropna().astype(float)
        if prices.empty:
            continue
        lowest = prices.min()
        out.loc[prices[prices <= lowest * min_factor].index, "winner"] = True
    return out


def _priced(row: dict[str, Any], summary: pd.DataFrame, experiment: Experiment) -> dict[str, Any]:
    none: dict[str, Any] = dict.fromkeys(COST_COLUMNS)
    sustained = row.get("sustained_concurrency")
    if sustained is None or pd.isna(sustained):
        return none
    at = summary[
        (summary["mode"] == row["mode"])
        & (summary["context"] == row["context"])
        & (summary["configuration"] == row["configuration"])
        & (summary["concurrency"] == sustained)
    ]
    if at.empty:
        return none
    cell = at.iloc[0]
    input_tps, output_tps = _number(cell.get("input_tps_total")), _number(cell.get("output_tps_total"))
    joules = _number(cell.get("joules_per_token"))
    out = none | {
        "devices": devices(experiment, row["configuration"]),
        "input_tps": input_tps,
        "output_tps": output_tps,
        "joules_per_token": joules,
    }
    cost = experiment.cost
    if cost is None or not output_tps:
        return out
    hourly = out["devices"] * cost.device_per_hour
    tokens_per_hour = ((input_tps or 0.0) + output_tps) * 3600

    def energy(joules_each: float | None) -> float:  # the energy's price per token, where the GPUs reported it
        return cost.energy_per_kwh * joules_each / JOULES_PER_KWH if cost.energy_per_kwh and joules_each else 0.0

    return out | {
        "cost_per_million_tokens": (hourly / tokens_per_hour + energy(joules)) * 1e6,
        "cost_per_million_output_tokens": (
            hourly / (output_tps * 3600) + energy(_number(cell.get("joules_per_output_token")))
        )
        * 1e6,
        "currency": cost.currency,
    }


def _number(value: Any) -> float | None:
    return None if value is None or pd.isna(value) else float(value)


def spent(summary: pd.DataFrame, experiment: Experiment) -> pd.DataFrame:
    """Device hours the run's cells took, per configuration and mode: each cell job's wall clock (its server's start
    included where it started one) × the configuration's devices; with a ``cost:`` section, their price."""
    columns = ["configuration", "mode", "cells", "top_ups", "measuring_s", "device_hours", "cost", "currency"]
    if summary.empty or "cell_wall_s" not in summary:
        return pd.DataFrame(columns=columns)
    rows = []
    for (configuration, mode), cells in summary.groupby(["configuration", "mode"], sort=False):
        known = configuration in experiment.configurations
        hours = cells["cell_wall_s"].astype(float).sum() / 3600 * (devices(experiment, configuration) if known else 1)
        price = experiment.cost
        rows.append(
            {
                "configuration": configuration,
                "mode": mode,
                "cells": len(cells),
                # Sampling that serves the verdict: the top-ups pooled into these cells (their time is in the hours).
                "top_ups": int(cells["top_ups"].fillna(0).sum()) if "top_ups" in cells else 0,
                "measuring_s": float(cells["duration_s"].astype(float).sum()),
                "device_hours": float(hours),
                "cost": float(hours * price.device_per_hour) if price else None,
                "currency": price.currency if price else None,
            }
        )
    return pd.DataFrame(rows, columns=columns)
