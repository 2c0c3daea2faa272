"""The estimate before and after calibration, against the run itself: for a demo config (``make demo``,
``make demo-hybrid``, ``make demo-traffic``), in one fresh copy of the workflow.

1. ``servegrid estimate`` on the config alone (its ``estimate:`` assumptions);
2. ``snakemake calibrate`` (one short server session per configuration), its seconds per configuration;
3. ``servegrid estimate`` again, priced from the calibrations;
4. ``snakemake report``, the run itself.

Compared per configuration: the device time the estimate gives it (its cells and its server's start) and what the
run held the device for it, from its first cell job's start to its last cell (or top-up) job's end in Snakemake's
log (the server is up all that time, whatever runs between its jobs); and the whole run's wall clock. Printed as a
Markdown table (docs/estimate.md keeps the runs'). Real vLLM (the CPU build) serves every cell.

    .venv/bin/python benchmarks/estimate_accuracy.py --profile profiles/cpu-demo [--workdir /tmp/estimate-accuracy]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from decision_cost import copy_workflow  # noqa: E402

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
JOB_RULE = re.compile(r"^(?:local)?rule (\w+):$")


def run(workdir: Path, argv: list[str]) -> float:
    started = time.monotonic()
    subprocess.run(argv, cwd=workdir, check=True, env={**os.environ, "PYTHONPATH": str(workdir / "workflow")})
    return time.monotonic() - started


def estimate(workdir: Path, config: str, out: str) -> dict:
    servegrid = str(ROOT / ".venv" / "bin" / "servegrid")
    subprocess.run([servegrid, "--config", config, "estimate", "--cores", "1", "--json", out], cwd=workdir, check=True)
    return json.loads((workdir / out).read_text())


def job_spans(log: str) -> dict[str, list[tuple[str, float, float]]]:
    """Per configuration: (rule, start, end) of each of its cell and top-up jobs, from Snakemake's log (seconds)."""
    starts: dict[str, tuple[str, str, float]] = {}
    spans: dict[str, list[tuple[str, float, float]]] = {}
    lines = log.splitlines()
    when = 0.0
    for i, line in enumerate(lines):
        stamp = STAMP.match(line.strip())
        if stamp:
            when = datetime.strptime(stamp.group(1), "%a %b %d %H:%M:%S %Y").timestamp()
            continue
        rule = JOB_RULE.match(line.strip())
        if rule and rule.group(1) in ("cell", "top_up"):
            block = "\n".join(lines[i : i + 8])
            output = re.search(r"output: results/(?:cells|top-ups/round\d+)/([^/]+)/", block)
            jobid = re.search(r"jobid: (\d+)", block)
            if output and jobid:
                starts[jobid.group(1)] = (rule.group(1), output.group(1), when)
        finished = re.match(r"Finished jobid: (\d+)", line.strip())
        if finished and finished.group(1) in starts:
            rule_name, configuration, began = starts.pop(finished.group(1))
            spans.setdefault(configuration, []).append((rule_name, began, when))
    return spans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="profiles/cpu-demo")
    parser.add_argument("--workdir", default="/tmp/estimate-accuracy")
    args = parser.parse_args()
    root = Path(args.workdir)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    workdir = copy_workflow(root)
    profile = yaml.safe_load((ROOT / args.profile / "config.yaml").read_text())
    config = profile["configfile"]
    snakemake = [str(ROOT / ".venv" / "bin" / "snakemake"), "--profile", args.profile]
    before = estimate(workdir, config, "estimate-before.json")
    calibrate_s = run(workdir, [*snakemake, "calibrate"])
    after = estimate(workdir, config, "estimate-after.json")
    logs = workdir / ".snakemake" / "log"
    known = set(logs.glob("*.log"))
    run_s = run(workdir, [*snakemake, "report"])
    (log_path,) = set(logs.glob("*.log")) - known
    spans = job_spans(log_path.read_text())
    print(table(before, after, spans, calibrate_s, run_s, args.profile))
    return 0


def table(before: dict, after: dict, spans: dict, calibrate_s: float, run_s: float, profile: str) -> str:
    def seconds(est: dict, name: str) -> tuple[float, float]:
        low, high = est["device_hours"][name]
        return low * 3600, high * 3600

    lines = [
        f"`{profile}`: calibration {calibrate_s:.0f} s for {len(after['device_hours'])} configuration(s); the run "
        f"{run_s:.0f} s",
        "",
        "| device time, s | estimate (assumed) | calibrated estimate | the run | inside | width |",
        "|---|---|---|---|---|---|",
    ]
    total_actual, total_low, total_high = 0.0, 0.0, 0.0
    for name in after["device_hours"]:
        jobs = spans.get(name, [])
        actual = max(end for _, _, end in jobs) - min(start for _, start, _ in jobs) if jobs else 0.0
        (b_low, b_high), (low, high) = seconds(before, name), seconds(after, name)
        total_actual, total_low, total_high = total_actual + actual, total_low + low, total_high + high
        lines.append(row(name, (b_low, b_high), (low, high), actual))
    lines.append(row("all", seconds_sum(before), (total_low, total_high), total_actual))
    b_wall, a_wall = before["wall_clock_s"], after["wall_clock_s"]
    lines.append(row("wall clock (run overhead assumed)", tuple(b_wall), tuple(a_wall), run_s))
    return "\n".join(lines)


def seconds_sum(est: dict) -> tuple[float, float]:
    return (
        sum(v[0] for v in est["device_hours"].values()) * 3600,
        sum(v[1] for v in est["device_hours"].values()) * 3600,
    )


def row(name: str, assumed: tuple[float, float], calibrated: tuple[float, float], actual: float) -> str:
    low, high = calibrated
    middle = (low + high) / 2
    width = (high - low) / 2 / middle if middle else 0.0
    inside = "yes" if low <= actual <= high else f"no ({actual / middle - 1:+.0%} from the middle)"
    estimates = f"{assumed[0]:.0f}-{assumed[1]:.0f} | {low:.0f}-{high:.0f}"
    return f"| {name} | {estimates} | {actual:.0f} | {inside} | ±{width:.0%} |"


if __name__ == "__main__":
    sys.exit(main())
