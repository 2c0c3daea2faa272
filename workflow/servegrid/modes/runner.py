"""What a mode's runner drives: the :class:`WorkloadContext` of one cell, and the closed-loop sessions in stages.

The runner sends through a :class:`Sender` it declares (the measuring layer's streaming client implements
it), so the modes never import the client or aiohttp. A stage's progress line is written here, beside the
loop that knows its requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from servegrid import progress
from servegrid.modes import open_loop
from servegrid.modes.open_loop import OpenLoop, OpenLoopOutcome
from servegrid.records.request import RequestRecord

if TYPE_CHECKING:
    import httpx

    from servegrid.engines import Engine
    from servegrid.modes.prompts import PromptBuilder
    from servegrid.modes.stages import StagePlan

MeasureHook = Callable[[], Awaitable[None]]
Content = TypeVar("Content")

log = logging.getLogger(__name__)


class Sender(Protocol):
    """The two calls a runner makes on the streaming client (servegrid.measuring.client.Streamer)."""

    async def stream(self, path: str, payload: dict[str, Any], record: RequestRecord, decode: bool = True) -> None:
        """Send ``payload`` to ``path`` and fill ``record`` as the stream arrives (decoded now, or later)."""

    def decode_pending(self) -> None:
        """Decode the streams kept raw while they arrived (nothing may be in flight)."""


async def _no_pause() -> None:
    return None


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
    streamer: Sender
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
    # An open-loop cell's load (None: closed-loop sessions) and, once measured, what its run was.
    open_loop: OpenLoop | None = None
    open_outcome: OpenLoopOutcome | None = None
    speedup: float = 1.0  # a trace cell's: how much faster than the trace its requests are due

    def new_record(
        self, session: int, seq: int, phase: str, prompt_tokens: int, turn: int = 1, label: str = "",
        output_tokens: int | None = None,
    ) -> RequestRecord:  # fmt: skip
        record = RequestRecord(
            request_id=label or f"{phase}-s{session}-r{seq}-t{turn}",
            session=session,
            seq=seq,
            phase=phase,
            turn=turn,
            prompt_tokens_requested=prompt_tokens,
            output_tokens_requested=self.workload["output_tokens"] if output_tokens is None else output_tokens,
        )
        self.records.append(record)
        return record

    async def complete(self, record: RequestRecord, prompt: list[int]) -> None:
        """Send ``prompt`` for the record's output tokens; its stream is decoded once the cell's streams are over
        (Streamer.decode_pending)."""
        payload = self.engine.completion_payload(self.model, prompt, record.output_tokens_requested, self.temperature)
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

    @property
    def label(self) -> str:
        return self.plan.label

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
    """The measured phase: closed-loop sessions, in the stages ``ctx.plan`` sets (servegrid.modes.stages).

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
        ticker = asyncio.create_task(stage_ticker(ctx, len(ctx.plan.stages), planned, len(ctx.records)))
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


async def stage_ticker(ctx: WorkloadContext, stage: int, planned: int, first: int) -> None:
    """Every few seconds while a stage runs: its requests done of planned, time measured, and an ETA (the
    stage's pace, or the cell's time limit if that comes first)."""
    started = ctx.elapsed_s()
    while True:
        await asyncio.sleep(progress.INTERVAL_S)
        done = sum(1 for r in ctx.records[first:] if r.phase == "measured" and r.end_ns is not None)
        elapsed = ctx.elapsed_s()
        eta = (elapsed - started) / done * (planned - done) if done else float("inf")
        if ctx.plan.time_limit_s is not None:
            eta = min(eta, max(0.0, ctx.plan.time_limit_s - elapsed))
        shown = "unknown" if eta == float("inf") else f"about {progress.duration(eta)}"
        log.info(
            "cell %s: stage %d: %d of %d requests done, %s measured; stage ETA %s",
            ctx.plan.label, stage, done, planned, progress.duration(elapsed), shown,
        )  # fmt: skip


async def run_sessions(ctx: WorkloadContext, body: Callable[[int, int], Awaitable[None]]) -> None:
    """Run ``concurrency`` closed-loop sessions that start at one instant.

    ``body(session, start_ns)`` sends that session's requests back to back.
    """
    start_ns = time.monotonic_ns()
    await asyncio.gather(*(body(s, start_ns) for s in range(ctx.concurrency)))


async def measure_completions(
    ctx: WorkloadContext, measure: MeasureHook, prompt_of: Callable[[list[tuple[int, int]]], Sequence[list[int]]]
) -> None:
    """The measured phase of a completion mode: each unit is one prompt, sent back to back per session; in an
    open-loop cell, one per arrival at its due time (servegrid.modes.open_loop)."""
    if ctx.open_loop is not None:
        ctx.open_outcome = await open_loop.measure(ctx, measure, prompt_of, ctx.open_loop)
        return

    async def send(s: int, i: int, prompt: list[int], intended_ns: int) -> int:
        record = ctx.new_record(s, i, "measured", len(prompt))
        record.intended_send_ns = intended_ns
        await ctx.complete(record, prompt)
        return record.end_ns or time.monotonic_ns()

    await measure_in_stages(ctx, measure, prompt_of, send)
