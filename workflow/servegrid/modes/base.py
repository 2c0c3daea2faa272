"""What a workload mode is: :class:`Mode`, and the :class:`WorkloadContext` its runner drives.

A mode is one module under ``servegrid/modes/`` that builds one :class:`Mode`
and registers it (:func:`servegrid.modes.register`). The mode holds everything
the pipeline needs to know about it: how to run it, the figure it is judged by,
what prefix-cache hit rate it should produce, its config schema, its figures,
its extra summary columns and its words for the report (marked with ``N_`` so
that ``pybabel extract -k N_`` puts them in the catalogues).

Nothing here imports the streaming client, so aggregation and the report can
read the registry without aiohttp.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd

from servegrid import progress
from servegrid.request_record import RequestRecord

if TYPE_CHECKING:
    import httpx

    from servegrid.client import Streamer
    from servegrid.engines import Engine
    from servegrid.prompts import PromptBuilder
    from servegrid.stages import StagePlan

MeasureHook = Callable[[], Awaitable[None]]
Runner = Callable[["WorkloadContext", MeasureHook], Awaitable[None]]
Content = TypeVar("Content")


async def _no_pause() -> None:
    return None


def N_(message: str) -> str:
    """Mark ``message`` for the catalogues; it is translated where it is shown."""
    return message


@dataclass(frozen=True)
class Primary:
    """The figure a mode is judged by."""

    column: str  # a per-request column of the requests table
    higher_is_better: bool
    unit: str  # "seconds" or "rate": how the report writes the value
    axis_label: str  # N_: the figures' y axis
    header: str  # N_: the report table's column header
    verdict_word: str  # N_ (or a symbol): what a factor measures, "1,3–1,9× decode"
    turn: int | None = None  # only this conversation turn's requests

    @property
    def metric(self) -> str:
        return self.column if self.turn is None else f"{self.column}@turn{self.turn}"

    def mask(self, requests: Mapping[str, Any]) -> Any:
        """Which requests this figure's samples come from: measured, valid, of its turn (columns of
        servegrid.per_request.derive's table, as a DataFrame or as numpy arrays). The summary, the verdict and
        sequential sampling all count these, and only these."""
        selected = (requests["phase"] == "measured") & requests["valid"]
        return selected if self.turn is None else selected & (requests["turn"] == self.turn)

    def rows(self, requests: pd.DataFrame) -> pd.DataFrame:
        """The rows of :meth:`mask`."""
        return requests[self.mask(requests)]


@dataclass(frozen=True)
class FigureSpec:
    """One figure of a mode: ``kind`` names the drawing (servegrid.figures.Painter), ``options`` its settings."""

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
    conclusion: str | None = None  # N_: the conclusion's sentence when a configuration wins this class
    summary_columns: tuple[str, ...] = ()  # extra summary columns (None for other modes' cells)
    partial: str | None = None  # an extra report template section (report/templates/modes/...)
    summarize: Callable[[pd.DataFrame, pd.DataFrame], dict[str, Any]] | None = None
    expected_hits: Callable[[Mapping[str, Any], pd.DataFrame, int], float] | None = None
    corpus_extra: Callable[[Mapping[str, Any]], int] = lambda workload: 0
    # Tokens the longest request of a cell holds at its end (prompt + output), from its context and
    # settings; None: context + corpus_extra + output_tokens.
    longest_request: Callable[[int, Mapping[str, Any]], int] | None = None
    # The description's placeholders from the mode's settings (numbers and lists of numbers).
    describe: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda workload: {}

    def expected_hit_rate(
        self, prefix_caching: bool, settings: Mapping[str, Any], measured: pd.DataFrame, block_size: int | None
    ) -> float:
        """The prefix-cache hit rate this mode should produce over ``measured``: 0 without prefix caching."""
        if not prefix_caching or measured.empty or self.expected_hits is None:
            return 0.0
        return float(self.expected_hits(settings, measured, block_size or 1))

    def extra_columns(self, valid: pd.DataFrame, cell_frame: pd.DataFrame) -> dict[str, Any]:
        """This mode's own summary columns for one cell (valid measured requests; every request)."""
        return dict(self.summarize(valid, cell_frame)) if self.summarize else {}

    def request_tokens(self, context: int, workload: Mapping[str, Any]) -> int:
        """Prompt + output tokens of the cell's longest request: what must fit the server's context limit."""
        if self.longest_request is not None:
            return self.longest_request(context, workload)
        return context + self.corpus_extra(workload) + workload["output_tokens"]

    def corpus_tokens(self, settings: Mapping[str, Any]) -> int:
        """Tokens of prompt text a cell needs: its longest request plus headroom."""
        longest = settings["context"] + self.corpus_extra(settings["workload"])
        return min(max(longest + 512, 4096), 200_000)


