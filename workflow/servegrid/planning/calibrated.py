"""A cell priced from its configuration's calibration (servegrid.records.calibration_file): the measured seconds per
round of the nearest probe of its mode, scaled to the cell by the two cells' token costs, and the number of rounds
its sampling rule will take, forecast from the probe's spread (servegrid.stats.sample_forecast); around it, what a
cell job took beyond measuring, and the server's measured start.

The range is the forecast's 10th to 90th percentile of measuring seconds (the spread of the sample count), plus the
probes' spread of per-job overhead. What no calibration sees is assumed, and said so: Snakemake's own time per job
(:data:`SNAKEMAKE_JOB_S`) and the run's fixed cost (``estimate.run_overhead_s``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

from servegrid.config import CellSpec, Experiment
from servegrid.planning.cost_model import ZERO, CellEstimate, Range, unit_seconds
from servegrid.records.calibration_file import Calibration, Probe
from servegrid.records.cell_spec import Sessions
from servegrid.stats.sample_forecast import measuring_time

# Snakemake's own time between two cell jobs, beyond the job's interpreter start (which the calibration times): on the
# CPU demo (2026-12-07, 30 cells) a cell job's Snakemake span was its own wall time plus 2.65 s on average, about the
# interpreter start the calibration measured (2.9-3.5 s), and the next job started 0.3 s after the last one ended (the
# log's 1 s resolution). Elsewhere an assumption.
SNAKEMAKE_JOB_S = Range(0.0, 1.0)
# A calibration times one start; the same server's later starts differ. On the CPU demo (2026-12-07, vLLM's CPU build,
# two runs of benchmarks/estimate_accuracy.py, six pairs) a run's start was 0.64-1.19 times its calibration's: the run
# after a calibration started faster in five of six (guess, not checked: caches the first start fills). Assumed within
# 0.6 and 1.2 times the measured start.
STARTUP_SPREAD = (0.6, 1.2)


def nearest_probe(calibration: Calibration, cell: CellSpec) -> Probe | None:
    """The probe of the cell's mode nearest to it in context and sessions (log distance); None: no probe of it."""
    own = [p for p in calibration.probes if p.mode == cell.mode and p.values]
    if not own:
        return None
    sessions, context = cell.sessions or 1, max(cell.context, 1)  # a trace's cells have context 0
    return min(own, key=lambda p: abs(math.log(max(p.context, 1) / context)) + abs(math.log(p.concurrency / sessions)))


def cell_estimate(
    experiment: Experiment,
    cell: CellSpec,
    calibration: Calibration,
    slow: Mapping[str, float],
    top_up_rounds: int | None,
) -> CellEstimate | None:
    """The cell priced from ``calibration``; None where it has no probe of the cell's mode (or the cell has no
    sequential rule, or is open-loop: their time is their count or schedule)."""
    if calibration.refused:
        # The run writes the cell as refused at once (the refusal is recorded for the run after its first cell's
        # two starts, servegrid.serving.server): a job's own cost, no measuring.
        return CellEstimate(cell, ZERO, job_overhead(calibration), "refused by its engine (calibration)")
    rule = experiment.sampling_rules.get(cell.mode)
    if rule is None or cell.open_loop:
        return None
    probe = nearest_probe(calibration, cell)
    if probe is None:
        return None
    probed = CellSpec(cell.configuration, cell.mode, probe.context, Sessions(probe.concurrency))
    # The token costs' ratio at the assumed speeds: what the probe's round time becomes at this cell's lengths.
    round_s = probe.round_s * unit_seconds(experiment, cell, slow) / unit_seconds(experiment, probed, slow)
    repeats = int(experiment.workloads[cell.mode].settings.get("repeats") or 1)
    forecast = measuring_time(probe.values, rule, cell.sessions or 1, round_s, seed=zlib.crc32(cell.id.encode()))
    measuring = Range(forecast.low_s, forecast.high_s).scaled(repeats)
    overhead = job_overhead(calibration)
    basis = f"calibration ({probe.mode} ctx{probe.context} c{probe.concurrency})"
    if top_up_rounds:
        runs = 1 + top_up_rounds
        measuring, overhead = Range(measuring.low, measuring.high * runs), Range(overhead.low, overhead.high * runs)
        basis += f", first pass + up to {top_up_rounds} top-ups"
    return CellEstimate(cell, measuring, overhead, basis)


def job_overhead(calibration: Calibration) -> Range:
    """A cell job's time beyond measuring: its interpreter start, the probes' reuse check, warm-up, prompts and file
    (their lowest and highest), and Snakemake's own (assumed)."""
    extra = [max(0.0, p.job_s - p.measuring_s) for p in calibration.probes] or [0.0]
    return Range(calibration.job_start_s + min(extra), calibration.job_start_s + max(extra)) + SNAKEMAKE_JOB_S


def startup(calibration: Calibration) -> Range:
    """One server start: the calibration's, within :data:`STARTUP_SPREAD` of it (a refused configuration's: the
    two starts that end in its refusal)."""
    return Range(calibration.startup_s * STARTUP_SPREAD[0], calibration.startup_s * STARTUP_SPREAD[1])
