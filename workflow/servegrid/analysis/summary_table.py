"""The per-cell summary: one row per cell of the per-request table, its columns computed in one function.

Each cell's primary figure (its mode's :class:`~servegrid.modes.primary.Primary`) with its interval, the
per-request figures' percentiles (:mod:`servegrid.records.per_request`), what the server's counters say
(prefix-cache hits, KV use, preemptions), the objectives (:mod:`servegrid.analysis.slo`) and the checks that
make a cell invalid or KV-limited.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from servegrid import modes
from servegrid.analysis import slo
from servegrid.analysis.cell_rows import HOOK_COLUMNS, CellRows
from servegrid.analysis.load_columns import load_columns
from servegrid.analysis.requests_table import CELL_KEYS, cell_key, cell_value
from servegrid.config import Experiment, Validity
from servegrid.engines import metrics
from servegrid.engines.base import PrefixCache
from servegrid.records.per_request import PER_REQUEST, per_token_itl
from servegrid.stats import correlated, intervals, sampling


def _cell_summary(cell_rows: CellRows, meta: dict[str, Any], experiment: Experiment) -> dict[str, Any]:
    cell = meta["cell"]
    mode = modes.get(cell["mode"])
    rows, measured, valid = cell_rows, cell_rows.measured, cell_rows.valid
    n_valid = int(valid.sum())
    primary = mode.primary
    # Labels are presentation (the figures' and the report's, from the config): no label in the tables.
    conf = experiment.configurations.get(cell["configuration"])
    server = meta["server"]
    tokens_ok = rows["prompt_tokens_ok"] & rows["output_tokens_ok"]
    row: dict[str, Any] = {
        **{k: cell_value(cell, k) for k in CELL_KEYS},
        "cell_id": cell["id"],
        "prefix_caching": conf.prefix_caching if conf else None,
        "speculative_method": (conf.speculative or {}).get("method") if conf else None,
        "n_requests": int(measured.sum()),
        "n_valid": n_valid,
        "n_errors": int((measured & ~rows.ok).sum()),
        "n_token_mismatch": int((measured & rows.ok & ~tokens_ok).sum()),
        # A failed warm-up or probe: a shared prefix may never have been primed, a probe figure is missing. (Not an
        # open-loop cell's ramp or drain: those are load, and the drain's last requests are cancelled on purpose.)
        "n_unmeasured_errors": int((rows.priming & ~rows.ok).sum()),
        "duration_s": meta.get("duration_s"),
        "primary_metric": primary.metric,
        "primary_higher_is_better": primary.higher_is_better,
    }
    measured_frame = rows.frame(measured, HOOK_COLUMNS)
    values = rows.floats(primary.column, rows.primary)
    row["primary_n"] = int(np.count_nonzero(~np.isnan(values)))  # the samples, as sequential sampling counts them
    row.update(slo.cell_columns(measured_frame, experiment.slo.get(cell["mode"], ()), meta.get("duration_s")))
    row["primary_p50"] = intervals.percentiles(values)["p50"]
    # An open-loop cell's requests queue behind each other, so neighbours are alike: its medians' intervals are
    # batch medians over the requests in arrival order (servegrid.stats.correlated), not the independent-sample one.
    open_loop = bool(cell.get("rate"))
    median_interval = correlated.batch_median_interval if open_loop else intervals.median_interval
    row["primary_ci_low"], row["primary_ci_high"] = median_interval(values)
    n_effective = correlated.effective_samples(values) if open_loop else None
    row["primary_n_effective"] = n_effective
    row["primary_correlated"] = (
        None if n_effective is None else correlated.strongly_correlated(row["primary_n"], n_effective)
    )
    row.update(sampling_columns(meta, row))
    repeats = rows["repeat"][rows.primary]
    by_repeat = [  # a diagnostic of drift between repeats: from any number of samples
        intervals.percentiles(values[repeats == r], (50,), enough_only=False)["p50"] for r in np.unique(repeats)
    ]
    by_repeat = [v for v in by_repeat if v is not None]
    row["n_repeats"] = len(np.unique(rows["repeat"][measured]))
    row["primary_p50_repeat_min"] = min(by_repeat) if by_repeat else None
    row["primary_p50_repeat_max"] = max(by_repeat) if by_repeat else None
    for column in PER_REQUEST:
        values = rows.floats(column, valid)
        for name, value in intervals.percentiles(values).items():
            row[f"{column}_{name}"] = value
        if column in ("ttft_s", "tpot_s", "e2e_s", "decode_tps"):
            row[f"{column}_p50_ci_low"], row[f"{column}_p50_ci_high"] = median_interval(values)
    times, tokens = rows["chunk_times_s"][valid], rows["chunk_tokens"][valid]
    itl = [per_token_itl(t, k) for t, k in zip(times, tokens, strict=True)]
    gaps = [np.diff(np.asarray(t, dtype=float)) for t in times if len(t) > 1]
    for prefix, parts in (("itl_token_s", itl), ("chunk_gap_s", gaps)):
        flat = np.concatenate(parts) if parts else np.empty(0)
        # Gaps within one request are not independent samples: the tail rule counts requests here.
        for name, value in intervals.percentiles(flat, enough_only=False).items():
            allowed = sampling.tail_allowed(n_valid, int(name[1:]) / 100)
            row[f"{prefix}_{name}"] = value if allowed else None
    per_chunk = rows.floats("tokens_per_chunk", valid)
    per_chunk = per_chunk[~np.isnan(per_chunk)]
    row["tokens_per_chunk_mean"] = (float(per_chunk.mean()) if per_chunk.size else float("nan")) if n_valid else None
    # Per second of the measured phase (its stages, without the pauses between them, and every repeat).
    active_s = meta.get("duration_s")
    output_tokens = rows.floats("output_tokens_reported", valid).sum()
    row["output_tps_total"] = float(output_tokens / active_s) if n_valid and active_s and active_s > 0 else None
    per_arrival = mode.requests_per_arrival(meta["settings"]["workload"])
    row.update(
        load_columns(cell, meta.get("open_loop"), n_valid, active_s, meta["settings"].get("arrival"), per_arrival)
    )
    row["speedup"] = meta["settings"].get("speedup")  # a replayed trace's (None for every other cell)
    # Every mode's own columns in every row, so the table has one schema: None where not applicable.
    row.update(dict.fromkeys(c for m in modes.registered() for c in m.summary_columns))
    if mode.summarize is not None:
        everything = np.ones(len(rows.positions), dtype=bool)
        row.update(mode.extra_columns(rows.frame(valid, HOOK_COLUMNS), rows.frame(everything, HOOK_COLUMNS)))
    server_metrics = meta["server_metrics"]
    row.update({f"server_{k}": v for k, v in server_metrics["derived"].items()})
    row["server_preemptions"] = server_metrics["delta"].get("num_preemptions")
    # vLLM times the same requests itself (from their arrival in the server to its first token out, and
    # per output token): what the client's mean adds to the server's, where both counted the same requests.
    for figure, column in (("ttft", "ttft_s"), ("tpot", "tpot_s")):
        timed = rows.floats(column, measured)
        timed = timed[~np.isnan(timed)]
        counted = server_metrics["delta"].get(f"{metrics.SERVER_TIMING[figure]}_count")
        server_mean = row.setdefault(f"server_{figure}_mean_s", None)  # cell files older than the figure lack it
        same_requests = server_mean is not None and counted == len(timed) > 0
        row[f"{figure}_mean_minus_server_s"] = float(timed.mean() - server_mean) if same_requests else None
    gauges = server_metrics["gauges"]
    for gauge in metrics.GAUGES:
        for stat in ("max", "mean"):
            row[f"server_{gauge}_{stat}"] = gauges.get(f"{gauge}_{stat}")
    row["engine_version"] = server.get("engine_version")
    row["kv_cache_tokens"] = server.get("kv_cache_tokens")
    row["block_size"] = server.get("block_size")
    row["cache_mode"] = server.get("cache_mode")
    # Cell files from before the server said how it reuses blocks: every matched block (the rule until then).
    prefix_cache = PrefixCache(
        block=row["block_size"] or 1,
        dropped=server.get("hit_blocks_dropped") or 0,
        sightings=server.get("prefix_sightings") or 1,
    )
    row["server_session"] = server.get("session")
    row["spec_hash"] = meta["spec_hash"]
    row["started_at"] = meta["started_at"]
    row["cache_state"] = meta.get("cache_state")
    row["expected_hit_rate"] = mode.expected_hit_rate(
        bool(row["prefix_caching"]), meta["settings"], measured_frame, prefix_cache
    )
    validity = experiment.validity
    row["peak_tokens_asked"] = peak_tokens_asked(measured_frame, cell["concurrency"], prefix_cache)
    row["kv_limited"] = kv_limited(row, cell["concurrency"])
    # A cell past the KV capacity evicts cached blocks to make room: fewer hits than its mode expects are
    # that regime (the seed's "pinned cache blocks"), not a cell that measured something else.
    row["cache_contradiction"] = cache_contradicts(
        row["expected_hit_rate"], row["server_prefix_cache_hit_rate"], validity
    ) and not (row["kv_limited"] and (row["server_prefix_cache_hit_rate"] or 0.0) < row["expected_hit_rate"])
    client = meta.get("client") or {}
    row["client_loop_lag_p99_s"] = client.get("loop_lag_p99_s")
    row["client_loop_lag_max_s"] = client.get("loop_lag_max_s")
    row["client_cpu_fraction"] = client.get("cpu_fraction")
    row["client_cpus"] = ",".join(str(c) for c in client.get("cpus") or [])
    # A check, not a figure: judged on the raw p99 from any number of requests (the reported column is only
    # filled from 300 on), since a few late sends already mean the client did not keep its schedule.
    send_delay = intervals.percentiles(rows.floats("send_delay_s", valid), (99,), enough_only=False)["p99"]
    row["sends_slipped"] = bool((send_delay or 0) > validity.max_send_delay_s)
    row["client_bottleneck"] = bool(
        (row["client_loop_lag_p99_s"] or 0) > validity.max_loop_lag_s
        or (row["client_cpu_fraction"] or 0) >= validity.max_client_cpu
    )
    reasons = []
    if row["n_requests"] == 0:
        reasons.append("no measured requests")
    if row["n_errors"]:
        reasons.append(f"{row['n_errors']} failed requests")
    if row["n_token_mismatch"]:
        reasons.append(f"{row['n_token_mismatch']} token-count mismatches")
    if row["n_unmeasured_errors"]:
        reasons.append(f"{row['n_unmeasured_errors']} warm-up or probe requests failed")
    if row["cache_contradiction"]:
        reasons.append(
            f"prefix-cache hit rate {row['server_prefix_cache_hit_rate'] or 0:.2f} "
            f"contradicts the expected {row['expected_hit_rate']:.2f}"
        )
    if row["sends_slipped"]:
        reasons.append(
            f"sends slipped: p99 {(send_delay or 0) * 1e3:.1f} ms after they were due "
            f"(limit {validity.max_send_delay_s * 1e3:.1f} ms)"
        )
    if row["client_bottleneck"]:
        lag, cpu = row["client_loop_lag_p99_s"] or 0, row["client_cpu_fraction"] or 0
        reasons.append(f"the client was the bottleneck: event-loop lag p99 {lag * 1e3:.1f} ms, CPU {cpu:.0%} of a core")
    row["invalid_reasons"] = "; ".join(reasons)
    row["valid"] = not reasons
    return row


def sampling_columns(meta: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """How a cell's sampling went: why it stopped, its target, the reported interval's relative half-width
    (its wider side) and whether it reached the target (None: a fixed count, no target; docs/sampling.md)."""
    sampled = meta.get("sampling") or {}
    rule = sampled.get("rule") or {}
    median, low, high = row["primary_p50"], row["primary_ci_low"], row["primary_ci_high"]
    relative = None
    if median and low is not None and high is not None:
        relative = float(max(median - low, high - median) / abs(median))
    return {
        "sampling_reason": sampled.get("reason"),
        "sampling_target_rel_ci": rule.get("target_rel_ci"),
        "primary_rel_ci": relative,
        "precise": None if not rule else sampled.get("reason") == "precise",
    }


def cache_contradicts(expected: float, measured: float | None, validity: Validity) -> bool:
    """True when the measured hit rate says the cell did not measure what its mode means."""
    floor = validity.max_unexpected_hit_rate
    if measured is None or (isinstance(measured, float) and np.isnan(measured)):
        return expected > floor  # expected hits, but the server reports no prefix-cache traffic at all
    if expected <= floor:
        return measured > floor
    return measured < validity.min_hit_rate_fraction * expected


def peak_tokens_asked(measured: pd.DataFrame, concurrency: int, cache: PrefixCache | None = None) -> int | None:
    """KV tokens the cell could hold at once: its sessions × its longest request, in the whole blocks the pool
    hands out (a 300-token request holds a whole 384-token block of a hybrid model's pool)."""
    if measured.empty:
        return None
    longest = (measured["prompt_tokens_requested"] + measured["output_tokens_requested"]).max()
    return int((cache or PrefixCache()).held_tokens(longest) * concurrency)


def kv_limited(row: dict[str, Any], concurrency: int = 1) -> bool:
    """The cell ran into the KV-cache capacity: preemptions, a full pool, or requests queued for capacity
    while the pool's free part could not hold the cell's longest request (at most 90% used: a sampled gauge
    misses the peak) or the cell's live tokens exceed the whole pool. Seen on the CPU demo's 9,216-token
    pool: multi-turn at 2,048 tokens × 4 sessions queued requests at a peak usage of 77-89%, with requests
    of 2,618 tokens (28% of the pool)."""
    usage = row.get("server_kv_cache_usage_perc_max") or 0.0
    waiting = row.get("server_num_requests_waiting_capacity_max") or 0.0
    pool, asked = row.get("kv_cache_tokens"), row.get("peak_tokens_asked")
    crowded = 0.9
    if pool and asked and not intervals.missing(pool) and not intervals.missing(asked):
        crowded = min(crowded, 1.0 - asked / max(1, concurrency) / float(pool))
    # Requests waited, and the cell's live tokens cannot all fit the pool: limited, whatever the sampled
    # usage caught (a 6-s demo cell has six gauge samples; seen 2026-12-02: peak sampled at 69% with
    # 4 x 2,618 tokens asked of a 9,216-token pool).
    overflow = bool(pool and asked and not intervals.missing(pool) and not intervals.missing(asked) and asked > pool)
    return bool(
        (row.get("server_preemptions") or 0) > 0 or usage >= 0.98 or (waiting > 0 and (usage >= crowded or overflow))
    )


def summarize(df: pd.DataFrame, metas: list[dict[str, Any]], experiment: Experiment) -> pd.DataFrame:
    rows = []
    # Each cell's rows found once, by one grouping: a mask over every row per cell grew with the square of the grid.
    by_cell = df.groupby(CELL_KEYS, sort=False).indices if len(df) else {}
    columns = {c: df[c].to_numpy() for c in df.columns if c not in CELL_KEYS}
    if metas:
        columns["error_missing"] = df["error"].isna().to_numpy()
    for meta in metas:
        cell = meta["cell"]
        positions = by_cell.get(cell_key(cell), np.empty(0, dtype=np.intp))
        cell_rows = CellRows(columns, positions, modes.get(cell["mode"]).primary)
        rows.append(_cell_summary(cell_rows, meta, experiment))
    summary = pd.DataFrame(rows)
    if not summary.empty:
        # The grid's order: closed-loop cells (rate 0) by sessions, then open-loop ones by rate.
        # A trace's cells window by window, in the config's order.
        order = ["configuration", "mode", "context", "window", "rate", "concurrency"]
        summary = summary.sort_values(order, key=_grid_order(experiment)).reset_index(drop=True)
    return summary


def _grid_order(experiment: Experiment):  # type: ignore[no-untyped-def]
    configurations = list(experiment.configurations)
    mode_order = experiment.modes()
    window_order = [label for w in experiment.workloads.values() for label in w.windows]

    def key(column: pd.Series) -> pd.Series:
        if column.name == "configuration":
            return column.map(lambda v: configurations.index(v) if v in configurations else len(configurations))
        if column.name == "mode":
            return column.map(lambda v: mode_order.index(v) if v in mode_order else len(mode_order))
        if column.name == "window":
            return column.map(lambda v: window_order.index(v) if v in window_order else len(window_order))
        return column

    return key
