"""Cell files → every table of a run (:class:`~servegrid.paths.RunTables`), each written whole or not at all.

The orchestration only: the per-request table (:mod:`~servegrid.analysis.requests_table`), the per-cell summary
(:mod:`~servegrid.analysis.summary_table`), the verdict, the objectives and the gateway's cost come from their
own modules; the servers table is made here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from servegrid import atomic
from servegrid.analysis import cost, gateway_cost, rate_verdict, slo, top_ups, verdict
from servegrid.analysis.measured_run import measured_run
from servegrid.analysis.requests_table import closed_loop
from servegrid.config import Experiment
from servegrid.paths import RunTables
from servegrid.records import table_format
from servegrid.records.cell_record import CellRecord


def servers(metas: list[CellRecord]) -> pd.DataFrame:
    """One row per server session that measured at least one cell, or whose engine refused its cells
    (``refused``: the engine's reason; None for a server that measured)."""
    seen: dict[str, dict[str, Any]] = {}
    # A cell's top-ups may have run on other sessions of its server (sampling that serves the verdict): each counts.
    sessions = [(meta, meta.server) for meta in metas]
    sessions += [(meta, top["server"]) for meta in metas for top in meta.top_ups if top.get("server")]
    for meta, facts in sessions:
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
            "kv_group_block_sizes": list(facts.get("kv_group_block_sizes") or []),
            "hits_judged": facts.get("hits_judged", True),
            "cells": 1,
            "refused": meta.refused,
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


def aggregate(
    experiment: Experiment,
    cell_paths: list[str],
    tables: RunTables,
    top_up_files: Sequence[str] = (),
    decisions: str | None = None,
) -> pd.DataFrame:
    """Every table of ``tables`` from the cell files and their top-ups (each written whole, or not at all); returns
    the summary. ``decisions``: the last round's decisions of sampling that serves the verdict, which say per group
    how its sampling stopped."""
    run = measured_run(experiment, cell_paths, top_up_files)
    derived_all, derived, metas, all_metas = run.derived_all, run.derived, run.metas, run.all_metas
    refused = run.refused
    routes = derived_all["route"] if "route" in derived_all else pd.Series("direct", index=derived_all.index)
    summary = run.summary
    # The verdict, its crossovers and the production table compare closed-loop cells (sessions); open-loop cells
    # (rates) are in the summary beside them.
    closed = closed_loop(summary)
    samples = verdict.CellSamples(closed_loop(derived))  # keyed by sessions: open-loop rows would share a key
    comparisons = verdict.compare(closed, samples, experiment.verdict.min_factor)
    if decisions is not None:
        comparisons = top_ups.with_how_sampling_stopped(comparisons, top_ups.read_decisions(decisions))
    rules, order = experiment.verdict, list(experiment.configurations)
    production = cost.price(slo.production(closed, order, list(experiment.slo), rules.min_factor), closed, experiment)
    if experiment.cost is not None and experiment.cost.rank_by == "cost":
        production = cost.rerank(production, rules.min_factor)
    added, changes = gateway_cost.tables(experiment, derived, derived_all[routes == "proxy"], all_metas, comparisons)
    outputs = [
        (derived, tables.requests),
        (summary, tables.summary),
        (servers(metas + refused), tables.servers),
        (comparisons, tables.comparisons),
        (verdict.classify(comparisons, rules), tables.verdict),
        (verdict.crossovers(verdict.duels(closed, samples, order), order, rules), tables.crossovers),
        (production, tables.production),
        (added, tables.gateway),
        (changes, tables.gateway_verdict),
        (
            rate_verdict.rate_table(summary, derived, order, experiment.slo, rules.goodput_share, rules.min_factor),
            tables.rates,
        ),
    ]
    for frame, out in outputs:
        with atomic.atomic_path(out) as tmp:
            table_format.write(frame, tmp)
    return summary
