"""``servegrid``: every pipeline step by hand, outside Snakemake.

    servegrid validate                     check the config, list the grid
    servegrid preflight [NAME ...]         what the host and your engine would refuse, before any weights load
    servegrid estimate [--cores N]         the run's device hours and wall clock, as a range
    servegrid calibrate [NAME ...]         one short server session each: what their cells cost (estimate uses it)
    servegrid model build                  build the tiny model (model.tiny)
    servegrid server argv NAME             the exact command + environment a server gets
    servegrid server up NAME               start (or reuse) a server and keep it up
    servegrid server status | down NAME | down --all
    servegrid cell run CELL                measure one cell, e.g. prefix_cache/decode/ctx1024_c1
    servegrid aggregate | figures | report run the downstream stages on the cell files
    servegrid summary                      the verdict, invalid cells and report paths, as the run ends
    servegrid compare OLD NEW [--out DIR]  two runs' shared cells: what moved beyond noise

Every command takes ``--config FILE`` (default: config.yaml) and ``--log-level``, before or after its
name (``servegrid validate --config my.yaml``); ``servegrid --version`` prints the version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from servegrid import paths
from servegrid.config import CellSpec, Experiment
from servegrid.errors import ConfigError, guarded
from servegrid.paths import RunTables
from servegrid.pipeline import cli_planning, logging_setup
from servegrid.records.cell_spec import LOAD_PATTERN
from servegrid.serving import procs, server

CELL_RE = re.compile(rf"^(?P<configuration>[^/]+)/(?P<mode>[^/]+)/ctx(?P<context>\d+)_(?P<load>{LOAD_PATTERN})$")


def _runtime(experiment: Experiment, name: str) -> server.Runtime:
    return server.Runtime.from_config(experiment.operations, experiment.configuration(name))


def _parse_cell(experiment: Experiment, text: str) -> CellSpec:
    match = CELL_RE.match(text)
    if not match:
        raise ConfigError(f"'{text}' is not a cell id (CONFIGURATION/MODE/ctxCONTEXT_cSESSIONS or _rRATE)")
    return experiment.cell(match["configuration"], match["mode"], int(match["context"]), match["load"])


def cmd_validate(experiment: Experiment, args: argparse.Namespace) -> int:
    cells = experiment.cells()
    print(f"{experiment.source}: valid")
    for name in experiment.configurations:
        print(f"  {name}: {len(experiment.cells(name))} cells")
    print(f"  modes: {', '.join(experiment.modes())}; {len(cells)} cells in all")
    return 0


def cmd_model_build(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.serving import tiny_model

    tiny = experiment.tiny_model_spec()
    if tiny is None:
        raise ConfigError(f"{experiment.source}: model.tiny is not set; the model at model.path is yours")
    out = Path(args.out or experiment.model.path)
    python = tiny_model.engine_python(experiment.engine.command)
    hashes = tiny_model.build(out, tiny_model.TinyModelSpec(**tiny), python)
    print(json.dumps({"path": str(out), "files": hashes}, indent=2))
    return 0


def cmd_server_argv(experiment: Experiment, args: argparse.Namespace) -> int:
    runtime = _runtime(experiment, args.name)
    spec = experiment.launch_spec(args.name)
    port = args.port or runtime.port_range[0]
    argv, env = server.launch_command(spec, runtime, port)
    if args.json:
        print(json.dumps({"argv": argv, "env": env}, indent=2))
    else:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
    return 0


def cmd_server_up(experiment: Experiment, args: argparse.Namespace) -> int:
    runtime = _runtime(experiment, args.name)
    owner = procs.ProcessRef.of(args.owner_pid) if args.owner_pid else None
    with server.lease(args.name, runtime):  # as a cell does: no one starts or stops this server meanwhile
        facts = server.ensure(experiment.launch_spec(args.name), runtime, owner)
    print(json.dumps(asdict(facts), indent=2))
    return 0


def cmd_server_down(experiment: Experiment, args: argparse.Namespace) -> int:
    if args.all:
        outcomes = server.stop_all(
            server.Runtime.from_config(experiment.operations), reason="servegrid server down --all"
        )
    elif args.name:
        outcomes = server.stop(args.name, _runtime(experiment, args.name), reason="servegrid server down")
    else:
        raise ConfigError("name a configuration or pass --all")
    print(json.dumps(outcomes, indent=2))
    return 0


def cmd_server_status(experiment: Experiment, args: argparse.Namespace) -> int:
    rows = server.status(server.Runtime.from_config(experiment.operations))
    for row in rows:
        state = "up" if row["alive"] else "down"
        print(f"{row['configuration']:<20} {state:<5} {row['status']:<9} {row['url']}  log: {row['log_path']}")
    if not rows:
        print("no servers recorded")
    return 0


def cmd_cell_run(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.pipeline.cell_job import run_cell

    cell = _parse_cell(experiment, args.cell)
    out = args.out or (cell.top_up_path(args.top_up) if args.top_up else cell.path)
    runtime = _runtime(experiment, cell.configuration)
    try:
        # Owned by this command unless it is to stay up (then 'servegrid server down' stops it).
        owner = None if args.keep_server else procs.ProcessRef.of(os.getpid())
        meta = run_cell(experiment, cell, out, owner=owner, top_up_round=args.top_up or 0)
    finally:
        if not args.keep_server:
            server.stop(cell.configuration, runtime, reason="servegrid cell run finished")
    print(f"wrote {out} ({meta.duration_s or 0.0:.1f} s measured)")
    return 0


def _grid_cells_present(experiment: Experiment) -> list[str]:
    present = [c.path for c in experiment.cells() if Path(c.path).exists()]
    if not present:
        raise ConfigError("no cell files of this grid exist yet; run cells first")
    return present


def cmd_decide(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.analysis import top_ups

    if experiment.top_up_rounds is None:
        raise ConfigError("servegrid decide: rounds of decisions run under sampling.policy: verdict only")
    files = top_ups.CellFiles(_grid_cells_present(experiment), top_ups.top_ups_decided(experiment, args.round))
    decision = top_ups.decide_round(experiment, args.round, files, paths.decision(args.round))
    for group in decision["groups"]:
        print(f"{group['mode']} ctx {group['context']} × {group['concurrency']}: {group['state']}")
    print(f"top up in round {args.round}: " + (", ".join(decision["top_up"]) or "nothing"))
    return 0


def cmd_aggregate(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.analysis import aggregation, top_ups

    rounds = experiment.top_up_rounds
    decided = [k for k in range(1, (rounds or 0) + 2) if Path(paths.decision(k)).exists()]
    last = max(decided, default=0)
    summary = aggregation.aggregate(
        experiment,
        _grid_cells_present(experiment),
        RunTables(),
        top_up_files=[f for f in top_ups.top_ups_decided(experiment, last) if Path(f).exists()] if last else [],
        decisions=paths.decision(last) if last else None,
    )
    print(f"{len(summary)} cells → {RunTables().summary}")
    return 0


def cmd_figures(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.reporting import figures

    for lang in experiment.languages:
        for path in figures.draw_all(experiment, RunTables(), Path(paths.FIGURES_LANG_DIR.format(lang=lang)), lang):
            print(path)
    return 0


def cmd_report(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.reporting import document

    formats = args.format or experiment.report_formats
    for lang in args.lang or experiment.languages:
        html = paths.REPORT_PATTERN.format(lang=lang, ext="html") if "html" in formats else None
        pdf = paths.REPORT_PATTERN.format(lang=lang, ext="pdf") if "pdf" in formats else None
        document.render(experiment, lang, RunTables(), Path(paths.FIGURES_LANG_DIR.format(lang=lang)), html, pdf)
        print("\n".join(written for written in (html, pdf) if written))
    return 0


def _version() -> str:
    try:
        return metadata.version("servegrid")
    except metadata.PackageNotFoundError:  # run from a checkout without installing it
        return "unknown (not installed)"


def cmd_summary(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.reporting import terminal_summary

    print(terminal_summary.text(experiment))
    return 0


def cmd_compare(experiment: Experiment, args: argparse.Namespace) -> int:
    from servegrid.reporting import run_comparison

    frame = run_comparison.compare_runs(args.old, args.new, experiment.verdict.min_factor)
    print(run_comparison.text(frame, args.old, args.new))
    if args.out:
        for lang in args.lang or experiment.languages:
            page = Path(args.out) / f"compare-{lang}.html"
            run_comparison.write_html(frame, args.old, args.new, lang, page)
            print(page)
    return 0


def build_parser() -> argparse.ArgumentParser:
    # --config and --log-level go before the subcommand or after it ("servegrid validate --config my.yaml"):
    # each subcommand takes them too, with no default of its own, so that one given after it wins.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help="experiment config (default: config.yaml)")
    common.add_argument("--log-level", default=argparse.SUPPRESS, help="override operations.log_level")
    parser = argparse.ArgumentParser(
        prog="servegrid", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="config.yaml", help="experiment config (default: config.yaml)")
    parser.add_argument("--log-level", default=None, help="override operations.log_level")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(group: Any, name: str, help_text: str) -> argparse.ArgumentParser:
        command: argparse.ArgumentParser = group.add_parser(name, help=help_text, parents=[common])
        return command

    add(sub, "validate", "validate the config and list the grid").set_defaults(func=cmd_validate)
    cli_planning.add_commands(sub, add)

    model_p = add(sub, "model", "the tiny CPU model").add_subparsers(dest="action", required=True)
    build_p = add(model_p, "build", "build the tiny model folder")
    build_p.add_argument("--out", help="folder (default: model.path)")
    build_p.set_defaults(func=cmd_model_build)

    srv = add(sub, "server", "bring servers up and down").add_subparsers(dest="action", required=True)
    argv_p = add(srv, "argv", "print the exact command and environment of a configuration's server")
    argv_p.add_argument("name")
    argv_p.add_argument("--port", type=int)
    argv_p.add_argument("--json", action="store_true")
    argv_p.set_defaults(func=cmd_server_argv)
    up_p = add(srv, "up", "start (or reuse) a configuration's server; it stays up until 'down'")
    up_p.add_argument("name")
    up_p.add_argument("--owner-pid", type=int, help="stop the server when this process exits")
    up_p.set_defaults(func=cmd_server_up)
    down_p = add(srv, "down", "stop a configuration's server, or all")
    down_p.add_argument("name", nargs="?")
    down_p.add_argument("--all", action="store_true")
    down_p.set_defaults(func=cmd_server_down)
    add(srv, "status", "list recorded servers").set_defaults(func=cmd_server_status)

    _add_cell_commands(sub, add)

    add(sub, "aggregate", "cell files → Parquet tables").set_defaults(func=cmd_aggregate)
    add(sub, "figures", "summary → figures").set_defaults(func=cmd_figures)
    rep_p = add(sub, "report", "tables + figures → HTML and PDF reports")
    rep_p.add_argument("--lang", action="append", help="language (repeatable; default: report.languages)")
    rep_p.add_argument(
        "--format", action="append", choices=["html", "pdf"], help="(repeatable; default: report.formats)"
    )
    rep_p.set_defaults(func=cmd_report)
    add(sub, "summary", "the verdict, invalid cells and report paths as text").set_defaults(func=cmd_summary)
    cmp_p = add(sub, "compare", "two runs' shared cells: how far each primary figure moved, beyond noise or not")
    cmp_p.add_argument("old", help="the earlier run's results folder (or its tables/ folder)")
    cmp_p.add_argument("new", help="the later run's results folder")
    cmp_p.add_argument("--out", help="also write compare-LANG.html pages into this folder")
    cmp_p.add_argument("--lang", action="append", help="page language (repeatable; default: report.languages)")
    cmp_p.set_defaults(func=cmd_compare)
    return parser


def _add_cell_commands(sub: Any, add: Any) -> None:
    cell_p = add(sub, "cell", "measure cells").add_subparsers(dest="action", required=True)
    run_p = add(cell_p, "run", "measure one cell")
    run_p.add_argument("cell", help="CONFIGURATION/MODE/ctxCONTEXT_cCONCURRENCY")
    run_p.add_argument("--out", help=f"output file (default: {paths.CELL_PATTERN})")
    run_p.add_argument("--keep-server", action="store_true", help="leave the server up for the next cell")
    run_p.add_argument("--top-up", type=int, metavar="ROUND", help="measure the cell's top-up of this round")
    run_p.set_defaults(func=cmd_cell_run)
    decide_p = add(sub, "decide", "sampling.policy verdict: a round's decisions from the cells and earlier top-ups")
    decide_p.add_argument("round", type=int)
    decide_p.set_defaults(func=cmd_decide)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def command() -> int:
        experiment = Experiment.from_file(args.config)
        logging_setup.configure(args.log_level or experiment.operations.log_level)
        return int(args.func(experiment, args))

    try:
        return guarded(command)
    except BrokenPipeError:  # `servegrid compare … | head`: the reader has gone, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
