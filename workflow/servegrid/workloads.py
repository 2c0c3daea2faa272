"""The three workload modes of the seed experiment.

Each mode prepares all of its prompts before anything is timed, runs its
unmeasured warm-up, and then runs ``concurrency`` closed-loop sessions that
start together. ``measure`` is called between warm-up and the measured phase
so the cell can snapshot server metrics over exactly the measured requests.

- decode: cold prompts of exactly ``context`` tokens, exactly
  ``output_tokens`` out; primary figure decode tokens/s per session.
- single_turn: one shared prefix of ``context`` tokens (primed by the
  warm-up), a unique suffix per request; primary figure TTFT p50. Before the
  warm-up, a probe on a second fresh prefix times a cold first request and the
  second request on the same prefix (the seed's "second request" figure).
- multi_turn: each session holds conversations through the chat endpoint:
  a first user message of ``context`` tokens, then ``turns - 1`` follow-ups,
  each adding a user message and the assistant's actual reply (about
  ``tokens_per_turn`` tokens per turn); primary figure turn-2 TTFT p50.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from servegrid.client import RequestRecord, Streamer
from servegrid.prompts import PromptBuilder

MeasureHook = Callable[[], Awaitable[None]]


@dataclass
class WorkloadContext:
    mode: str
    context: int
    concurrency: int
    workload: dict[str, Any]
    temperature: float
    model: str
    streamer: Streamer
    builder: PromptBuilder
    sync_client: httpx.Client
    url: str
    records: list[RequestRecord] = field(default_factory=list)

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

    def completion_payload(self, prompt: list[int]) -> dict[str, Any]:
        n = self.workload["output_tokens"]
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": n,
            "min_tokens": n,
            "ignore_eos": True,
            "temperature": self.temperature,
        }

    async def complete(self, record: RequestRecord, prompt: list[int]) -> None:
        """Send ``prompt``; its stream is decoded once the cell's streams are over (Streamer.decode_pending)."""
        await self.streamer.stream("/v1/completions", self.completion_payload(prompt), record, decode=False)

    def may_start(self, start_ns: int) -> bool:
        """False once the measured phase has run for ``duration_s`` (when set)."""
        duration = self.workload.get("duration_s")
        return duration is None or time.monotonic_ns() - start_ns < duration * 1e9


async def _sessions(ctx: WorkloadContext, body: Callable[[int, int], Awaitable[None]]) -> None:
    """Run ``concurrency`` closed-loop sessions that start at one instant.

    ``body(session, start_ns)`` sends that session's requests back to back.
    """
    start_ns = time.monotonic_ns()
    await asyncio.gather(*(body(s, start_ns) for s in range(ctx.concurrency)))


# ---- decode -----------------------------------------------------------------


async def decode(ctx: WorkloadContext, measure: MeasureHook) -> None:
    w = ctx.workload
    warmups = [ctx.builder.unique(ctx.context, f"warmup {i}") for i in range(w["warmup_requests"])]
    prompts = [
        [ctx.builder.unique(ctx.context, f"s{s} r{r}") for r in range(w["requests_per_session"])]
        for s in range(ctx.concurrency)
    ]
    for i, prompt in enumerate(warmups):
        record = ctx.new_record(0, i, "warmup", len(prompt))
        record.intended_send_ns = time.monotonic_ns()
        await ctx.complete(record, prompt)
    await measure()

    async def session(s: int, start_ns: int) -> None:
        intended = start_ns
        for r, prompt in enumerate(prompts[s]):
            if not ctx.may_start(start_ns):
                break
            record = ctx.new_record(s, r, "measured", len(prompt))
            record.intended_send_ns = intended
            await ctx.complete(record, prompt)
            intended = record.end_ns or time.monotonic_ns()

    await _sessions(ctx, session)


# ---- single_turn ----------------------------------------------------------------


async def single_turn(ctx: WorkloadContext, measure: MeasureHook) -> None:
    w = ctx.workload
    n_per_session = w["requests_per_session"]
    labels = [f"s{s} r{r}" for s in range(ctx.concurrency) for r in range(n_per_session)]
    _, shared = ctx.builder.shared_prefix_prompts(ctx.context, w["suffix_tokens"], labels, "shared prefix")
    _, probe = ctx.builder.shared_prefix_prompts(
        ctx.context, w["suffix_tokens"], ["probe a", "probe b"], "probe prefix"
    )
    warmup_labels = [f"warmup {i}" for i in range(w["warmup_requests"])]
    _, warmups = ctx.builder.shared_prefix_prompts(ctx.context, w["suffix_tokens"], warmup_labels, "shared prefix")

    # The probe runs on an idle server: first request on a fresh prefix, then the second.
    for i, prompt in enumerate(probe):
        record = ctx.new_record(0, i, "probe", len(prompt), turn=i + 1)
        record.intended_send_ns = time.monotonic_ns()
        await ctx.complete(record, prompt)
    # Warm-up requests carry the shared prefix: it is in the cache (where caching is on)
    # before measuring, as a shared system prompt is in production.
    for i, prompt in enumerate(warmups):
        record = ctx.new_record(0, i, "warmup", len(prompt))
        record.intended_send_ns = time.monotonic_ns()
        await ctx.complete(record, prompt)
    await measure()

    async def session(s: int, start_ns: int) -> None:
        intended = start_ns
        for r in range(n_per_session):
            if not ctx.may_start(start_ns):
                break
            prompt = shared[s * n_per_session + r]
            record = ctx.new_record(s, r, "measured", len(prompt))
            record.intended_send_ns = intended
            await ctx.complete(record, prompt)
            intended = record.end_ns or time.monotonic_ns()

    await _sessions(ctx, session)


