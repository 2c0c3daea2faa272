"""Follow one cell through the package: which modules it enters, in which order, and which calls go up a layer.

Runs one real cell (decode, 2 sessions) against the loopback calibration server, launched by servegrid as it
launches vLLM, with a profiler that records every call from one servegrid module into another (every thread).
Prints the modules in the order the cell first enters them, each with its layer, and every caller → callee edge
whose callee sits in a higher layer than its caller (a call "back up": through a protocol or a callback, since
no module imports one above it). Calls made by the calibration engine (servegrid.testing) are not counted.

    .venv/bin/python tools/cell_call_path.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

from servegrid.config import Experiment
from servegrid.pipeline.cell_job import run_cell
from servegrid.serving import procs, server
from servegrid.testing import engine as _calibration_engine  # noqa: F401 - registers engine.kind "calibration"

# The layers of pyproject.toml's import-linter contract, top first.
LAYERS = [
    ("pipeline",),
    ("reporting",),
    ("analysis", "serving", "measuring"),
    ("config",),
    ("modes",),
    ("load",),
    ("records", "stats", "engines"),
    ("atomic", "errors", "languages", "paths", "progress", "redact", "text"),
]


def layer(module: str) -> int:
    """0 for the root's modules, growing upward; -1 for servegrid.testing (not part of the pipeline)."""
    part = module.split(".")[1] if "." in module else ""
    for rank, names in enumerate(reversed(LAYERS)):
        if part in names:
            return rank
    return -1


def experiment() -> Experiment:
    return Experiment(
        {
            "experiment": {"title": "one cell's path"},
            "model": {"path": "none", "served_name": "calibration"},
            "engine": {
                "kind": "calibration",
                "command": [sys.executable, "-m", "servegrid.testing.calibration", "--model", "{model}"],
                "args": ["--interval", "0.005"],
            },
            "configurations": {"only": {"label": "only", "prefix_caching": True}},
            "workloads": {
                "decode": {"contexts": [64], "concurrency": [2], "output_tokens": 8, "requests_per_session": 4}
            },
        }
    )


def main() -> None:
    order: list[str] = []
    edges: Counter[tuple[str, str]] = Counter()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if not callee.startswith("servegrid") or callee.startswith("servegrid.testing"):
            return
        if callee not in order:
            order.append(callee)
        if caller.startswith("servegrid") and caller != callee:
            edges[(caller, callee)] += 1

    built = experiment()
    (cell,) = built.cells()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        runtime = server.Runtime(port_range=(18900, 18999), startup_timeout_s=30, state_dir=f"{folder}/state")
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            run_cell(built, cell, Path(cell.path), owner=procs.ProcessRef.of(os.getpid()), runtime=runtime)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            server.stop_all(runtime, reason="done")
    print(f"modules entered, in order ({len(order)}):")
    for name in order:
        print(f"  layer {layer(name)}  {name}")
    upward = {edge: n for edge, n in edges.items() if layer(edge[1]) > layer(edge[0]) >= 0}
    print(
        f"calls between modules: {sum(edges.values())} over {len(edges)} edges; "
        f"up a layer: {sum(upward.values())} over {len(upward)} edges"
    )
    for (caller, callee), n in sorted(upward.items(), key=lambda item: -item[1]):
        print(f"  {caller} (layer {layer(caller)}) -> {callee} (layer {layer(callee)}): {n}")


if __name__ == "__main__":
    main()
