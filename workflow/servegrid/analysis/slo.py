"""Service-level objectives: which requests meet them, whether a cell does, and the production table.

An objective is a percentile limit on one per-request latency, written as the config writes it
(``tpot_p90_ms: 50``: the 90th percentile of TPOT at most 50 ms). A request *meets* the objectives
when every one of its latencies is within its limit (a failed request meets none); a cell *meets* them
when, for each objective, at least its percentile's share of the cell's measured requests is within
its limit (``p90``: 90% of them): the percentile in the inverted-CDF sense. It is not judged (None) from
fewer requests than the percentile needs (servegrid.stats.sampling.MIN_SAMPLES_FOR: p90 30, p99 300). (The
summary's ``*_p90`` columns interpolate linearly between requests, so they can lie above a limit that
the cell meets by this rule.) Goodput is the requests that
met every objective per second of the measured phase, as AIPerf and inference-perf define it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from servegrid.config.sections import Objective
from servegrid.stats import sampling

COLUMNS = {
    "ttft": "ttft_s",
    "tpot": "tpot_s",
    "e2e": "e2e_s",
}  # the per-request figures (servegrid.analysis.aggregation)


def met_by_request(requests: pd.DataFrame, goals: tuple[Objective, ...]) -> np.ndarray:
    """Per measured request: within every objective's limit (an error, or a missing figure, is not)."""
    ok: np.ndarray = requests["error"].isna().to_numpy().copy()  # a view of the frame may be read-only
    for goal in goals:
        values = requests[COLUMNS[goal.metric]].to_numpy(dtype=float)
        ok &= ~np.isnan(values) & (values <= goal.limit_s)
    return ok


def cell_columns(requests: pd.DataFrame, goals: tuple[Objective, ...], duration_s: float | None) -> dict[str, Any]:
    """The summary's SLO columns of one cell from its measured requests (all of them, failed ones too)."""
    empty = {
        "slo_met": None,
        "slo_attainment": None,
        "slo_attainment_ci_low": None,
        "slo_attainment_ci_high": None,
        "goodput_rps": None,
    }
    if not goals or requests.empty:
        return empty
    met = met_by_request(requests, goals)
    n, k = len(met), int(met.sum())
    interval = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    # Each objective holds when at least its percentile's share of the requests is within its limit (p90: 90% of
    # them): the percentile in the inverted-CDF sense, never interpolated across a failed request.
    cell_met: bool | None = all(
        int(met_by_request(requests, (goal,)).sum()) * 100 >= goal.percentile * n for goal in goals
    )
    # Judged only from enough requests for each percentile (servegrid.stats.sampling: p90 from 30, p99 from 300):
    # with fewer, a cell could not miss a p99 objective by one slow request in a hundred.
    if any(not sampling.tail_allowed(n, goal.percentile / 100) for goal in goals):
        cell_met = None
    return {
        "slo_met": cell_met,
        "slo_attainment": k / n,
        "slo_attainment_ci_low": float(interval.low),
        "slo_attainment_ci_high": float(interval.high),
        "goodput_rps": k / duration_s if duration_s and duration_s > 0 and not math.isnan(duration_s) else None,
    }


PRODUCTION_COLUMNS = [
    "mode",
    "context",
    "configuration",
    "sustained_concurrency",
    "stopped_by",
    "measured",
    "met",
    "non_monotone",
    "goodput_rps",
    "winner",
]


def production(
    summary: pd.DataFrame, order: list[str], modes_with_slo: list[str], min_factor: float = 1.05
) -> pd.DataFrame:
    """Per mode with objectives, context and configuration: the highest concurrency it sustains within
    them (every measured concurrency up to it meets them, valid cells only; None: nowhere), and per
    mode and context the winner: the highest sustained concurrency, then the higher goodput there.
    Goodputs within ``min_factor`` of the best (verdict.min_factor) are a tie: each is marked a winner."""
    rows: list[dict[str, Any]] = []
    if summary.empty:
        return pd.DataFrame(rows, columns=PRODUCTION_COLUMNS)
    for mode in modes_with_slo:
        cells = summary[summary["mode"] == mode]
        for context in sorted(cells["context"].unique()):
            at_context = cells[cells["context"] == context]
            group = [
                _sustained(mode, int(context), name, at_context[at_context["configuration"] == name])
                for name in order
                if (at_context["configuration"] == name).any()
            ]
            contenders = [r for r in group if r["sustained_concurrency"] is not None]
            if contenders:
                most = max(r["sustained_concurrency"] for r in contenders)
                top = [r for r in contenders if r["sustained_concurrency"] == most]
                best = max(r["goodput_rps"] or 0.0 for r in top)
                for r in top:
                    r["winner"] = (r["goodput_rps"] or 0.0) * min_factor >= best
            rows += group
    return pd.DataFrame(rows, columns=PRODUCTION_COLUMNS)


def _sustained(mode: str, context: int, name: str, cells: pd.DataFrame) -> dict[str, Any]:
    cells = cells.sort_values("concurrency")
    levels = [int(c) for c in cells["concurrency"]]
    records = cells.to_dict("records")
    valid = [bool(r["valid"]) for r in records]
    meets = [ok and r["slo_met"] is True for ok, r in zip(valid, records, strict=True)]
    held = 0  # how many of the lowest levels meet the objectives, without a gap
    while held < len(meets) and meets[held]:
        held += 1
    # What ends the run of levels: a cell that fails the objectives, or one that cannot be judged (invalid,
    # or too few requests for the objectives' percentiles).
    stopped_by = None
    if held < len(meets):
        stopped_by = "invalid" if not valid[held] else "too_few" if records[held]["slo_met"] is None else "objectives"
    sustained = levels[held - 1] if held else None
    goodput = cells["goodput_rps"].iloc[held - 1] if held else None
    return {
        "mode": mode,
        "context": context,
        "configuration": name,
        "sustained_concurrency": sustained,
        "stopped_by": stopped_by,
        "measured": ",".join(map(str, levels)),
        "met": ",".join(str(level) for level, ok in zip(levels, meets, strict=True) if ok),
        # It meets them again above a level where it failed: noise, or a regime worth a look.
        "non_monotone": stopped_by == "objectives" and any(meets[held + 1 :]),
        "goodput_rps": None if goodput is None or pd.isna(goodput) else float(goodput),
        "winner": False,
    }
