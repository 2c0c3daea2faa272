"""What vLLM's CPU compilation settings do to a server's start-up and to what a cell measures.

The CPU demo's `prefix_cache` configuration (config/cpu-demo.yaml: the tiny model, server on core 0, client on
core 1) is started under each setting, one after another, and measures the same decode cell (512-token prompts,
1 session, 64 tokens out, 12 requests after a warm-up). Printed side by side, with each setting's ratio to the
first:

- default: vLLM's own choice on CPU (torch.compile, Dynamo traced once, the Inductor backend), with empty
  compile caches (TORCHINDUCTOR_CACHE_DIR and VLLM_CACHE_ROOT in a fresh folder), as on a new machine or in CI;
- default, warm cache: the same, started again with the cache the first start left;
- --enforce-eager: no compilation at all (what the test suite's servers use, tests/helpers TEST_ENGINE_ARGS);
- VLLM_CPU_CI_ENV=1: Dynamo, but its eager backend instead of Inductor (vLLM's own CI setting for CPU);
- eager, worker in engine core: --enforce-eager with VLLM_ENABLE_V1_MULTIPROCESSING=0, which on the CPU build runs
  the model in the engine core's process instead of a third one (vLLM's worker): two Python processes import torch
  and vLLM at start-up instead of three (the test suite's servers, tests/helpers TEST_ENGINE_ENV).

Start-up is the supervisor's launch to health (servegrid's ServerFacts.startup_s, the warm-up request after it
apart); the cell's figures are its p50s (TTFT, TPOT, decode tokens/s per session).

    .venv/bin/python benchmarks/vllm_startup.py [--requests 12] [--out benchmarks/out] [--only SETTING ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from servegrid.config import Experiment
from servegrid.config.tiny_model_spec import TinyModelSpec
from servegrid.pipeline.cell_job import run_cell
from servegrid.records import cell_file, per_request
from servegrid.serving import procs, server, tiny_model

REPO = Path(__file__).resolve().parents[1]

# name → (extra engine args, extra environment, empty the Inductor cache first)
SETTINGS: dict[str, tuple[list[str], dict[str, str], bool]] = {
    "default (cold cache)": ([], {}, True),
    "default (warm cache)": ([], {}, False),
    "--enforce-eager": (["--enforce-eager"], {}, False),
    "VLLM_CPU_CI_ENV=1": ([], {"VLLM_CPU_CI_ENV": "1"}, True),
    "eager, worker in engine core": (["--enforce-eager"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, False),
}


def experiment(folder: Path, args: list[str], env: dict[str, str], requests: int) -> Experiment:
    raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw["model"]["path"] = str(folder / "model")
    raw["engine"]["command"] = [str(REPO / ".venv-vllm/bin/python"), *raw["engine"]["command"][1:]]
    raw["engine"]["args"] = [*raw["engine"]["args"], *args]
    raw["engine"]["env"] = {**raw["engine"]["env"], **env}
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    raw["workloads"] = {
        "decode": {"contexts": [512], "concurrency": [1], "output_tokens": 64, "requests_per_session": requests}
    }
    raw["sampling"] = {"temperature": 0.0}  # a fixed count: every setting measures the same requests
    return Experiment(raw, source="benchmarks/vllm_startup.py")


def measure(name: str, folder: Path, caches: Path, requests: int) -> dict[str, Any]:
    """One setting: its server started, the decode cell measured, the server stopped."""
    # A cell narrows its process to the client's core (as every cell job does): give the next server its core back.
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    args, env, cold = SETTINGS[name]
    if cold:
        shutil.rmtree(caches, ignore_errors=True)
    cache_env = {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "VLLM_CACHE_ROOT": str(caches / "vllm")}
    built = experiment(folder, args, {**env, **cache_env}, requests)
    (cell,) = built.cells()
    runtime = server.Runtime.from_config(built.operations, built.configuration("prefix_cache"))
    owner = procs.ProcessRef.of(os.getpid())
    try:
        meta = run_cell(built, cell, folder / f"{name}.parquet", owner=owner, runtime=runtime)
    finally:
        server.stop_all(runtime, reason="benchmark setting done")
    frame = per_request.derive(cell_file.read_cell(folder / f"{name}.parquet")[0].to_pandas())
    measured = frame[(frame["phase"] == "measured") & frame["valid"]]
    return {
        "setting": name,
        "startup_s": meta.server["startup_s"],
        "warmup_s": meta.server.get("warmup_s"),
        "requests": len(measured),
        "ttft_p50_ms": 1000 * statistics.median(measured["ttft_s"]),
        "tpot_p50_ms": 1000 * statistics.median(measured["tpot_s"]),
        "decode_tps_p50": statistics.median(measured["decode_tps"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(SETTINGS),
        default=list(SETTINGS),
        help="these settings, in this order (ratios are to the first)",
    )
    options = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-startup-") as tmp:
        folder = Path(tmp)
        tiny_model.build(folder / "model", TinyModelSpec())
        os.chdir(folder)  # server logs and state under the temporary folder
        for name in options.only:
            rows.append(measure(name, folder, folder / "compile-caches", options.requests))
            print(json.dumps(rows[-1]), flush=True)
    first = rows[0]
    print(
        f"\n{'setting':<30}{'start-up s':>11}{'ratio':>7}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}{'ratio':>7}"
        f"{'decode tok/s':>14}"
    )
    for row in rows:
        print(
            f"{row['setting']:<30}{row['startup_s']:>11.1f}{row['startup_s'] / first['startup_s']:>7.2f}"
            f"{row['ttft_p50_ms']:>13.1f}{row['tpot_p50_ms']:>13.2f}{row['tpot_p50_ms'] / first['tpot_p50_ms']:>7.2f}"
            f"{row['decode_tps_p50']:>14.1f}"
        )
    Path(options.out).mkdir(parents=True, exist_ok=True)
    (Path(options.out) / "vllm_startup.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
