"""``servegrid preflight``, ``servegrid estimate`` and ``servegrid trace``: the commands before a run
(:mod:`servegrid.planning`; a replayed trace, servegrid.modes.trace_source), registered on the ``servegrid`` parser
by :func:`add_commands`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servegrid import atomic, paths
from servegrid.config import Experiment


def cmd_preflight(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.planning import preflight

    report = preflight.run(experiment, args.names or None, probe=not args.no_engine)
    print(report.text())
    if args.json:
        atomic.write_json(args.json, report.as_json())
    return 1 if report.errors else 0


def cmd_estimate(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.planning import estimate

    est = estimate.estimate(experiment, Path(args.results))
    print(estimate.text(est, args.cores))
    if args.json:
        atomic.write_json(args.json, estimate.as_json(est, args.cores or len(est.groups)))
    return 0


def cmd_trace(experiment: Experiment, args: argparse.Namespace) -> int:
    import json

    from servegrid.errors import ConfigError
    from servegrid.modes import trace_source

    workload = experiment.workload(args.mode)
    # Each window's cells: what they replay (the window, then its drain).
    replays = {label: trace_source.replayed(w) for label, w in workload.windows.items()}
    if args.action == "show":
        shown: dict[str, Any] = {"trace": trace_source.describe(trace_source.whole(workload.settings))}
        if replays:
            shown["windows"] = {
                label or "whole trace": trace_source.describe(r.window) | {"drain_arrivals": len(r.drain)}
                for label, r in replays.items()
            }
        print(json.dumps(shown, indent=2, ensure_ascii=False))
        return 0
    if args.window is None:
        trace = trace_source.whole(workload.settings)
    elif args.window in replays:
        trace = replays[args.window].sent
    else:
        raise ConfigError(f"--window {args.window!r}: workloads.{args.mode} has the windows "
                          f"{', '.join(repr(w) for w in replays) or 'none'} ('': the whole trace)")  # fmt: skip
    if args.out:
        atomic.write_text(args.out, trace_source.to_jsonl(trace))
        print(args.out)
    else:
        print(trace_source.to_jsonl(trace), end="")
    return 0


def add_commands(sub: Any, add: Callable[[Any, str, str], argparse.ArgumentParser]) -> None:
    pre_p = add(sub, "preflight", "check each configuration with your engine's own parser, the checkpoint and the host")
    pre_p.add_argument("names", nargs="*", metavar="NAME", help="configurations (default: all)")
    pre_p.add_argument("--no-engine", action="store_true", help="skip your engine's own checks")
    pre_p.add_argument("--json", help="also write the findings to this file")
    pre_p.set_defaults(func=cmd_preflight)
    est_p = add(sub, "estimate", "the run's device hours and wall clock, as a range, before it starts")
    est_p.add_argument("--results", default=paths.RESULTS, help="an earlier run's results (its measured cells)")
    est_p.add_argument("--cores", type=int, help="the --cores you will give Snakemake (default: the advice)")
    est_p.add_argument("--json", help="also write the estimate to this file")
    est_p.set_defaults(func=cmd_estimate)
    trace_p = add(sub, "trace", "the trace a trace mode replays, and each of its windows as the cells see it")
    trace_sub = trace_p.add_subparsers(dest="action", required=True)
    show_p = add(trace_sub, "show", "its size, pace, lengths and hash")
    write_p = add(trace_sub, "write", "as Mooncake JSONL (the generated one too), to stdout or --out")
    write_p.add_argument("--out", help="file to write (atomically)")
    write_p.add_argument(
        "--window",
        help="what one window's cells send (its label, w600+300; '': the whole trace's "
        "cells), its drain included (default: the whole trace)",
    )
    for p in (show_p, write_p):
        p.add_argument("--mode", default="trace", help="the workload mode (default: trace)")
        p.set_defaults(func=cmd_trace)
