"""What one configuration's Slurm job asks for (``profiles/slurm``): its devices by count and a time limit.

Under the Slurm executor a configuration's ``server_spec``, cells and ``server_stop`` form one group, so one
Slurm job on one node: its server starts there at most once and is stopped by ``server_stop`` before the job
ends. Snakemake adds up the ``runtime`` of a group's jobs that run one after another (its
``GroupResources.basic_layered``) and takes the largest of everything else, so each rule books its own share:
``server_spec`` the server's start-up, each cell the longest it may measure, ``server_stop`` the shutdown.
A cell's share is a ceiling, not an estimate: a cell that stops early ends the job early, and a time limit
that is too short would kill the job mid-cell (which is safe: no cell file, the cell reruns next time).
"""

from __future__ import annotations

import math

from servegrid.config import CellSpec, Experiment
from servegrid.records.cell_settings import CellSettings
from servegrid.records.cell_spec import Sessions

CELL_OVERHEAD_S = 60  # per cell: its job's start, the server's liveness check, the cache reset, the file


def minutes(seconds: float) -> int:
    """Slurm's ``--time`` in whole minutes, rounded up."""
    return max(1, math.ceil(seconds / 60))


def cell_time_limit_s(experiment: Experiment, cell: CellSpec) -> float:
    """The longest ``cell`` may take: its measuring ceiling, its warm-up, its overhead.

    A sequential cell measures for at most ``sampling.max_duration_s`` (timed while measuring; the round in
    flight may end later: a quarter on top). A fixed-count cell has no time ceiling but its requests' own:
    ``duration_s`` per repeat where set, else every request at ``operations.request_timeout_s``.
    """
    settings = CellSettings(experiment.cell_settings(cell))
    workload, rule = settings.workload, settings.rule
    timeout = experiment.operations.request_timeout_s
    repeats = settings.repeats
    if not isinstance(cell.load, Sessions):  # open loop: the schedule's span, then the drain (a request's timeout)
        window = settings.open_loop_window
        measuring = repeats * (float(window["ramp_s"]) + int(window["requests"]) / cell.load.per_s + timeout)
    elif rule is not None:
        measuring = 1.25 * float(rule["max_duration_s"])
    elif workload.get("duration_s"):
        measuring = repeats * (float(workload["duration_s"]) + timeout)
    else:
        measuring = repeats * int(workload.get("requests_per_session", 1)) * int(workload.get("turns", 1)) * timeout
    warmup = int(workload.get("warmup_requests", 0)) * timeout
    return measuring + warmup + CELL_OVERHEAD_S


def cpus_per_task(experiment: Experiment, configuration: str) -> int:
    """The server's cores and the client's (servegrid.serving.placement splits them in that order); at least 1."""
    return max(1, len(experiment.configuration(configuration).cpus) + len(experiment.operations.client_cpus))


def gpus(experiment: Experiment, configuration: str) -> int:
    return len(experiment.configuration(configuration).gpus)
