"""The calibration pass (``servegrid calibrate``, ``servegrid estimate --calibrate``, the Snakemake target
``calibrate``): per configuration, one short server session that measures what its cells will cost, so that
``servegrid estimate`` can price the run from measurements (servegrid.planning.calibrated).

The session measures a few probes, cells of the grid itself run by the cell job's own code to a fixed count
(:data:`PROBE_SAMPLES`, within the cell's time limit and :data:`PROBE_LIMIT_S`): per closed-loop mode with a
sequential rule, its lightest cell (shortest context, fewest sessions) and its heaviest (longest context, most
sessions). So the probes measure per-session decode at one session and at the grid's highest load, prefill at the
longest context (cached, where the configuration caches prefixes and the mode reuses them), the spread of each mode's
primary figure, and what a cell job takes beyond measuring. The server's start (and warm-up) is the session's own,
and a cell job's interpreter start is timed (the median of three). The server is stopped at the end: the session is the
calibration's. The result is written beside the server spec (servegrid.records.calibration_file) with the spec's
hash: only a new spec makes it stale.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import servegrid
from servegrid import modes
from servegrid.config import CellSpec, Experiment, spec_hash
from servegrid.errors import CellError, EngineRefused
from servegrid.pipeline import slurm
from servegrid.pipeline.cell_job import run_cell
from servegrid.records import calibration_file, cell_file, per_request
from servegrid.records.calibration_file import Calibration, Probe
from servegrid.records.cell_settings import CellSettings
from servegrid.records.cell_spec import Rate, Replay
from servegrid.serving import procs, server
from servegrid.stats.sampling import MIN_SAMPLES_FLOOR

log = logging.getLogger(__name__)

PROBE_SAMPLES = 2 * MIN_SAMPLES_FLOOR  # 16: enough for the stopping interval, twice over
PROBE_LIMIT_S = 20.0  # a probe's measured phase at most (the cell's own limit, if lower, applies)


def probe_cells(experiment: Experiment, configuration: str) -> list[CellSpec]:
    """The configuration's probes: per closed-loop mode with a sequential rule, its lightest and heaviest cell. A grid
    without such cells (open loop only: their time is their schedule) probes its shortest open-loop cell, for what a
    cell job costs beyond its schedule."""
    cells = experiment.cells(configuration)
    closed = [c for c in cells if not c.open_loop and experiment.sampling_rules.get(c.mode) is not None]
    probes: list[CellSpec] = []
    for mode in dict.fromkeys(c.mode for c in closed):
        own = sorted((c for c in closed if c.mode == mode), key=lambda c: (c.context, c.sessions or 1))
        probes += list(dict.fromkeys((own[0], own[-1])))
    open_loop = [c for c in cells if c.open_loop]
    if not probes and open_loop:
        probes.append(min(open_loop, key=lambda c: schedule_s(experiment, c)))
    return probes


def schedule_s(experiment: Experiment, cell: CellSpec) -> float:
    """An open-loop cell's arrival schedule: its ramp and its measured arrivals at the offered rate, every repeat."""
    settings = CellSettings(experiment.cell_settings(cell))
    window = settings.open_loop_window
    assert isinstance(cell.load, Rate | Replay)  # open loop
    return settings.repeats * (float(window["ramp_s"]) + int(window["requests"]) / cell.load.per_s)


def probe_settings(experiment: Experiment, cell: CellSpec) -> dict[str, Any]:
    """The cell's settings, measured to :data:`PROBE_SAMPLES` once (no repeats), marked as a calibration's (an
    open-loop cell's unchanged but for the mark)."""
    settings = experiment.cell_settings(cell)
    if settings["sampling"]["rule"] is None:  # an open-loop cell: its schedule, as the grid has it
        return settings | {"calibration": True}
    rule = dict(settings["sampling"]["rule"])
    rule.update(
        min_samples=PROBE_SAMPLES,
        max_samples=PROBE_SAMPLES,
        max_duration_s=min(float(rule["max_duration_s"]), PROBE_LIMIT_S),
    )
    workload = dict(settings["workload"]) | ({"repeats": 1} if "repeats" in settings["workload"] else {})
    return settings | {"sampling": {**settings["sampling"], "rule": rule}, "workload": workload, "calibration": True}


