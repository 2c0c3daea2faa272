"""Run by vLLM's own environment: read servegrid's exports with upstream's reader of `vllm bench` results.

`vllm bench sweep plot` finds every summary.json under a folder and groups its runs; with --dry-run it loads
and groups them without drawing. Prints, as JSON, each summary.json's runs as pandas reads them.
"""

import json
import sys
from pathlib import Path

import pandas as pd
from vllm.benchmarks.sweep.plot import PlotBinners, PlotFilters, _convert_inf_nan_strings, _json_load_bytes, plot

root = Path(sys.argv[1])
plot(
    root,
    Path(sys.argv[2]),
    fig_by=["mode"],
    row_by=["context"],
    col_by=[],
    curve_by=["configuration"],
    var_x="max_concurrency",
    var_y="median_ttft_ms",
    filter_by=PlotFilters.parse_str(""),
    bin_by=PlotBinners.parse_str(""),
    scale_x=None,
    scale_y=None,
    dry_run=True,
)
runs = {}
for path in sorted(root.rglob("**/summary.json")):
    frame = pd.DataFrame.from_records(_convert_inf_nan_strings(_json_load_bytes(path)))
    runs[path.parent.name] = frame.drop(columns=["ttfts", "itls", "latencies", "input_lens", "output_lens", "errors"])
print("RUNS " + json.dumps({mode: frame.to_dict("records") for mode, frame in runs.items()}))
