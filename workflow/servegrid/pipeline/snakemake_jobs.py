"""Glue between Snakemake ``script:`` jobs and the package.

Each function takes the ``snakemake`` object a script job receives, sends
logging to the rule's ``log:`` file, and calls the same package functions the
CLI calls. An expected failure (any :class:`~servegrid.errors.ServegridError`)
ends the job with its message alone, caught by :func:`servegrid.errors.guarded`
as in the CLI, so the terminal and the job's log show the same text.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from servegrid import atomic, paths
from servegrid.config import Experiment, plan
from servegrid.errors import ConfigError, guarded
from servegrid.paths import RunTables
from servegrid.pipeline import logging_setup
from servegrid.records import table_format
from servegrid.serving import server


def _setup_logging(smk: Any) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if smk.log:
        Path(smk.log[0]).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(smk.log[0], mode="w"))
    logging_setup.configure("INFO", handlers)


def _run(smk: Any, body: Callable[[Experiment], None]) -> None:
    # Logging first, so that even an invalid config is reported in the job's log.
    _setup_logging(smk)

    def job() -> None:
        note = plan.edited_note(os.environ)
        if note:
            logging.getLogger("servegrid").warning("%s", note)
        experiment = Experiment(smk.config)
        logging.getLogger().setLevel(experiment.operations.log_level)
        logging_setup.quiet_libraries()
        body(experiment)

    code = guarded(job, logging.getLogger("servegrid"))
    if code:
        sys.exit(code)


def write_spec(smk: Any) -> None:
    from servegrid.planning import preflight

    def body(experiment: Experiment) -> None:
        name = smk.wildcards.configuration
        report_path = paths.PREFLIGHT_PATTERN.format(configuration=name)
        if experiment.operations.preflight:
            report = preflight.run(experiment, [name])
            for line in report.text().splitlines():
                logging.getLogger("servegrid").info("%s", line)
            atomic.write_json(report_path, report.as_json())
            report.raise_for_errors()  # before this configuration's server loads its weights; names the key
        else:
            logging.getLogger("servegrid").info("preflight skipped (operations.preflight: false)")
            atomic.write_json(report_path, {"skipped": True})
        atomic.write_json(smk.output[0], json.loads(smk.params.spec))

    _run(smk, body)


def run_cell(smk: Any) -> None:
    from servegrid.pipeline.cell_job import run_cell as measure

    def body(experiment: Experiment) -> None:
        wc = smk.wildcards
        cell = experiment.cell(wc.configuration, wc.mode, int(wc.context), wc.load)
        written = json.loads(Path(smk.input.spec).read_text(encoding="utf-8"))
        if written != experiment.public_launch_spec(cell.configuration):
            raise ConfigError(f"{smk.input.spec} does not match the configuration; rerun its server_spec job")
        # spec.json has its secrets masked; the server is launched with the real ones.
        top_up_round = int(getattr(wc, "round", 0) or 0)  # the top_up rule's jobs: a round of the cell's top-ups
        measure(experiment, cell, smk.output[0], owner=server.owner_from_env(), top_up_round=top_up_round)

    _run(smk, body)


def calibrate(smk: Any) -> None:
    from servegrid.pipeline import calibration_pass

    def body(experiment: Experiment) -> None:
        name = smk.wildcards.configuration
        written = json.loads(Path(smk.input.spec).read_text(encoding="utf-8"))
        if written != experiment.public_launch_spec(name):
            raise ConfigError(f"{smk.input.spec} does not match the configuration; rerun its server_spec job")
        calibration_pass.calibrate(experiment, name, smk.output[0], owner=server.owner_from_env())

    _run(smk, body)


def stop_server(smk: Any) -> None:
    def body(experiment: Experiment) -> None:
        name = smk.wildcards.configuration
        runtime = server.Runtime.from_config(experiment.operations, experiment.configuration(name))
        stopped = server.stop(name, runtime, reason="last cell of the configuration done")
        stopped_at = datetime.now(UTC).isoformat(timespec="milliseconds")
        atomic.write_json(smk.output[0], {"configuration": name, "stopped_at": stopped_at, "stopped": stopped})

    _run(smk, body)


def build_model(smk: Any) -> None:
    from servegrid.serving import tiny_model

    def body(experiment: Experiment) -> None:
        fields = experiment.tiny_model_spec()
        assert fields is not None, "build_model runs only for a config with model.tiny"
        spec = tiny_model.TinyModelSpec(**fields)
        tiny_model.build(Path(smk.output[0]), spec, tiny_model.engine_python(experiment.engine.command))

    _run(smk, body)


def decide_round(smk: Any) -> None:
    from servegrid.analysis import top_ups

    def body(experiment: Experiment) -> None:
        cells = top_ups.CellFiles(list(smk.input.cells), list(smk.input.top_ups))
        top_ups.decide_round(experiment, int(smk.wildcards.round), cells, smk.output[0])

    _run(smk, body)


def aggregate(smk: Any) -> None:
    from servegrid.analysis import aggregation

    def body(experiment: Experiment) -> None:
        top_up_files = list(getattr(smk.input, "top_ups", []) or [])
        decisions = list(getattr(smk.input, "decisions", []) or [])
        aggregation.aggregate(
            experiment,
            list(smk.input.cells),
            RunTables.from_named(smk.output),
            top_up_files=top_up_files,
            decisions=decisions[0] if decisions else None,
        )

    _run(smk, body)


def figures(smk: Any) -> None:
    from servegrid.reporting import figures as drawing

    def body(experiment: Experiment) -> None:
        drawing.draw_all(experiment, RunTables.from_named(smk.input), Path(smk.params.out_dir), smk.wildcards.lang)

    _run(smk, body)


def render_report(smk: Any) -> None:
    from servegrid.reporting import document

    def body(experiment: Experiment) -> None:
        out = smk.output[0]  # report_html or report_pdf: one document per job
        document.render(
            experiment,
            smk.wildcards.lang,
            RunTables.from_named(smk.input),
            Path(smk.params.figures_dir),
            html_out=out if out.endswith(".html") else None,
            pdf_out=out if out.endswith(".pdf") else None,
        )

    _run(smk, body)


def export(smk: Any) -> None:

    from servegrid.reporting import interchange as exports

    def body(experiment: Experiment) -> None:
        requests, summary = table_format.read(smk.input.requests), table_format.read(smk.input.summary)
        exports.write_bench_results(requests, summary, smk.params.model, Path(smk.output.bench))
        exports.write_csv(summary, smk.output.summary_csv)
        exports.write_csv(requests, smk.output.requests_csv)

    _run(smk, body)
