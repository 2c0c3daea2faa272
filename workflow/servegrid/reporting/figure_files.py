"""Which figures a run draws, from which tables, and under which file names: each enabled mode's own figures
(:attr:`servegrid.modes.Mode.figures`) and the figures of the whole run.

No plotting library is imported here: the Snakefile reads this to know every
figure file before anything runs, so the DAG is built without matplotlib.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from servegrid import modes
from servegrid.modes.base import N_, FigureSpec

if TYPE_CHECKING:
    from servegrid.config import Experiment

# One raster format for both reports. SVG in the PDF cost more than drawing the figures: WeasyPrint paints an
# SVG node by node in Python (21 of 60 s of a 192-cell report; docs/scale.md), and at 200 dpi a figure stays
# sharp in print (a wide figure is printed smaller, and so finer).
FORMATS = ("png",)
FIGURE_DPI = 200

# The tables the figures are drawn from (servegrid.paths.RunTables): the figures rule declares these as its inputs.
TABLES_READ = ("summary", "comparisons", "requests", "gateway")

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


# Figures of one panel per context show at most this many (the smallest, the largest, and evenly spaced ones
# between): thirteen panels in a row make a figure 52 inches wide, unreadable on a page and slow to draw. The
# tables show every context; the report's caption says which ones the figure shows.
PANEL_KINDS = ("primary_by_concurrency", "throughput_latency")
MAX_CONTEXT_PANELS = 6


def shown_contexts(measured: Iterable[Any]) -> list[int]:
    """Of the ``measured`` contexts (any order, numpy integers too), those a figure of one panel per context
    shows, in ascending order."""
    contexts = sorted({int(c) for c in measured})
    if len(contexts) <= MAX_CONTEXT_PANELS:
        return contexts
    last = len(contexts) - 1
    return [contexts[round(i * last / (MAX_CONTEXT_PANELS - 1))] for i in range(MAX_CONTEXT_PANELS)]


# Drawn when every cell is measured both straight and through the gateway (route: both).
GATEWAY_FIGURE = FigureSpec(
    "gateway_added_latency",
    "gateway_added_latency",
    N_("What the gateway adds"),
    N_(
        "Through the gateway minus straight to the server, for the same cell: the median TTFT, per-token "
        "inter-token latency (each request's mean) and end-to-end latency, in milliseconds, per workload, context "
        "and concurrency (the x axis: context / sessions), one line per configuration, with 95-percent bootstrap "
        "intervals; above zero the gateway is slower."
    ),
)


# Drawn when a mode has open-loop cells (rates:).
RATE_FIGURE = FigureSpec(
    "latency_by_rate",
    "latency_by_rate",
    N_("Latency and goodput against the offered rate"),
    N_(
        "Open-loop cells: per workload and context, the TTFT (p50 solid, p90 dashed; top) and the requests per second "
        "answered within the objectives (without objectives: answered in full; bottom) against the offered rate, one "
        "line per configuration; the dotted line is the offered rate itself. A ring marks a saturated cell (the "
        "client's ceiling on requests in flight was reached), a cross an invalid one."
    ),
)


def run_figures(experiment: Experiment) -> tuple[FigureSpec, ...]:
    gateway = (GATEWAY_FIGURE,) if experiment.route == "both" else ()
    rates = (RATE_FIGURE,) if any(w.rates or w.speedups for w in experiment.workloads.values()) else ()
    return RUN_FIGURES + ((GOODPUT_FIGURE,) if experiment.slo else ()) + gateway + rates


# Kinds drawn from closed-loop cells (by sessions): a mode measured in open loop only has none to draw.
CLOSED_LOOP_KINDS = ("primary_by_concurrency", "probe_bars", "each_configuration_by_context", "throughput_latency")


def mode_figures(experiment: Experiment, name: str) -> tuple[FigureSpec, ...]:
    """The figures of mode ``name`` this run draws: without closed-loop cells (only rates or speedups), none of
    those drawn by sessions."""
    closed = bool(experiment.workload(name).concurrency)
    return tuple(spec for spec in modes.get(name).figures if closed or spec.kind not in CLOSED_LOOP_KINDS)


def figure_specs(experiment: Experiment) -> list[tuple[str | None, FigureSpec]]:
    """(mode name or None for a run figure, spec) for every figure of this experiment, in drawing order."""
    return [(name, spec) for name in experiment.modes() for spec in mode_figures(experiment, name)] + [
        (None, spec) for spec in run_figures(experiment)
    ]


def figure_paths(experiment: Experiment, out_dir: str) -> list[str]:
    return [f"{out_dir}/{spec.name}.{ext}" for _, spec in figure_specs(experiment) for ext in FORMATS]
