"""Cell files → every table of a run (:class:`~servegrid.paths.RunTables`), each written whole or not at all.

The orchestration only: the per-request table (:mod:`~servegrid.analysis.requests_table`), the per-cell summary
(:mod:`~servegrid.analysis.summary_table`), the verdict, the objectives and the gateway's cost come from their
own modules; the servers table is made here.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from servegrid import atomic
from servegrid.analysis import gateway_cost, rate_verdict, slo, verdict
from servegrid.analysis.requests_table import closed_loop, load_cells
from servegrid.analysis.summary_table import summarize
from servegrid.config import Experiment
from servegrid.paths import RunTables
from servegrid.records.per_request import derive


def servers(metas: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per server session that measured at least one cell, or whose engine refused its cells
    (``refused``: the engine's reason; None for a server that measured)."""
    seen: dict[str, dict[str, Any]] = {}
    for meta in metas:
        facts = meta["server"]
        if facts["session"] in seen:
            seen[facts["session"]]["cells"] += 1
            continue
        host = facts.get("host") or {}
        seen[facts["session"]] = {
            "configuration": facts["configuration"],
            "session": facts["session"],
            "spec_hash": facts["spec_hash"],
            "engine_version": facts.get("engine_version"),
            "argv": list(facts["argv"]),
            "env": [f"{k}={v}" for k, v in sorted(facts["env"].items())],
            "kv_cache_tokens": facts.get("kv_cache_tokens"),
            "max_concurrency": facts.get("max_concurrency"),
            "max_model_len": facts.get("max_model_len"),
            "startup_s": facts.get("startup_s"),
            "started_at": facts.get("started_at"),
            "log_path": facts.get("log_path"),
            "host_cpu": host.get("cpu"),
            "host_cpu_count": host.get("cpu_count"),
            "host_memory_gib": host.get("memory_gib"),
            "host_os": host.get("os"),
            "host_gpus": "; ".join(f"{g['index']}: {g['name']} ({g['memory']})" for g in host.get("gpus") or []),
            "cpus": list(facts.get("cpus") or []),
            "cells": 1,
            "refused": meta.get("refused"),
        }
    return pd.DataFrame(list(seen.values()))


def refused_configurations(servers: pd.DataFrame) -> dict[str, str]:
    """Configuration → the engine's reason, for those whose every server session refused its cells (the servers
    table's ``refused``); one that measured on some server is not refused."""
    if servers.empty or "refused" not in servers:
        return {}
    out = {}
    for name, sessions in servers.groupby("configuration", sort=False):
        reasons = sessions["refused"].dropna()
        if len(reasons) == len(sessions):
            out[str(name)] = str(reasons.iloc[-1])
    return out


def aggregate(experiment: Experiment, cell_paths: list[str], tables: RunTables) -> pd.DataFrame:
    """Every table of ``tables`` from the cell files (each written whole, or not at all); returns the summary."""
    everything, read_metas = load_cells(cell_paths)
    # A refused cell (its engine died at its first request) has no request: the servers table names its
    # reason; every other table is made of the measured cells, so the verdict proceeds with the others.
    refused = [m for m in read_metas if m.get("refused")]
    all_metas = [m for m in read_metas if not m.get("refused")]
    derived_all = derive(everything) if all_metas else everything  # cell files without a row still have every column
    # The verdict's route (direct, unless every cell goes through the gateway); the other route, where cells were
    # measured both ways, is only compared with it (servegrid.analysis.gateway_cost).
    verdict_route = experiment.routes()[0]
    routes = derived_all["route"] if "route" in derived_all else pd.Series("direct", index=derived_all.index)
    derived = derived_all[routes == verdict_route]
    metas = [m for m in all_metas if m.get("route", "direct") == verdict_route]
    summary = summarize(derived, metas, experiment)
    # The verdict, its crossovers and the production table compare closed-loop cells (sessions); open-loop cells
    # (rates) are in the summary beside them.
    closed = closed_loop(summary)
    samples = verdict.CellSamples(closed_loop(derived))  # keyed by sessions: open-loop rows would share a key
    comparisons = verdict.compare(closed, samples, experiment.verdict.min_factor)
    rules, order = experiment.verdict, list(experiment.configurations)
    added, changes = gateway_cost.tables(experiment, derived, derived_all[routes == "proxy"], all_metas, comparisons)
    outputs = [
        (derived, tables.requests),
        (summary, tables.summary),
        (servers(metas + refused), tables.servers),
        (comparisons, tables.comparisons),
        (verdict.classify(comparisons, rules), tables.verdict),
        (verdict.crossovers(verdict.duels(closed, samples, order), order, rules), tables.crossovers),
        (slo.production(closed, order, list(experiment.slo), rules.min_factor), tables.production),
        (added, tables.gateway),
        (changes, tables.gateway_verdict),
        (
            rate_verdict.rate_table(summary, derived, order, experiment.slo, rules.goodput_share, rules.min_factor),
            tables.rates,
        ),
    ]
    for frame, out in outputs:
        with atomic.atomic_path(out) as tmp:
            frame.to_parquet(tmp, index=False)
    return summary
