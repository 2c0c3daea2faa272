"""What watching the server costs the measured stream: one cell at several `/metrics` scrape intervals (issue 42,
item 9).

During a cell servegrid fetches the server's Prometheus page every `operations.metrics_interval_s` (its gauges: KV
use, requests running and waiting). vLLM renders that page in its API server's process, the one that also streams
every token, so a render lands between two tokens of whichever request is streaming. This script measures what it
adds where it would show: the gaps between tokens (ITL), their p99 above all.

The CPU demo's `prefix_cache` configuration (config/cpu-demo.yaml: the tiny model compiled as the demo runs it,
server on core 0, client on core 1) serves one decode cell (512-token prompts, 4 sessions, 64 tokens out, a fixed
number of requests) again and again on one server, the interval changing from cell to cell in rounds (10 s, 1 s,
0.25 s, then again), so that drift of the machine spreads over all of them alike. Printed side by side, each with its
ratio to the 10 s interval (a tenth of the default's scrapes: the baseline): ITL p50 and p99 over every gap of every
request, TPOT p50, TTFT p50; and the time one scrape takes from the client's side on the idle server.

    .venv/bin/python benchmarks/metrics_scrape_cost.py [--rounds 3] [--requests 8] [--intervals 10 1 0.25]
        [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from servegrid.config import Experiment
from servegrid.config.tiny_model_spec import TinyModelSpec
from servegrid.pipeline.cell_job import run_cell
from servegrid.records import cell_file, per_request
from servegrid.serving import procs, server, tiny_model

REPO = Path(__file__).resolve().parents[1]
INTERVALS_S = (10.0, 1.0, 0.25)  # the default; the first is the baseline of every ratio


def experiment(folder: Path, interval_s: float, requests: int) -> Experiment:
    raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw["model"]["path"] = str(folder / "model")
    raw["engine"]["command"] = [str(REPO / ".venv-vllm/bin/python"), *raw["engine"]["command"][1:]]
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    raw["workloads"] = {
        "decode": {"contexts": [512], "concurrency": [4], "output_tokens": 64, "requests_per_session": requests}
    }
    raw["sampling"] = {"temperature": 0.0}  # a fixed count: every interval measures the same requests
    raw.setdefault("operations", {})["metrics_interval_s"] = interval_s
    return Experiment(raw, source="benchmarks/metrics_scrape_cost.py")


def scrape_s(url: str, times: int = 20) -> float:
    """The median time of one `/metrics` fetch from the client's side (render, transfer, read)."""
    took = []
    with httpx.Client(trust_env=False, timeout=30) as client:
        for _ in range(times):
            started = time.perf_counter()
            client.get(f"{url}/metrics").raise_for_status()
            took.append(time.perf_counter() - started)
    return statistics.median(took)


def measure(folder: Path, interval_s: float, index: int, requests: int) -> dict[str, Any]:
    os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the cell narrows its process to the client's core
    built = experiment(folder, interval_s, requests)
    (cell,) = built.cells()
    runtime = server.Runtime.from_config(built.operations, built.configuration("prefix_cache"))
    out = folder / f"cell-{index}.parquet"
    meta = run_cell(built, cell, out, owner=procs.ProcessRef.of(os.getpid()), runtime=runtime)
    frame = per_request.derive(cell_file.read_cell(out)[0].to_pandas())
    measured = frame[(frame["phase"] == "measured") & frame["valid"]]
    gaps = np.concatenate([np.diff(np.asarray(t, dtype=float)) for t in measured["chunk_times_s"] if len(t) > 1])
    return {
        "interval_s": interval_s,
        "session": meta.server["session"],
        "url": meta.server["url"],
        "requests": len(measured),
        "scrapes": (meta.server_metrics or {}).get("gauges", {}).get("samples"),
        "gaps": gaps.tolist(),
        "tpot_s": measured["tpot_s"].tolist(),
        "ttft_s": measured["ttft_s"].tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8, help="requests per session in each cell")
    parser.add_argument("--intervals", type=float, nargs="+", default=list(INTERVALS_S), help="the first: the baseline")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    options = parser.parse_args()
    intervals = tuple(options.intervals)
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="scrape-cost-") as tmp:
        folder = Path(tmp)
        tiny_model.build(folder / "model", TinyModelSpec())
        os.chdir(folder)  # server logs and state under the temporary folder
        try:
            for _round in range(options.rounds):
                for interval_s in intervals:
                    cells.append(measure(folder, interval_s, len(cells), options.requests))
                    print(
                        json.dumps({k: v for k, v in cells[-1].items() if k not in ("gaps", "tpot_s", "ttft_s")}),
                        flush=True,
                    )
            url = cells[-1]["url"]
            idle_scrape_s = scrape_s(url)
        finally:
            built = experiment(folder, intervals[0], options.requests)
            runtime = server.Runtime.from_config(built.operations, built.configuration("prefix_cache"))
            server.stop_all(runtime, reason="benchmark done")
    sessions = {c["session"] for c in cells}
    rows = []
    for interval_s in intervals:
        mine = [c for c in cells if c["interval_s"] == interval_s]
        gaps = np.concatenate([np.asarray(c["gaps"]) for c in mine])
        rows.append(
            {
                "interval_s": interval_s,
                "cells": len(mine),
                "requests": sum(c["requests"] for c in mine),
                "scrapes_per_cell": statistics.fmean(c["scrapes"] or 0 for c in mine),
                "gaps": int(gaps.size),
                "itl_p50_ms": 1000 * float(np.percentile(gaps, 50)),
                "itl_p99_ms": 1000 * float(np.percentile(gaps, 99)),
                "itl_max_ms": 1000 * float(gaps.max()),
                "tpot_p50_ms": 1000 * statistics.median(t for c in mine for t in c["tpot_s"]),
                "ttft_p50_ms": 1000 * statistics.median(t for c in mine for t in c["ttft_s"]),
            }
        )
    base = rows[0]
    print(f"\none server for every cell: {len(sessions) == 1}; one /metrics fetch, idle: {idle_scrape_s * 1000:.1f} ms")
    print(
        f"{'interval s':>10}{'scrapes/cell':>13}{'gaps':>7}{'ITL p50 ms':>11}{'ratio':>7}{'ITL p99 ms':>11}"
        f"{'ratio':>7}{'TPOT p50 ms':>12}{'ratio':>7}{'TTFT p50 ms':>12}{'ratio':>7}"
    )
    for row in rows:
        print(
            f"{row['interval_s']:>10.2f}{row['scrapes_per_cell']:>13.1f}{row['gaps']:>7}"
            f"{row['itl_p50_ms']:>11.2f}{row['itl_p50_ms'] / base['itl_p50_ms']:>7.2f}"
            f"{row['itl_p99_ms']:>11.2f}{row['itl_p99_ms'] / base['itl_p99_ms']:>7.2f}"
            f"{row['tpot_p50_ms']:>12.2f}{row['tpot_p50_ms'] / base['tpot_p50_ms']:>7.2f}"
            f"{row['ttft_p50_ms']:>12.1f}{row['ttft_p50_ms'] / base['ttft_p50_ms']:>7.2f}"
        )
    Path(options.out).mkdir(parents=True, exist_ok=True)
    summary = {"idle_scrape_ms": idle_scrape_s * 1000, "one_server": len(sessions) == 1, "rows": rows}
    (Path(options.out) / "metrics_scrape_cost.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