# ---- multi_turn -------------------------------------------------------------------


def chat_prompt_tokens(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]]) -> int:
    """Prompt length of ``messages`` as the server's chat template and tokenizer make it."""
    response = client.post(
        f"{url}/tokenize",
        json={"model": model, "messages": messages, "add_generation_prompt": True},
    )
    response.raise_for_status()
    return int(response.json()["count"])


def detokenize(client: httpx.Client, url: str, model: str, tokens: list[int]) -> str:
    response = client.post(f"{url}/detokenize", json={"model": model, "tokens": tokens})
    response.raise_for_status()
    return str(response.json()["prompt"])


def exact_chat_message(
    ctx: WorkloadContext, history: list[dict[str, str]], target_total: int, label: str
) -> tuple[str, int]:
    """A user message that brings the rendered chat to ``target_total`` tokens.

    Text is detokenized from corpus tokens and re-measured with the server's
    template, adjusting the length until the count matches (token boundaries
    can merge on re-tokenization). Returns the text and the exact count.
    """
    overhead = chat_prompt_tokens(ctx.sync_client, ctx.url, ctx.model, [*history, {"role": "user", "content": ""}])
    want = max(1, target_total - overhead)
    ids = ctx.builder.unique(want + 64, label)
    best: tuple[str, int] | None = None
    length = want
    for _ in range(8):
        content = detokenize(ctx.sync_client, ctx.url, ctx.model, ids[: max(1, length)])
        total = chat_prompt_tokens(
            ctx.sync_client, ctx.url, ctx.model, [*history, {"role": "user", "content": content}]
        )
        if best is None or abs(total - target_total) < abs(best[1] - target_total):
            best = (content, total)
        if total == target_total:
            break
        length += target_total - total
    assert best is not None
    return best


async def multi_turn(ctx: WorkloadContext, measure: MeasureHook) -> None:
    w = ctx.workload
    turns, per_turn, out_tokens = w["turns"], w["tokens_per_turn"], w["output_tokens"]
    follow_up_tokens = max(1, per_turn - out_tokens)

    def first_message(label: str) -> str:
        return exact_chat_message(ctx, [], ctx.context, label)[0]

    def follow_ups(label: str) -> list[str]:
        return [
            detokenize(ctx.sync_client, ctx.url, ctx.model, ctx.builder.unique(follow_up_tokens, f"{label} turn {t}"))
            for t in range(2, turns + 1)
        ]

    conversations = [
        [(first_message(f"s{s} c{c}"), follow_ups(f"s{s} c{c}")) for c in range(w["requests_per_session"])]
        for s in range(ctx.concurrency)
    ]
    warmup_conversations = [
        (first_message(f"warmup {i}"), follow_ups(f"warmup {i}")) for i in range(w["warmup_requests"])
    ]

    async def converse(session: int, seq: int, phase: str, opening: str, later: list[str], intended_ns: int) -> int:
        messages = [{"role": "user", "content": opening}]
        for turn in range(1, turns + 1):
            if turn > 1:
                messages.append({"role": "user", "content": later[turn - 2]})
            record = ctx.new_record(session, seq, phase, 0, turn=turn)
            record.intended_send_ns = intended_ns
            payload = {
                "model": ctx.model,
                "messages": list(messages),
                "max_tokens": out_tokens,
                "min_tokens": out_tokens,
                "ignore_eos": True,
                "temperature": ctx.temperature,
            }
            record.messages = list(messages)
            await ctx.streamer.stream("/v1/chat/completions", payload, record)
            intended_ns = record.end_ns or time.monotonic_ns()
            if record.error:
                return intended_ns
            messages.append({"role": "assistant", "content": record.text})
        return intended_ns

    for i, (opening, later) in enumerate(warmup_conversations):
        await converse(0, i, "warmup", opening, later, time.monotonic_ns())
    await measure()

    async def session(s: int, start_ns: int) -> None:
        intended = start_ns
        for c, (opening, later) in enumerate(conversations[s]):
            if not ctx.may_start(start_ns):
                break
            intended = await converse(s, c, "measured", opening, later, intended)

    await _sessions(ctx, session)
    # What each turn asked for, measured with the server's template after the fact,
    # so that no tokenizer round-trip sits between the turns that are timed.
    for record in ctx.records:
        if record.messages is not None:
            record.prompt_tokens_requested = chat_prompt_tokens(ctx.sync_client, ctx.url, ctx.model, record.messages)


WORKLOADS: dict[str, Callable[[WorkloadContext, MeasureHook], Awaitable[None]]] = {
    "decode": decode,
    "single_turn": single_turn,
    "multi_turn": multi_turn,
}
