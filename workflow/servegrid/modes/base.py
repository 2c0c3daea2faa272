r"""What a workload mode is: :class:`Mode`, its :class:`FigureSpec`\ s, and ``N_`` for its words.

A mode is one module under ``servegrid/modes/`` that builds one :class:`Mode`
and registers it (:func:`servegrid.modes.register`). The mode holds everything
the pipeline needs to know about it: how to run it (a runner driving
:class:`~servegrid.modes.runner.WorkloadContext`), the figure it is judged by
(:class:`~servegrid.modes.primary.Primary`), what prefix-cache hit rate it should
produce, its config schema, its figures, its extra summary columns and its words
for the report (marked with ``N_`` so that ``pybabel extract -k N_`` puts them in
the catalogues).

Declarations only: aggregation, the verdict and the report read the registry
without loading the runner, the client or aiohttp.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from servegrid.engines.base import PrefixCache
from servegrid.modes.primary import Primary
from servegrid.records.cell_settings import CellSettings

if TYPE_CHECKING:
    from servegrid.load import ReplayArrivals
    from servegrid.modes.runner import MeasureHook, WorkloadContext

__all__ = ["N_", "FigureSpec", "Mode", "PrefixCache", "Primary", "Runner"]

Runner = Callable[["WorkloadContext", "MeasureHook"], Awaitable[None]]


def N_(message: str) -> str:
    """Mark ``message`` for the catalogues; it is translated where it is shown."""
    return message


@dataclass(frozen=True)
class FigureSpec:
    """One figure of a mode: ``kind`` names the drawing (reporting.figures.Painter), ``options`` its settings."""

    name: str
    kind: str
    title: str  # N_: the image's alt text
    caption: str  # N_
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Mode:
    """Everything about one workload mode (see the module docstring)."""

    name: str
    run: Runner
    primary: Primary
    title: str  # N_: "Decode"
    short_title: str  # N_: "Decode, cold prompts" (verdict tables)
    class_title: str  # N_: the verdict class of the same name
    section_title: str  # N_: the report section's heading
    description: str  # N_: the section's first paragraph; placeholders from describe()
    context_title: str  # N_: a figure panel's title, "%(tokens)s"
    context_header: str  # N_: the context column's header ("Prompt", "Prefix", "Context")
    schema: Mapping[str, Any]  # JSON-schema properties of this mode's own settings (with defaults)
    defaults: Mapping[str, Any]  # defaults of the settings every mode has (output_tokens, ...)
    figures: tuple[FigureSpec, ...] = ()
    # Whether its runner measures open-loop cells (rates) too: each unit it hands the load one arrival
    # (runner.measure_units).
    open_loop: bool = False
    # Whether it sends through the chat endpoint, which needs the checkpoint's chat template (the preflight checks).
    uses_chat: bool = False
    conclusion: str | None = None  # N_: the conclusion's sentence when a configuration wins this class
    summary_columns: tuple[str, ...] = ()  # extra summary columns (None for other modes' cells)
    partial: str | None = None  # an extra report template section (report/templates/modes/...)
    summarize: Callable[[pd.DataFrame, pd.DataFrame], dict[str, Any]] | None = None
    expected_hits: Callable[[CellSettings, pd.DataFrame, PrefixCache], float] | None = None
    corpus_extra: Callable[[Mapping[str, Any]], int] = lambda workload: 0
    # Tokens the longest request of a cell holds at its end (prompt + output), from its context and
    # settings; None: context + corpus_extra + output_tokens.
    longest_request: Callable[[int, Mapping[str, Any]], int] | None = None
    # One unit's requests (a session's share of one round: a request, or a conversation), each as (prompt tokens,
    # of them the tokens a prefix cache can hold from before, output tokens): what servegrid estimate prices a cell
    # by. None: one cold request of context + corpus_extra tokens.
    unit_requests: Callable[[int, Mapping[str, Any]], tuple[tuple[int, int, int], ...]] | None = None
    # The description's placeholders from the mode's settings (numbers and lists of numbers).
    describe: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda workload: {}
    # Settings the mode derives when the config is read (a trace's content hash), merged into its settings: what
    # its cells depend on beyond what the config says (unless ``windows`` gives a cell its own). May raise
    # ConfigError naming what is wrong.
    resolve: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    # Requests per open-loop arrival (multi_turn: a conversation's turns): a cell's offered rate in requests/s is
    # its arrival rate times this, which is what its achieved rate and goodput are compared with.
    requests_per_arrival: Callable[[Mapping[str, Any]], float] = lambda workload: 1.0
    # A replayed trace's windows, its grid axis beside the speedups: from the mode's settings and the drain's arrivals
    # (open_loop.max_in_flight), per window's label the settings of its cells, whose "trace" says what they replay and
    # its rate at 1x (requests/s; each speedup's offered rate is this times the speedup). None: no such axis.
    windows: Callable[[Mapping[str, Any], int], Mapping[str, Mapping[str, Any]]] | None = None
    # Where the longest request of a cell's settings comes from ("the trace's request at t.jsonl:17"), for the
    # context-limit refusal; None: its context.
    longest_where: Callable[[Mapping[str, Any]], str] | None = None
    # A replayed trace's own arrivals from a cell's workload settings (at 1x; its window's, then its drain's), which a
    # replay load (servegrid.load.strategies.ReplayStrategy) paces at the cell's speedup. None: nothing to replay.
    arrivals: Callable[[Mapping[str, Any]], ReplayArrivals] | None = None

    def expected_hit_rate(
        self, prefix_caching: bool, settings: CellSettings, measured: pd.DataFrame, cache: PrefixCache
    ) -> float:
        """The prefix-cache hit rate this mode should produce over ``measured``: 0 without prefix caching. Each repeat
        (a cell's, or a top-up's) ran the workload again from a reset cache with the same sessions and sequence
        numbers, so each is expected on its own, weighted by its prompt tokens."""
        if not prefix_caching or measured.empty or self.expected_hits is None:
            return 0.0
        if "repeat" not in measured.columns or measured["repeat"].nunique() < 2:
            return float(self.expected_hits(settings, measured, cache))
        hits = total = 0.0
        for _, repeat in measured.groupby("repeat"):
            tokens = float(repeat["prompt_tokens_reported"].astype(float).sum())
            hits += float(self.expected_hits(settings, repeat, cache)) * tokens
            total += tokens
        return hits / total if total else 0.0

    def extra_columns(self, valid: pd.DataFrame, cell_frame: pd.DataFrame) -> dict[str, Any]:
        """This mode's own summary columns for one cell (valid measured requests; every request)."""
        return dict(self.summarize(valid, cell_frame)) if self.summarize else {}

    def request_tokens(self, context: int, workload: Mapping[str, Any]) -> int:
        """Prompt + output tokens of the cell's longest request: what must fit the server's context limit."""
        if self.longest_request is not None:
            return self.longest_request(context, workload)
        tokens: int = context + self.corpus_extra(workload) + workload["output_tokens"]
        return tokens

    def requests_of_unit(self, context: int, workload: Mapping[str, Any]) -> tuple[tuple[int, int, int], ...]:
        """(prompt tokens, cacheable prefix tokens, output tokens) of each request of one unit (see unit_requests)."""
        if self.unit_requests is not None:
            return self.unit_requests(context, workload)
        return ((context + self.corpus_extra(workload), 0, workload["output_tokens"]),)

    def corpus_tokens(self, settings: CellSettings) -> int:
        """Tokens of prompt text a cell needs: its longest request plus headroom."""
        longest: int = settings.context + self.corpus_extra(settings.workload)
        return min(max(longest + 512, 4096), 200_000)
