"""Results other tools read: each cell in ``vllm bench serve``'s result format, and the tables as CSV.

``vllm bench serve --save-result`` writes one JSON object per run; ``vllm bench sweep plot`` (and
dashboards built on the same files) reads ``summary.json`` files, each a list of such objects, found
anywhere under its folder. servegrid writes, under ``results/exports/vllm-bench/``, one file per cell
(``{mode}/{configuration}/ctx{context}_{load}.json``, the cell file's name) and per mode a ``summary.json`` list of its
cells, with upstream's field names and units:

- ``completed``, ``failed``, ``duration`` (s, the cell's measured stages), ``request_throughput`` (req/s),
  ``output_throughput`` and ``total_token_throughput`` (tok/s), ``max_concurrency``;
- ``{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms``; ``itl`` is upstream's: the gaps between SSE chunks
  (a chunk of several speculative tokens is one gap), not servegrid's per-token ITL;
- the raw lists ``ttfts``, ``itls``, ``latencies`` (s), ``input_lens``, ``output_lens``, ``errors``;
- and servegrid's keys for grouping: ``configuration``, ``mode``, ``context``, ``label`` (the cell id).

The measured requests only (no warm-up or probe), every turn of a conversation among them. Upstream computes
its percentiles from any number of requests; servegrid's tables keep to its honest-tails rule
(docs/sampling.md), so a p99 here from fewer than 300 requests is upstream's figure, not servegrid's.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from servegrid import atomic
from servegrid.analysis.requests_table import with_window

PERCENTILES = (99,)  # vllm bench serve's default --metric-percentiles
LIST_COLUMNS = ("chunk_times_s", "chunk_tokens")


def _stats_ms(values: list[float], name: str) -> dict[str, float]:
    """Upstream's mean/median/std/pNN of ``values`` (seconds) in ms; 0 where there is none, as upstream does."""
    arr = np.asarray(values or [0.0], dtype=float)
    out = {
        f"mean_{name}_ms": float(np.mean(arr) * 1000),
        f"median_{name}_ms": float(np.median(arr) * 1000),
        f"std_{name}_ms": float(np.std(arr) * 1000),
    }
    out.update({f"p{q}_{name}_ms": float(np.percentile(arr, q) * 1000) for q in PERCENTILES})
    return out


def bench_result(requests: pd.DataFrame, cell: dict[str, Any], model: str) -> dict[str, Any]:
    """One cell's measured requests (rows of the derived requests table) as a ``vllm bench serve`` result."""
    measured = requests[requests["phase"] == "measured"]
    ok = measured[measured["error"].isna()]
    duration = float(cell["duration_s"] or 0.0)
    inputs = [int(v) for v in ok["prompt_tokens_reported"].fillna(0)]
    outputs = [int(v) for v in ok["output_tokens_reported"].fillna(0)]
    ttfts = [float(v) for v in ok["ttft_s"].fillna(0.0)]
    latencies = [float(v) for v in ok["e2e_s"]]
    itls = [np.diff(np.asarray(t, dtype=float)).tolist() for t in ok["chunk_times_s"]]
    tpots = [(e - t) / (n - 1) for e, t, n in zip(latencies, ttfts, outputs, strict=True) if n > 1]
    started = datetime.fromisoformat(str(cell["started_at"]))
    result: dict[str, Any] = {
        "date": started.strftime("%Y%m%d-%H%M%S"),
        "backend": "vllm",
        "endpoint_type": "vllm",
        "label": cell["cell_id"],
        "model_id": model,
        "num_prompts": len(measured),
        **_load(cell),
        "duration": duration,
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "total_input_tokens": sum(inputs),
        "total_output_tokens": sum(outputs),
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": sum(outputs) / duration if duration else 0.0,
        "total_token_throughput": (sum(inputs) + sum(outputs)) / duration if duration else 0.0,
        "input_lens": inputs,
        "output_lens": outputs,
        "ttfts": ttfts,
        "itls": itls,
        "latencies": latencies,
        "errors": [str(e) for e in measured["error"].fillna("")],
        "configuration": cell["configuration"],
        "mode": cell["mode"],
        "context": int(cell["context"]),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", [g for r in itls for g in r]), ("e2el", latencies)):
        result.update(_stats_ms(values, name))
    return result


def _load(cell: dict[str, Any]) -> dict[str, Any]:
    """How the cell's requests went out, in vllm bench serve's terms."""
    rate = cell.get("offered_rate")
    if rate is None or pd.isna(rate):  # closed-loop sessions: --max-concurrency with no rate
        return {"request_rate": "inf", "burstiness": 1.0, "max_concurrency": int(cell["concurrency"])}
    # Open loop: --request-rate with --burstiness (gamma shape; 1 is Poisson). A constant schedule has no
    # burstiness in vllm bench serve (it would be an infinite shape): null, and the pattern said beside it.
    pattern = cell.get("arrival_pattern")
    # A replayed trace has its own arrival times (AIPerf's fixed schedule): no burstiness, the pattern "trace".
    burstiness = None if pattern in ("constant", "trace") else float(cell.get("burstiness") or 1.0)
    return {"request_rate": float(rate), "burstiness": burstiness, "max_concurrency": None, "arrival_pattern": pattern}


def write_bench_results(requests: pd.DataFrame, summary: pd.DataFrame, model: str, out_dir: Path) -> None:
    """Every cell's result and each mode's ``summary.json`` under ``out_dir``, replaced as a whole."""
    keys = ["configuration", "mode", "context", "concurrency"] + (["rate"] if "rate" in requests else [])
    keys += ["window"] if "window" in requests else []  # a trace's cells at one speedup, one per window
    summary = with_window(summary)
    by_cell = {key: rows for key, rows in requests.groupby(keys, sort=False)} if len(requests) else {}
    with atomic.atomic_directory(out_dir) as tmp:
        for mode, cells in summary.groupby("mode", sort=False):
            runs = []
            for cell in cells.to_dict("records"):
                rows = by_cell.get(tuple(cell.get(k, 0.0) for k in keys), requests.iloc[0:0])
                run = bench_result(rows, cell, model)
                name = f"ctx{cell['context']}_{cell.get('load') or 'c' + str(cell['concurrency'])}.json"
                path = tmp / str(mode) / str(cell["configuration"]) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
                runs.append(run)
            (tmp / str(mode) / "summary.json").write_text(json.dumps(runs, indent=1) + "\n", encoding="utf-8")


def write_csv(table: pd.DataFrame, out: Path | str) -> None:
    """``table`` as CSV; list columns (chunk times and tokens) as JSON arrays, so nothing is lost."""
    frame = table.copy()
    for column in frame.columns:
        if frame[column].dtype == object and frame[column].map(lambda v: isinstance(v, list | np.ndarray)).any():
            frame[column] = frame[column].map(lambda v: json.dumps(np.asarray(v).tolist()) if v is not None else "")
    with atomic.atomic_path(out) as tmp:
        frame.to_csv(tmp, index=False)
