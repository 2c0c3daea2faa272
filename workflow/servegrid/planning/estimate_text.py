"""What ``servegrid estimate`` prints and writes: the estimate as a table of device hours per configuration and mode,
the wall clock for some ``--cores``, and the same as JSON."""

from __future__ import annotations

from typing import Any

from servegrid.planning.cost_model import ZERO, Estimate


def text(est: Estimate, cores: int | None) -> str:
    advice = len(est.groups)
    lines = ["configuration     mode          cells   device hours        basis"]
    for name in est.gpus:
        for mode in dict.fromkeys(c.cell.mode for c in est.cells if c.cell.configuration == name):
            own = [c for c in est.cells if c.cell.configuration == name and c.cell.mode == mode]
            hours = sum((c.total for c in own), ZERO).scaled(max(1, est.gpus[name]) / 3600)
            bases = ", ".join(sorted({c.basis for c in own}))
            lines.append(f"{name:17} {mode:13} {len(own):5}   {hours.low:6.2f}-{hours.high:<7.2f}   {bases}")
    total = sum((est.device_hours(n) for n in est.gpus), ZERO)
    kind = "GPU" if any(est.gpus.values()) else "host"
    lines.append(f"{kind} hours in all (server start-ups included): {total.low:.1f}-{total.high:.1f}")
    for n in sorted({advice, cores or advice, 1}):
        wall = est.wall_clock(n)
        lines.append(
            f"wall clock with --cores {n}: {_duration(wall.low)} to {_duration(wall.high)}"
            + (" (advised: one job per device group)" if n == advice else "")
        )
    groups = "; ".join(" → ".join(g) for g in est.groups)
    lines.append(f"run one after another (a device in common): {groups}")
    # What the estimate rests on: the config's assumed speeds, an earlier run, each calibration (or refusal).
    lines += [f"priced from: {note}" for note in est.assumptions]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


def as_json(est: Estimate, cores: int) -> dict[str, Any]:
    return {
        "cells": [
            {"cell": c.cell.id, "measuring_s": [c.measuring.low, c.measuring.high], "basis": c.basis} for c in est.cells
        ],
        "device_hours": {n: [est.device_hours(n).low, est.device_hours(n).high] for n in est.gpus},
        "wall_clock_s": [est.wall_clock(cores).low, est.wall_clock(cores).high],
        "cores": cores,
        "groups": est.groups,
    }
