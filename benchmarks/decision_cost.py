"""What a decision costs: the CPU demo's grid measured under both sampling policies on the same host, side by side.

Two copies of the workflow, one per policy (``sampling.policy: precision``, today's rule: every cell samples until its
own median is within ±5% or its time cap; ``verdict``: every cell measures ``min_samples`` first, then only the cells
of groups whose verdict is still open are topped up, docs/sampling.md). Their first passes alternate configuration by
configuration (precision's cells of one configuration, then verdict's, then the next configuration), so that a drift
of the host over the run falls on both alike; then each copy aggregates (the verdict copy's rounds of top-ups run
there). Real vLLM (the CPU build) serves every cell.

Printed: measuring seconds (the cells' measured phases, top-ups included), device hours (each cell job's wall clock,
server starts included), the groups each policy decided, and group by group whether both reached the same verdict
(the same winner, or both a tie, or both at the KV limit) and the same class outcomes.

    .venv/bin/python benchmarks/decision_cost.py [--config config/cpu-demo.yaml] [--workdir /tmp/decision-cost]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "workflow"))

from servegrid.config import Experiment  # noqa: E402
from servegrid.testing import workflow_copy  # noqa: E402

POLICIES = ("precision", "verdict")


def copy_workflow(dest: Path) -> Path:
    """The repository's workflow copied to ``dest`` (servegrid.testing.workflow_copy)."""
    return workflow_copy.copy_workflow(ROOT, dest)


def snakemake(workdir: Path, *targets: str) -> float:
    """Run Snakemake on ``targets`` in ``workdir``; its seconds."""
    started = time.monotonic()
    subprocess.run(
        [str(ROOT / ".venv" / "bin" / "snakemake"), "--cores", "1", "--configfile", "bench.yaml", "--", *targets],
        cwd=workdir,
        check=True,
        env={**os.environ, "PYTHONPATH": str(workdir / "workflow")},
        stdout=subprocess.DEVNULL,
    )
    return time.monotonic() - started


def group_verdicts(comparisons: pd.DataFrame, min_factor: float) -> dict[tuple[str, int, int], str]:
    """Per group: its winner when it names one decisively, else "tie" or "KV limit" (servegrid.analysis.verdict)."""
    out = {}
    for row in comparisons.to_dict("records"):
        key = (row["mode"], int(row["context"]), int(row["concurrency"]))
        if row["kv_limited"]:
            out[key] = "KV limit"
        elif row["tie"] or row["factor"] < min_factor:
            out[key] = "tie"
        else:
            out[key] = str(row["winner"])
    return out


def tables(workdir: Path) -> dict[str, pd.DataFrame]:
    folder = workdir / "results" / "tables"
    return {name: pd.read_parquet(folder / f"{name}.parquet") for name in ("summary", "comparisons", "verdict")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "config" / "cpu-demo.yaml"))
    parser.add_argument("--workdir", default="/tmp/decision-cost")
    args = parser.parse_args()
    raw = yaml.safe_load(Path(args.config).read_text())
    root = Path(args.workdir)
    if root.exists():
        shutil.rmtree(root)
    dirs: dict[str, Path] = {}
    for policy in POLICIES:
        dirs[policy] = copy_workflow(root / policy)
        variant = {**raw, "sampling": {**raw.get("sampling", {}), "policy": policy}}
        (dirs[policy] / "bench.yaml").write_text(yaml.safe_dump(variant, sort_keys=False, allow_unicode=True))
    experiment = Experiment(raw)
    spent: dict[str, float] = dict.fromkeys(POLICIES, 0.0)
    for name in experiment.configurations:  # first passes, alternating
        cells = [cell.path for cell in experiment.cells(name)]
        for policy in POLICIES:
            spent[policy] += snakemake(dirs[policy], *cells)
            print(f"{name}: {policy} cells done ({spent[policy]:.0f} s so far)", flush=True)
    for policy in reversed(POLICIES):  # the verdict copy's top-ups, then both copies' tables
        spent[policy] += snakemake(dirs[policy], "aggregate")
    measured = {policy: tables(dirs[policy]) for policy in POLICIES}
    print(report(experiment, measured, spent))
    return 0


def report(experiment: Experiment, measured: dict[str, dict[str, pd.DataFrame]], spent: dict[str, float]) -> str:
    m = experiment.verdict.min_factor
    verdicts = {p: group_verdicts(measured[p]["comparisons"], m) for p in POLICIES}
    summary = {p: measured[p]["summary"] for p in POLICIES}
    rows: list[tuple[str, Any, Any]] = [
        ("measuring seconds (measured phases)", *(f"{summary[p]['duration_s'].sum():.1f}" for p in POLICIES)),
        (
            "device hours (cell jobs, starts included)",
            *(f"{summary[p]['cell_wall_s'].sum() / 3600:.3f}" for p in POLICIES),
        ),
        ("Snakemake wall clock, s", *(f"{spent[p]:.0f}" for p in POLICIES)),
        ("primary samples", *(f"{int(summary[p]['primary_n'].sum())}" for p in POLICIES)),
        ("top-ups", "–", f"{int(summary['verdict']['top_ups'].sum())}"),
        (
            "groups with a winner",
            *(f"{sum(v not in ('tie', 'KV limit') for v in verdicts[p].values())}" for p in POLICIES),
        ),
        ("groups tied", *(f"{sum(v == 'tie' for v in verdicts[p].values())}" for p in POLICIES)),
    ]
    ratio = summary["verdict"]["duration_s"].sum() / summary["precision"]["duration_s"].sum()
    lines = ["| | precision (today) | verdict |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    lines += ["", f"verdict / precision measuring seconds: {ratio:.2f}", ""]
    comparisons = measured["verdict"]["comparisons"].set_index(["mode", "context", "concurrency"])
    lines += ["| group | precision | verdict | how verdict's sampling stopped | same |", "|---|---|---|---|---|"]
    same_groups = 0
    for key in sorted(set(verdicts["precision"]) | set(verdicts["verdict"])):
        a, b = verdicts["precision"].get(key, "–"), verdicts["verdict"].get(key, "–")
        stop = comparisons.loc[key, "sampling_stop"] if key in comparisons.index else "–"
        same_groups += a == b
        lines.append(f"| {key[0]} ctx {key[1]} × {key[2]} | {a} | {b} | {stop} | {'yes' if a == b else 'NO'} |")
    classes = {p: measured[p]["verdict"].set_index("class_id")[["outcome", "winner"]] for p in POLICIES}
    same_classes = classes["precision"].fillna("").equals(classes["verdict"].fillna(""))
    lines += [
        "",
        f"same group verdicts: {same_groups} of {len(set(verdicts['precision']) | set(verdicts['verdict']))}; "
        f"same class outcomes and winners: {'yes' if same_classes else 'no'}",
    ]
    if not same_classes:
        lines.append(pd.concat(classes, axis=1).to_string())
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