@dataclass
class WorkloadContext:
    """What a mode's runner works with: the cell's settings, the engine, the streamer and the prompts."""

    mode: str
    context: int
    concurrency: int
    workload: dict[str, Any]
    temperature: float
    model: str
    engine: Engine
    streamer: Streamer
    builder: PromptBuilder
    sync_client: httpx.Client
    url: str
    plan: StagePlan
    records: list[RequestRecord] = field(default_factory=list)
    # Around the pause after a stage (streams decoded, samples judged, the next prompts built; nothing in
    # flight): the cell stops and restarts what watches the client's timing, which that work would skew.
    pause_timing: MeasureHook = _no_pause
    resume_timing: MeasureHook = _no_pause
    measuring_since_ns: int | None = None  # set when the measured phase begins
    server_model: str = ""  # the server's name for control calls (tokenizer); ``model``: the gateway's, if any

    def new_record(
        self, session: int, seq: int, phase: str, prompt_tokens: int, turn: int = 1, label: str = ""
    ) -> RequestRecord:
        record = RequestRecord(
            request_id=label or f"{phase}-s{session}-r{seq}-t{turn}",
            session=session,
            seq=seq,
            phase=phase,
            turn=turn,
            prompt_tokens_requested=prompt_tokens,
            output_tokens_requested=self.workload["output_tokens"],
        )
        self.records.append(record)
        return record

    async def complete(self, record: RequestRecord, prompt: list[int]) -> None:
        """Send ``prompt``; its stream is decoded once the cell's streams are over (Streamer.decode_pending)."""
        payload = self.engine.completion_payload(self.model, prompt, self.workload["output_tokens"], self.temperature)
        await self.streamer.stream(self.engine.completions_path, payload, record, decode=False)

    async def chat(self, record: RequestRecord, messages: list[dict[str, str]]) -> None:
        """Send a chat turn and decode it at once: the next turn needs the reply's text."""
        payload = self.engine.chat_payload(self.model, messages, self.workload["output_tokens"], self.temperature)
        record.messages = list(messages)
        await self.streamer.stream(self.engine.chat_path, payload, record)

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(self.sync_client, self.url, self.server_model or self.model, text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.engine.detokenize(self.sync_client, self.url, self.server_model or self.model, tokens)

    def chat_prompt_tokens(self, messages: Sequence[Mapping[str, str]]) -> int:
        return self.engine.chat_prompt_tokens(self.sync_client, self.url, self.server_model or self.model, messages)

    def elapsed_s(self) -> float:
        """Seconds since the measured phase began (0 before)."""
        since = self.measuring_since_ns
        return 0.0 if since is None else (time.monotonic_ns() - since) / 1e9

    def may_start(self) -> bool:
        """False once the measured phase has run for the plan's time limit (where it has one)."""
        limit = self.plan.time_limit_s
        return limit is None or self.elapsed_s() < limit


async def send_one_by_one(
    ctx: WorkloadContext, phase: str, prompts: Sequence[list[int]], turn_of_index: bool = False
) -> None:
    """Send ``prompts`` one after another from session 0, unmeasured (warm-up, probe)."""
    for i, prompt in enumerate(prompts):
        record = ctx.new_record(0, i, phase, len(prompt), turn=i + 1 if turn_of_index else 1)
        record.intended_send_ns = time.monotonic_ns()
        await ctx.complete(record, prompt)


async def measure_in_stages(
    ctx: WorkloadContext,
    measure: MeasureHook,
    prepare: Callable[[list[tuple[int, int]]], Sequence[Content]],
    send: Callable[[int, int, Content, int], Awaitable[int]],
    settle: Callable[[], None] = lambda: None,
) -> None:
    """The measured phase: closed-loop sessions, in the stages ``ctx.plan`` sets (servegrid.stages).

    ``prepare(units)`` builds the content of each ``(session, index)`` unit of a stage before it starts
    (synchronously: it may ask the server's tokenizer, so nothing may be in flight); ``send(session, index,
    content, intended_ns)`` runs one unit and returns when the session wanted to send its next one (the
    reply's end). Sessions of a stage start at one instant; the next stage starts once all are done,
    after the streams are decoded, ``settle()`` has completed the records (what is not measured while
    streams are in flight) and the samples are judged.
    """
    done = 0

    def units(rounds: int) -> list[tuple[int, int]]:
        return [(s, i) for s in range(ctx.concurrency) for i in range(done, done + rounds)]

    rounds = ctx.plan.next_rounds(ctx.records, 0.0)
    contents = prepare(units(rounds))
    await measure()
    ctx.measuring_since_ns = time.monotonic_ns()
    while rounds:
        by_session = [contents[s * rounds : (s + 1) * rounds] for s in range(ctx.concurrency)]

        async def session(
            s: int, start_ns: int, first: int = done, stage: list[Sequence[Content]] = by_session
        ) -> None:
            intended = start_ns
            for i, content in enumerate(stage[s]):
                if not ctx.may_start():
                    break
                intended = await send(s, first + i, content, intended)

        ctx.plan.stage_started(ctx.elapsed_s())
        planned = rounds * ctx.concurrency * int(ctx.workload.get("turns", 1))  # requests, every turn counted
        ticker = asyncio.create_task(progress.stage_ticker(ctx, len(ctx.plan.stages), planned, len(ctx.records)))
        try:
            await run_sessions(ctx, session)
        finally:
            ticker.cancel()
        ctx.plan.stage_ended(ctx.elapsed_s())
        done += rounds
        await ctx.pause_timing()
        ctx.streamer.decode_pending()  # nothing is in flight: decoding delays no timestamp
        settle()
        rounds = ctx.plan.next_rounds(ctx.records, ctx.elapsed_s())
        if rounds and ctx.may_start():
            contents = prepare(units(rounds))
            await ctx.resume_timing()
        elif rounds:  # time is up while judging: the planned stage would send nothing
            ctx.plan.time_up()
            rounds = 0


async def run_sessions(ctx: WorkloadContext, body: Callable[[int, int], Awaitable[None]]) -> None:
    """Run ``concurrency`` closed-loop sessions that start at one instant.

    ``body(session, start_ns)`` sends that session's requests back to back.
    """
    start_ns = time.monotonic_ns()
    await asyncio.gather(*(body(s, start_ns) for s in range(ctx.concurrency)))


async def measure_completions(
    ctx: WorkloadContext, measure: MeasureHook, prompt_of: Callable[[list[tuple[int, int]]], Sequence[list[int]]]
) -> None:
    """The measured phase of a completion mode: each unit is one prompt, sent back to back per session."""

    async def send(s: int, i: int, prompt: list[int], intended_ns: int) -> int:
        record = ctx.new_record(s, i, "measured", len(prompt))
        record.intended_send_ns = intended_ns
        await ctx.complete(record, prompt)
        return record.end_ns or time.monotonic_ns()

    await measure_in_stages(ctx, measure, prompt_of, send)
