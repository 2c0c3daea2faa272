"""Which figures a run draws, and under which file names: each enabled mode's own figures
(:attr:`servegrid.modes.Mode.figures`) and the figures of the whole run.

No plotting library is imported here: the Snakefile reads this to know every
figure file before anything runs, so the DAG is built without matplotlib.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servegrid import modes
from servegrid.modes.base import N_, FigureSpec

if TYPE_CHECKING:
    from servegrid.config import Experiment

FORMATS = ("png", "svg")  # PNG for the HTML report, SVG (vector) for the PDF

# Figures of the whole run, after the modes' own.
RUN_FIGURES = (
    FigureSpec(
        "ratio_heatmap",
        "ratio_heatmap",
        N_("Each configuration against the baseline"),
        N_(
            "How many times better (blue) or worse (red) each configuration's p50 is than the baseline's "
            "(report.baseline, named below the figure), per mode, context and concurrency; valid cells only."
        ),
    ),
    FigureSpec(
        "latency_cdfs",
        "latency_cdfs",
        N_("Latency distributions at the heaviest load"),
        N_(
            "Per workload, its largest context with the most concurrent sessions: the share of requests whose TTFT "
            "(the workload's own turn) is at most x (top), and the share of tokens whose inter-token latency is at "
            "most x (bottom), one line per configuration; valid requests only."
        ),
    ),
)


# Drawn when the config sets service-level objectives (slo:).
GOODPUT_FIGURE = FigureSpec(
    "goodput",
    "goodput_by_concurrency",
    N_("Goodput within the service-level objectives"),
    N_(
        "Requests per second that met every objective of their workload vs concurrent sessions, one panel per "
        "workload and context, one line per configuration; a line that falls is a configuration leaving its "
        "objectives behind."
    ),
)


def run_figures(experiment: Experiment) -> tuple[FigureSpec, ...]:
    return RUN_FIGURES + ((GOODPUT_FIGURE,) if experiment.slo else ())


def figure_specs(experiment: Experiment) -> list[tuple[str | None, FigureSpec]]:
    """(mode name or None for a run figure, spec) for every figure of this experiment, in drawing order."""
    return [(name, spec) for name in experiment.modes() for spec in modes.get(name).figures] + [
        (None, spec) for spec in run_figures(experiment)
    ]


def figure_paths(experiment: Experiment, out_dir: str) -> list[str]:
    return [f"{out_dir}/{spec.name}.{ext}" for _, spec in figure_specs(experiment) for ext in FORMATS]
