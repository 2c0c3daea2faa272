"""What a mode's runner drives: the :class:`WorkloadContext` of one cell, and its units of work handed to the load.

The runner sends through a :class:`Sender` it declares (the measuring layer's streaming client implements
it), so the modes never import the client or aiohttp. When the measured units go out is the cell's load strategy's
(:mod:`servegrid.load`): a mode hands it a :class:`~servegrid.load.Work` (:func:`measure_units`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from servegrid.load import LoadStrategy, MeasureHook, OpenLoopOutcome, StagePlan, Unit, Work
from servegrid.records.request import RequestRecord

if TYPE_CHECKING:
    import httpx

    from servegrid.engines import Engine
    from servegrid.modes.prompts import PromptBuilder

__all__ = ["MeasureHook", "Sender", "WorkloadContext", "measure_completions", "measure_units", "send_one_by_one"]


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
    workload: Mapping[str, Any]
    temperature: float
    model: str
    engine: Engine
    streamer: Sender
    builder: PromptBuilder
    sync_client: httpx.Client
    url: str
    plan: StagePlan
    load: LoadStrategy  # when the measured units go out: the cell's load (servegrid.load.for_cell)
    records: list[RequestRecord] = field(default_factory=list)
    # Around the pause after a stage (streams decoded, samples judged, the next prompts built; nothing in
    # flight): the cell stops and restarts what watches the client's timing, which that work would skew.
    pause_timing: MeasureHook = _no_pause
    resume_timing: MeasureHook = _no_pause
    measuring_since_ns: int | None = None  # set when the measured phase begins
    server_model: str = ""  # the server's name for control calls (tokenizer); ``model``: the gateway's, if any
    open_outcome: OpenLoopOutcome | None = None  # an open-loop cell's run, once measured (None: closed loop)

    def new_record(
        self,
        session: int,
        seq: int,
        phase: str,
        prompt_tokens: int,
        turn: int = 1,
        label: str = "",
        output_tokens: int | None = None,
    ) -> RequestRecord:
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


async def measure_units(ctx: WorkloadContext, measure: MeasureHook, work: Work[Any]) -> None:
    """The measured phase: ``work``'s units, each sent when the cell's load says (servegrid.load.strategies)."""
    ctx.open_outcome = await ctx.load.run(ctx, measure, work)


async def measure_completions(
    ctx: WorkloadContext, measure: MeasureHook, prompt_of: Callable[[list[tuple[int, int]]], Sequence[list[int]]]
) -> None:
    """The measured phase of a completion mode: each unit is one prompt, one completion."""

    async def send(unit: Unit, prompt: list[int], intended_ns: int) -> int:
        record = ctx.new_record(unit.session, unit.seq, unit.phase, len(prompt))
        record.intended_send_ns = intended_ns
        await ctx.complete(record, prompt)
        return record.end_ns or time.monotonic_ns()

    await measure_units(ctx, measure, Work(prompt_of, send))
