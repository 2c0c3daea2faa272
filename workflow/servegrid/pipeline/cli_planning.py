"""``servegrid preflight``, ``servegrid estimate``, ``servegrid calibrate`` and ``servegrid trace``: the commands
before a run (:mod:`servegrid.planning`; the calibration pass, servegrid.pipeline.calibration_pass; a replayed trace,
servegrid.modes.trace_source), registered on the ``servegrid`` parser by :func:`add_commands`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servegrid import atomic, paths
from servegrid.config import Experiment
from servegrid.errors import ConfigError
from servegrid.records.calibration_file import Calibration


def cmd_preflight(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.planning import preflight

    report = preflight.run(experiment, args.names or None, probe=not args.no_engine)
    print(report.text())
    if args.json:
        atomic.write_json(args.json, report.as_json())
    return 1 if report.errors else 0


def cmd_estimate(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.planning import estimate, estimate_text

    if args.calibrate:
        calibrations = calibrate_configurations(experiment, list(experiment.configurations), force=False)
    else:
        calibrations = estimate.current_calibrations(experiment)
    est = estimate.estimate(experiment, Path(args.results), calibrations)
    print(estimate_text.text(est, args.cores))
    if args.json:
        atomic.write_json(args.json, estimate_text.as_json(est, args.cores or len(est.groups)))
    return 0


def cmd_calibrate(experiment: Experiment, args: argparse.Namespace) -> int:
    names = args.names or list(experiment.configurations)
    unknown = sorted(set(names) - set(experiment.configurations))
    if unknown:
        raise ConfigError(
            f"no configuration named {', '.join(unknown)} (the config has {', '.join(experiment.configurations)})"
        )
    calibrate_configurations(experiment, names, force=args.force)
    return 0


def calibrate_configurations(experiment: Experiment, names: list[str], force: bool) -> dict[str, Calibration]:
    """Calibrate each of ``names`` whose calibration is missing or of another server spec (all, with ``force``), one
    after another, each on a server session of its own that this process owns; returns every current calibration."""
    from servegrid.pipeline import calibration_pass
    from servegrid.planning import estimate
    from servegrid.serving import procs

    current = {} if force else estimate.current_calibrations(experiment)
    for name in names:
        path = paths.calibration_path(name)
        if name in current:
            print(f"{name}: calibrated for this server spec ({path}, {current[name].measured_at}); --force redoes it")
            continue
        done = calibration_pass.calibrate(experiment, name, path, owner=procs.ProcessRef.of(os.getpid()))
        if done.refused:
            print(f"{name}: refused by its engine ({done.refused}), after {done.startup_s:.0f} s ({path})")
        else:
            print(f"{name}: calibrated, {len(done.probes)} probes, start {done.startup_s:.0f} s ({path})")
        current[name] = done
    return current


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
        raise ConfigError(
            f"--window {args.window!r}: workloads.{args.mode} has the windows "
            f"{', '.join(repr(w) for w in replays) or 'none'} ('': the whole trace)"
        )
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
    est_p.add_argument(
        "--calibrate", action="store_true", help="first calibrate each configuration not calibrated for its server spec"
    )
    est_p.set_defaults(func=cmd_estimate)
    cal_p = add(sub, "calibrate", "measure what each configuration's cells cost, on one short server session each")
    cal_p.add_argument("names", nargs="*", metavar="NAME", help="configurations (default: all)")
    cal_p.add_argument("--force", action="store_true", help="calibrate again even where the server spec is unchanged")
    cal_p.set_defaults(func=cmd_calibrate)
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