def time_limit_s(experiment: Experiment, configuration: str) -> float:
    """The longest a calibration may take (a cluster job's time limit): the server's start, every probe at its
    limit with a cell job's overhead, and the stop."""
    operations = experiment.operations
    probing = sum(
        # An open-loop probe lasts its schedule, then its last requests' answers (each within the request timeout).
        (schedule_s(experiment, cell) + operations.request_timeout_s if cell.open_loop else PROBE_LIMIT_S)
        + slurm.CELL_OVERHEAD_S
        for cell in probe_cells(experiment, configuration)
    )
    return operations.startup_timeout_s + probing + operations.shutdown_timeout_s


def calibrate(
    experiment: Experiment,
    configuration: str,
    out_path: Path | str,
    owner: procs.ProcessRef | None,
    runtime: server.Runtime | None = None,
) -> Calibration:
    """Measure ``configuration``'s probes on one server session, stop it, write the calibration to ``out_path``."""
    spec = experiment.launch_spec(configuration)
    runtime = runtime or server.Runtime.from_config(experiment.operations, experiment.configuration(configuration))
    measured_at = datetime.now(UTC).isoformat(timespec="seconds")
    cells = probe_cells(experiment, configuration)
    if not cells:
        raise CellError(f"calibration of {configuration}: the grid has no cell to probe (closed loop, sequential rule)")
    probes: list[Probe] = []
    refused = None
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    session_started = time.monotonic()
    try:
        # Up first, so that each probe's job time is a reused server's, as for every cell but a run's first.
        with server.lease(configuration, runtime):
            facts = server.ensure(spec, runtime, owner)
        startup_s = facts.startup_s + facts.warmup_s
        with tempfile.TemporaryDirectory(prefix=".calibration-", dir=Path(out_path).parent) as scratch:
            for cell in cells:
                started = time.monotonic()
                path = Path(scratch) / f"{cell.mode}-{cell.context}-{cell.sessions}.parquet"
                done = run_cell(experiment, cell, path, owner, spec, runtime, settings=probe_settings(experiment, cell))
                if done.refused:  # the engine died of its own error in a cell: its cells will be written as refused
                    refused = done.refused
                    break
                probes.append(_probe(cell, path, time.monotonic() - started))
                log.info("calibration %s: probe %s, %s", configuration, cell.id, _said(probes[-1]))
    except EngineRefused as exc:
        # The engine refuses this configuration (it died of the same error at its first request on two starts), so
        # the run will write its cells as refused: what that costs is the two starts, then a job start per cell.
        refused, startup_s = exc.reason, time.monotonic() - session_started
    finally:
        server.stop(configuration, runtime, reason="calibration done")
    if refused:
        log.warning(
            "calibration %s: refused by its engine (%s); its cells will be written as refused", configuration, refused
        )
    calibration = Calibration(
        configuration=configuration,
        spec_hash=spec_hash(spec),
        measured_at=measured_at,
        startup_s=startup_s,
        job_start_s=job_start_s(),
        probes=[] if refused else probes,
        refused=refused,
    )
    calibration_file.write(out_path, calibration)
    return calibration


def _probe(cell: CellSpec, path: Path, job_s: float) -> Probe:
    table, record = cell_file.read_cell(path)
    frame = per_request.derive(table.to_pandas())
    primary = modes.get(cell.mode).primary
    values = [float(v) for v in primary.rows(frame)[primary.column].dropna()]
    sessions = cell.sessions or 1
    return Probe(
        mode=cell.mode,
        context=cell.context,
        concurrency=sessions,
        rounds=max(1, math.ceil(len(values) / sessions)),  # one primary value per unit (a request, a conversation)
        measuring_s=float(record.duration_s or 0.0),
        job_s=job_s,
        values=values,
    )


def _said(probe: Probe) -> str:
    measured = f"{len(probe.values)} values in {probe.measuring_s:.1f} s ({probe.round_s:.2f} s a round)"
    return f"{measured}, job {probe.job_s:.1f} s"


def job_start_s(times: int = 3) -> float:
    """A cell job's interpreter start: Python with what a cell job imports (Snakemake's script wrapper, servegrid's
    cell job), timed in fresh processes; the median of ``times``. (One timing was the first import from a cold page
    cache: 5.8 s against 2.4-2.7 s for the other configurations of the same run, 2026-12-07.)"""
    package_root = Path(servegrid.__file__).resolve().parents[1]  # as the job's script puts it on sys.path
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(package_root), os.environ.get("PYTHONPATH")]))}
    timings = []
    for _ in range(times):
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-c", "import snakemake.script, servegrid.pipeline.cell_job"], check=True, env=env
        )
        timings.append(time.monotonic() - started)
    return statistics.median(timings)
