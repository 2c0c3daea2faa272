"""What the gateway costs, from cells measured both ways (``route: both``): its added latency, and whether the
verdict through it differs.

Added latency of a figure at percentile q = q-th percentile through the gateway − q-th percentile direct, for
the same cell (same server, same workload; the phases alternate within the cell). Its 95% interval is a
bootstrap: both sides resampled independently (:data:`servegrid.stats.intervals.RESAMPLES` times, a seed per
cell), the difference of their percentiles taken each time. p99 is given only where both sides have the samples the tail
rule asks for (servegrid.stats.sampling.tail_allowed), as everywhere else in servegrid.

Figures: TTFT, e2e, and the per-token inter-token latency as each request's mean (TPOT = (e2e − TTFT) / (output
tokens − 1)): exact through a gateway that drops the per-chunk token count, where per-chunk ITL is not.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np
import pandas as pd

from servegrid.analysis import verdict
from servegrid.analysis.requests_table import CELL_KEYS, cell_key, with_window
from servegrid.analysis.summary_table import summarize
from servegrid.config import Experiment
from servegrid.records.cell_record import CellRecord
from servegrid.stats import intervals, sampling

FIGURES = ("ttft_s", "tpot_s", "e2e_s")
PERCENTILES = (50, 99)


def _valid(requests: pd.DataFrame) -> pd.DataFrame:
    return requests[(requests["phase"] == "measured") & requests["valid"]]


def _added(direct: np.ndarray, proxied: np.ndarray, q: int, rng: np.random.Generator) -> dict[str, float | None]:
    """The added q-th percentile and its 95% bootstrap interval (None where the samples are too few)."""
    if not (sampling.tail_allowed(direct.size, q / 100) and sampling.tail_allowed(proxied.size, q / 100)):
        return {"added": None, "low": None, "high": None}
    resampled = [
        np.percentile(rng.choice(side, (intervals.RESAMPLES, side.size)), q, axis=1) for side in (proxied, direct)
    ]
    differences = resampled[0] - resampled[1]
    tail = (1 - intervals.CONFIDENCE) / 2
    return {
        "added": float(np.percentile(proxied, q) - np.percentile(direct, q)),
        "low": float(np.quantile(differences, tail)),
        "high": float(np.quantile(differences, 1 - tail)),
    }


def added_latency(
    direct: pd.DataFrame, proxied: pd.DataFrame, checks: dict[tuple, dict[str, Any] | None]
) -> pd.DataFrame:
    """One row per cell measured both ways: each figure's p50 and p99 direct and through the gateway, what the
    gateway added (with its interval), the gateway it went through and what the gateway check found for that cell
    (``checks``: each cell file's ``gateway`` record, by cell key)."""
    direct, proxied = with_window(_valid(direct)), with_window(_valid(proxied))
    by_cell = dict(tuple(proxied.groupby(CELL_KEYS, sort=False))) if len(proxied) else {}
    rows = []
    for key, own in direct.groupby(CELL_KEYS, sort=False) if len(direct) else ():
        through = by_cell.get(key)
        if through is None:
            continue
        rng = np.random.default_rng(zlib.crc32(("gateway/" + "/".join(map(str, key))).encode()))
        row: dict[str, Any] = dict(zip(CELL_KEYS, key, strict=True))
        row["n_direct"], row["n_proxy"] = len(own), len(through)
        for figure in FIGURES:
            a = own[figure].to_numpy(dtype=float)
            b = through[figure].to_numpy(dtype=float)
            a, b = a[~np.isnan(a)], b[~np.isnan(b)]
            for q in PERCENTILES:
                name = figure.removesuffix("_s")
                row[f"{name}_p{q}_direct_s"] = intervals.percentiles(a, (q,))[f"p{q}"]
                row[f"{name}_p{q}_proxy_s"] = intervals.percentiles(b, (q,))[f"p{q}"]
                added = _added(a, b, q, rng)
                row[f"{name}_added_p{q}_s"] = added["added"]
                row[f"{name}_added_p{q}_ci_low_s"] = added["low"]
                row[f"{name}_added_p{q}_ci_high_s"] = added["high"]
        gateway = checks.get(key) or {}
        found, facts = gateway.get("check") or {}, gateway.get("facts") or {}
        row["gateway_version"] = facts.get("version")
        row["gateway_url"] = facts.get("url")
        row["gateway_started_by_servegrid"] = facts.get("started_by_servegrid")
        row["gateway_session"] = facts.get("session")
        row["gateway_model_list"] = json.dumps(facts.get("model_list"), sort_keys=True)  # secrets masked
        row["per_chunk_usage"] = found.get("per_chunk_usage")
        row["chunks_direct"] = found.get("chunks_direct")
        row["chunks_proxy"] = found.get("chunks_proxy")
        row["same_text"] = found.get("same_text")
        row["chunk_tokens_exact_share"] = float(through["chunk_tokens_exact"].fillna(True).astype(bool).mean())
        rows.append(row)
    return pd.DataFrame(rows)


def verdict_changes(direct: pd.DataFrame, proxied: pd.DataFrame) -> pd.DataFrame:
    """Per workload class: the verdict from the direct phases beside the one through the gateway (the
    classify() tables of both), and whether the gateway changes it (outcome or winner)."""
    if direct.empty or proxied.empty:
        return pd.DataFrame(
            columns=["class_id", "outcome_direct", "winner_direct", "outcome_proxy", "winner_proxy", "changed"]
        )
    both = direct[["class_id", "outcome", "winner"]].merge(
        proxied[["class_id", "outcome", "winner"]], on="class_id", suffixes=("_direct", "_proxy")
    )
    both["changed"] = (both["outcome_direct"] != both["outcome_proxy"]) | (
        both["winner_direct"].fillna("") != both["winner_proxy"].fillna("")
    )
    return both


def tables(
    experiment: Experiment,
    direct: pd.DataFrame,
    proxied: pd.DataFrame,
    metas: list[CellRecord],
    comparisons: pd.DataFrame,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The gateway's added latency and the verdict through it beside the direct one (empty unless cells went
    both ways). ``direct``/``proxied``: derived request rows of each route; ``metas``: every route's cell metas;
    ``comparisons``: the direct verdict's; the proxied cells are summarized as the direct ones are."""
    changes = verdict_changes(pd.DataFrame(), pd.DataFrame())
    if experiment.route != "both" or proxied.empty:
        return pd.DataFrame(), changes
    checks = {cell_key(m.spec): m.gateway for m in metas if m.route != "proxy"}
    added = added_latency(direct, proxied, checks)
    proxy_metas = [m for m in metas if m.route == "proxy"]
    proxy_summary = summarize(proxied, proxy_metas, experiment)
    proxy_comparisons = verdict.compare(
        proxy_summary, verdict.CellSamples(proxied, salt="proxy"), experiment.verdict.min_factor
    )
    changes = verdict_changes(
        verdict.classify(comparisons, experiment.verdict), verdict.classify(proxy_comparisons, experiment.verdict)
    )
    return added, changes
