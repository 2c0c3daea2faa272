"""The per-cell summary: one row per cell of the per-request table, its columns computed in one function.

Each cell's primary figure (its mode's :class:`~servegrid.modes.primary.Primary`) with its interval, the
per-request figures' percentiles (:mod:`servegrid.records.per_request`), what the server's counters say
(prefix-cache hits, KV use, preemptions), the objectives (:mod:`servegrid.analysis.slo`) and the checks that
make a cell invalid or KV-limited.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from servegrid import modes
from servegrid.analysis import cell_checks, slo
from servegrid.analysis.cell_rows import HOOK_COLUMNS, CellRows
from servegrid.analysis.load_columns import load_columns
from servegrid.analysis.requests_table import CELL_KEYS, cell_key, cell_values
from servegrid.config import Experiment, Validity
from servegrid.engines import metrics
from servegrid.engines.base import PrefixCache
from servegrid.records.cell_record import CellRecord
from servegrid.records.per_request import PER_REQUEST, per_token_itl
from servegrid.stats import correlated, intervals, sampling

MedianInterval = Callable[[np.ndarray], tuple[float | None, float | None]]


def _cell_summary(cell_rows: CellRows, meta: CellRecord, experiment: Experiment) -> dict[str, Any]:
    """The cell's row: its columns in the table's order, group by group (each helper's columns in turn)."""
    cell = meta.spec
    mode = modes.get(cell.mode)
    n_valid = int(cell_rows.valid.sum())
    measured_frame = cell_rows.frame(cell_rows.measured, HOOK_COLUMNS)
    # An open-loop cell's requests queue behind each other, so neighbours are alike: its medians' intervals are
    # batch medians over the requests in arrival order (servegrid.stats.correlated), not the independent-sample one.
    open_loop = cell.open_loop
    median_interval: MedianInterval = correlated.batch_median_interval if open_loop else intervals.median_interval
    row = _count_columns(cell_rows, meta, experiment, n_valid)
    row.update(_primary_columns(cell_rows, meta, experiment, measured_frame, median_interval))
    row.update(_per_request_columns(cell_rows, n_valid, median_interval))
    row.update(_throughput_columns(cell_rows, meta, n_valid))
    row.update(_mode_columns(cell_rows, mode))
    row.update(_server_columns(cell_rows, meta, row))
    row.update(_cache_columns(meta, mode, measured_frame, row, experiment.validity))
    client, send_delay = cell_checks.client_columns(cell_rows, meta, experiment.validity)
    row.update(client)
    row.update(cell_checks.gpu_columns(meta))
    reasons = cell_checks.invalid_reasons(row, send_delay, experiment.validity)
    row["invalid_reasons"] = "; ".join(reasons)
    row["valid"] = not reasons
    return row


def _count_columns(rows: CellRows, meta: CellRecord, experiment: Experiment, n_valid: int) -> dict[str, Any]:
    """The cell's identity, its configuration's switches, and how many of its requests were measured and valid."""
    cell = meta.spec
    measured = rows.measured
    primary = modes.get(cell.mode).primary
    # Labels are presentation (the figures' and the report's, from the config): no label in the tables.
    conf = experiment.configurations.get(cell.configuration)
    tokens_ok = rows["prompt_tokens_ok"] & rows["output_tokens_ok"]
    return {
        **cell_values(cell),
        "cell_id": cell.id,
        "prefix_caching": conf.prefix_caching if conf else None,
        "speculative_method": (conf.speculative or {}).get("method") if conf else None,
        "n_requests": int(measured.sum()),
        "n_valid": n_valid,
        "n_errors": int((measured & ~rows.ok).sum()),
        "n_token_mismatch": int((measured & rows.ok & ~tokens_ok).sum()),
        # A failed warm-up or probe: a shared prefix may never have been primed, a probe figure is missing. (Not an
        # open-loop cell's ramp or drain: those are load, and the drain's last requests are cancelled on purpose.)
        "n_unmeasured_errors": int((rows.priming & ~rows.ok).sum()),
        "duration_s": meta.duration_s,
        # The cell job's wall clock, its server's start included where it started one: what the run spent on it.
        "cell_wall_s": meta.wall_s,
        # Sampling that serves the verdict: how many top-ups were pooled into the cell (0 under the precision policy).
        "top_ups": len(meta.top_ups),
        "primary_metric": primary.metric,
        "primary_higher_is_better": primary.higher_is_better,
    }


def _primary_columns(
    rows: CellRows,
    meta: CellRecord,
    experiment: Experiment,
    measured_frame: pd.DataFrame,
    median_interval: MedianInterval,
) -> dict[str, Any]:
    """The primary figure: its samples, the objectives, its median with its interval, how the sampling went, and
    the spread of the repeats' medians."""
    cell = meta.spec
    primary = modes.get(cell.mode).primary
    values = rows.floats(primary.column, rows.primary)
    out: dict[str, Any] = {}
    out["primary_n"] = int(np.count_nonzero(~np.isnan(values)))  # the samples, as sequential sampling counts them
    out.update(slo.cell_columns(measured_frame, experiment.slo.get(cell.mode, ()), meta.duration_s))
    out["primary_p50"] = intervals.percentiles(values)["p50"]
    out["primary_ci_low"], out["primary_ci_high"] = median_interval(values)
    n_effective = correlated.effective_samples(values) if cell.open_loop else None
    out["primary_n_effective"] = n_effective
    out["primary_correlated"] = (
        None if n_effective is None else correlated.strongly_correlated(out["primary_n"], n_effective)
    )
    out.update(sampling_columns(meta, out))
    repeats = rows["repeat"][rows.primary]
    by_repeat = [  # a diagnostic of drift between repeats: from any number of samples
        intervals.percentiles(values[repeats == r], (50,), enough_only=False)["p50"] for r in np.unique(repeats)
    ]
    present = [v for v in by_repeat if v is not None]
    out["n_repeats"] = len(np.unique(rows["repeat"][rows.measured]))
    out["primary_p50_repeat_min"] = min(present) if present else None
    out["primary_p50_repeat_max"] = max(present) if present else None
    return out


def _per_request_columns(rows: CellRows, n_valid: int, median_interval: MedianInterval) -> dict[str, Any]:
    """The valid requests' figures: each per-request figure's percentiles, the gaps between tokens and between
    chunks, and the tokens a chunk carries."""
    valid = rows.valid
    out: dict[str, Any] = {}
    for column in PER_REQUEST:
        values = rows.floats(column, valid)
        for name, value in intervals.percentiles(values).items():
            out[f"{column}_{name}"] = value
        if column in ("ttft_s", "tpot_s", "e2e_s", "decode_tps"):
            out[f"{column}_p50_ci_low"], out[f"{column}_p50_ci_high"] = median_interval(values)
    times, tokens = rows["chunk_times_s"][valid], rows["chunk_tokens"][valid]
    itl = [per_token_itl(t, k) for t, k in zip(times, tokens, strict=True)]
    gaps = [np.diff(np.asarray(t, dtype=float)) for t in times if len(t) > 1]
    for prefix, parts in (("itl_token_s", itl), ("chunk_gap_s", gaps)):
        flat = np.concatenate(parts) if parts else np.empty(0)
        # Gaps within one request are not independent samples: the tail rule counts requests here.
        for name, value in intervals.percentiles(flat, enough_only=False).items():
            allowed = sampling.tail_allowed(n_valid, int(name[1:]) / 100)
            out[f"{prefix}_{name}"] = value if allowed else None
    per_chunk = rows.floats("tokens_per_chunk", valid)
    per_chunk = per_chunk[~np.isnan(per_chunk)]
    out["tokens_per_chunk_mean"] = (float(per_chunk.mean()) if per_chunk.size else float("nan")) if n_valid else None
    return out


def _throughput_columns(rows: CellRows, meta: CellRecord, n_valid: int) -> dict[str, Any]:
    """Per second of the measured phase (its stages, without the pauses between them, and every repeat)."""
    cell = meta.spec
    active_s = meta.duration_s
    output_tokens = rows.floats("output_tokens_reported", rows.valid).sum()
    prompt_tokens = rows.floats("prompt_tokens_reported", rows.valid).sum()
    timed = bool(n_valid and active_s and active_s > 0)
    out: dict[str, Any] = {
        "output_tps_total": float(output_tokens / active_s) if timed and active_s else None,
        # The valid requests' prompts per second (cached tokens included): the other half of what a token costs.
        "input_tps_total": float(prompt_tokens / active_s) if timed and active_s else None,
    }
    settings = meta.cell_settings
    per_arrival = modes.get(cell.mode).requests_per_arrival(settings.workload)
    out.update(load_columns(cell, meta.open_loop, n_valid, active_s, settings.arrival, per_arrival))
    out["speedup"] = settings.speedup  # a replayed trace's (None for every other cell)
    return out


def _mode_columns(rows: CellRows, mode: modes.Mode) -> dict[str, Any]:
    """Every mode's own columns in every row, so the table has one schema: None where not applicable."""
    out: dict[str, Any] = dict.fromkeys(c for m in modes.registered() for c in m.summary_columns)
    if mode.summarize is not None:
        everything = np.ones(len(rows.positions), dtype=bool)
        out.update(mode.extra_columns(rows.frame(rows.valid, HOOK_COLUMNS), rows.frame(everything, HOOK_COLUMNS)))
    return out


def _server_columns(rows: CellRows, meta: CellRecord, row: dict[str, Any]) -> dict[str, Any]:
    """What the server's counters and gauges say, what the client's timing adds to the server's own, and the
    server's engine and KV pool. ``row``: the columns so far (an older cell file's row may lack a server figure)."""
    server, server_metrics = meta.server, (meta.server_metrics or {})
    out: dict[str, Any] = {f"server_{k}": v for k, v in server_metrics["derived"].items()}
    out["server_preemptions"] = server_metrics["delta"].get("num_preemptions")
    # vLLM times the same requests itself (from their arrival in the server to its first token out, and
    # per output token): what the client's mean adds to the server's, where both counted the same requests.
    for figure, column in (("ttft", "ttft_s"), ("tpot", "tpot_s")):
        timed = rows.floats(column, rows.measured)
        timed = timed[~np.isnan(timed)]
        counted = server_metrics["delta"].get(f"{metrics.SERVER_TIMING[figure]}_count")
        mean_key = f"server_{figure}_mean_s"
        server_mean = out.setdefault(mean_key, row.get(mean_key))  # cell files older than the figure lack it
        same_requests = server_mean is not None and counted == len(timed) > 0
        out[f"{figure}_mean_minus_server_s"] = float(timed.mean() - server_mean) if same_requests else None
    gauges = server_metrics["gauges"]
    for gauge in metrics.GAUGES:
        for stat in ("max", "mean"):
            out[f"server_{gauge}_{stat}"] = gauges.get(f"{gauge}_{stat}")
    for key in ("engine_version", "kv_cache_tokens", "block_size", "cache_mode"):
        out[key] = server.get(key)
    return out


def _cache_columns(
    meta: CellRecord, mode: modes.Mode, measured_frame: pd.DataFrame, row: dict[str, Any], validity: Validity
) -> dict[str, Any]:
    """The server's session and the cell's provenance, the prefix-cache hits the mode expects, and whether the
    cell ran into the KV capacity or its hits contradict its mode. ``row``: the columns so far."""
    sessions, server = meta.spec.sessions or 0, meta.server
    # Cell files from before the server said how it reuses blocks: every matched block (the rule until then).
    prefix_cache = PrefixCache(
        block=row["block_size"] or 1,
        dropped=server.get("hit_blocks_dropped") or 0,
        sightings=server.get("prefix_sightings") or 1,
        judged=server.get("hits_judged", True),
    )
    expected = (
        mode.expected_hit_rate(bool(row["prefix_caching"]), meta.cell_settings, measured_frame, prefix_cache)
        if prefix_cache.judged
        else None  # where the server's hits land is not certain: its hit rate is reported, not judged
    )
    out: dict[str, Any] = {
        "server_session": server.get("session"),
        "spec_hash": meta.spec_hash,
        "started_at": meta.started_at,
        "cache_state": meta.cache_state,
        "expected_hit_rate": expected,
        "peak_tokens_asked": peak_tokens_asked(measured_frame, sessions, prefix_cache),
    }
    out["kv_limited"] = limited = kv_limited(row | out, sessions)
    # A cell past the KV capacity evicts cached blocks to make room: fewer hits than its mode expects are
    # that regime (the seed's "pinned cache blocks"), not a cell that measured something else.
    hit_rate = row["server_prefix_cache_hit_rate"]
    out["cache_contradiction"] = (
        expected is not None
        and cache_contradicts(expected, hit_rate, validity)
        and not (limited and (hit_rate or 0.0) < expected)
    )
    return out


def sampling_columns(meta: CellRecord, row: dict[str, Any]) -> dict[str, Any]:
    """How a cell's sampling went: why it stopped, its target, the reported interval's relative half-width
    (its wider side) and whether it reached the target (None: a fixed count, no target; docs/sampling.md)."""
    sampled = meta.sampling or {}
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


def format_columns(meta: CellRecord) -> dict[str, Any]:
    """Which cell-file format the cell was read from, and what that format lacks of today's columns
    (servegrid.records.cell_format: read as today's, never re-measured for it)."""
    return {"cell_format": meta.format_version, "older_format_lacks": "; ".join(meta.lacks)}


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


def summarize(df: pd.DataFrame, metas: list[CellRecord], experiment: Experiment) -> pd.DataFrame:
    rows = []
    # Each cell's rows found once, by one grouping: a mask over every row per cell grew with the square of the grid.
    by_cell = df.groupby(CELL_KEYS, sort=False).indices if len(df) else {}
    columns = {c: df[c].to_numpy() for c in df.columns if c not in CELL_KEYS}
    if metas:
        columns["error_missing"] = df["error"].isna().to_numpy()
    for meta in metas:
        positions = by_cell.get(cell_key(meta.spec), np.empty(0, dtype=np.intp))
        cell_rows = CellRows(columns, positions, modes.get(meta.spec.mode).primary)
        rows.append(_cell_summary(cell_rows, meta, experiment) | format_columns(meta))
    summary = pd.DataFrame(rows)
    if not summary.empty:
        # The grid's order: closed-loop cells (rate 0) by sessions, then open-loop ones by rate.
        # A trace's cells window by window, in the config's order.
        order = ["configuration", "mode", "context", "window", "rate", "concurrency"]
        summary = summary.sort_values(order, key=_grid_order(experiment)).reset_index(drop=True)
    return summary


def _grid_order(experiment: Experiment) -> Callable[[pd.Series], pd.Series]:
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
