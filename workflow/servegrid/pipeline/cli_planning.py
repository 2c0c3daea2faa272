"""``servegrid preflight`` and ``servegrid estimate``: the commands before a run (:mod:`servegrid.planning`),
registered on the ``servegrid`` parser by :func:`add_commands`."""

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
