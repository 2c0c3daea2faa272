"""The figure of a replayed trace's own shape (docs/open-loop.md, "Replaying a trace"): what was replayed, so a
reader can judge whether it looks like their traffic.

:class:`TraceFigures` is the part of :class:`servegrid.reporting.figures.Painter` that draws it. It reads the
trace itself (servegrid.modes.trace_source), at 1x: arrivals per second over the whole trace (the windows the
cells replay shaded), and over the requests those windows replay, the prompt and output lengths and the share of
each prompt that earlier requests of the trace carried (an unbounded cache, one token granularity: the trace's
reuse before any server's block size).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FuncFormatter

from servegrid.config import Experiment
from servegrid.engines.base import PrefixCache
from servegrid.modes import trace, trace_source
from servegrid.modes.trace_file import Window


class TraceFigures:
    """The trace-shape figure; a mixin of :class:`servegrid.reporting.figures.Painter`, which sets these."""

    experiment: Experiment
    _: Callable[[str], str]

    if TYPE_CHECKING:

        def number(self, value: float, digits: int | None = None) -> str: ...

    def trace_shape(self, mode: str) -> plt.Figure:
        workload = self.experiment.workload(mode)
        whole = trace_source.whole(workload.settings)
        # What the cells replay: every window's arrivals (the whole trace where no window is measured).
        replays = [trace_source.replayed(w).window for w in workload.windows.values()] or [whole]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        arrivals_ax, lengths_ax, reuse_ax = axes
        first = whole.conversations[0].arrival_ms
        seconds = np.array([(c.arrival_ms - first) / 1000 for c in whole.conversations])
        # One-second bins up to ten minutes; a longer trace in 200 bins of whole seconds.
        width = max(1, math.ceil(seconds.max() / 200)) if seconds.max() > 600 else 1
        bins = np.arange(0, math.floor(seconds.max()) + width + 1, width)
        arrivals_ax.hist(seconds, bins=bins, color="0.35", weights=np.full(len(seconds), 1 / width))
        for label in workload.windows:
            if label:  # a part of the trace: shaded where the cells replay it
                window = Window.from_label(label)
                end = seconds.max() if window.duration_s is None else window.start_s + window.duration_s
                arrivals_ax.axvspan(window.start_s, end, color="tab:blue", alpha=0.12, linewidth=0)
        arrivals_ax.set_xlabel(self._("seconds into the trace"))
        arrivals_ax.set_ylabel(self._("arrivals per second"))
        shaded = any(workload.windows)  # a window other than the whole trace
        arrivals_ax.set_title(self._("Arrivals (the windows replayed shaded)") if shaded else self._("Arrivals"))

        prompts = np.array([r.input_tokens for t in replays for r in t.requests])
        outputs = np.array([r.output_tokens for t in replays for r in t.requests])
        top = max(int(prompts.max()), int(outputs.max()), 2)
        edges = np.logspace(0, math.log10(top) + 0.05, 30)
        lengths_ax.hist(prompts, bins=edges, color="0.35", alpha=0.8, label=self._("prompt"))
        lengths_ax.hist(outputs, bins=edges, color="tab:orange", alpha=0.6, label=self._("output"))
        lengths_ax.set_xscale("log")
        lengths_ax.set_xlabel(self._("tokens"))
        lengths_ax.set_ylabel(self._("requests"))
        lengths_ax.set_title(self._("Lengths"))
        lengths_ax.legend(frameon=False)

        # Within each window: a cell sends none of the trace's requests before its window.
        reusable = [trace.reusable_tokens(t, PrefixCache()) for t in replays]
        share = np.array(
            [
                own[(i, turn)] / r.input_tokens
                for t, own in zip(replays, reusable, strict=True)
                for i, c in enumerate(t.conversations)
                for turn, r in enumerate(c.turns, start=1)
            ]
        )
        reuse_ax.hist(share * 100, bins=np.linspace(0, 100, 21), color="0.35")
        total = sum(sum(own.values()) for own in reusable) / float(prompts.sum())
        reuse_ax.axvline(total * 100, color="tab:red", linestyle="--")
        reuse_ax.set_xlabel(self._("share of the prompt carried by earlier requests (%)"))
        reuse_ax.set_ylabel(self._("requests"))
        reuse_ax.set_title(
            self._("Prefix reuse: %(share)s%% of all prompt tokens") % {"share": self.number(total * 100, 0)}
        )
        for ax in axes:
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: self.number(v)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: self.number(v)))
        fig.tight_layout()
        return fig
