"""multi_turn: concurrent conversations through the chat endpoint, growing context.

Each session holds conversations: a first user message of ``context`` tokens
(measured with the server's own chat template), then ``turns - 1`` follow-ups,
each adding a user message and the assistant's actual reply (about
``tokens_per_turn`` tokens per turn). Primary figure: turn-2 TTFT p50.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pandas as pd

from servegrid.load import Unit, Work
from servegrid.modes.base import N_, FigureSpec, Mode, PrefixCache, Primary
from servegrid.modes.registry import register
from servegrid.modes.runner import MeasureHook, WorkloadContext, measure_units
from servegrid.records.cell_settings import CellSettings
from servegrid.stats import intervals


def exact_chat_message(
    ctx: WorkloadContext, history: list[dict[str, str]], target_total: int, label: str
) -> tuple[str, int]:
    """A user message that brings the rendered chat to ``target_total`` tokens.

    Text is detokenized from corpus tokens and re-measured with the server's
    template, adjusting the length until the count matches (token boundaries
    can merge on re-tokenization). Returns the text and the exact count.
    """
    overhead = ctx.chat_prompt_tokens([*history, {"role": "user", "content": ""}])
    want = max(1, target_total - overhead)
    ids = ctx.builder.unique(want + 64, label)
    best: tuple[str, int] | None = None
    length = want
    for _ in range(8):
        content = ctx.detokenize(ids[: max(1, length)])
        total = ctx.chat_prompt_tokens([*history, {"role": "user", "content": content}])
        if best is None or abs(total - target_total) < abs(best[1] - target_total):
            best = (content, total)
        if total == target_total:
            break
        length += target_total - total
    assert best is not None
    return best


async def run(ctx: WorkloadContext, measure: MeasureHook) -> None:
    talk = _Conversations(ctx)
    warmup_conversations = [talk.conversation(f"warmup {i}") for i in range(ctx.workload["warmup_requests"])]
    for i, (opening, later) in enumerate(warmup_conversations):
        await talk.converse(0, i, "warmup", opening, later, time.monotonic_ns())

    async def send(unit: Unit, conversation: tuple[str, list[str]], intended_ns: int) -> int:
        # In open loop each later turn after its think time (ctx.load.think_times_s); in closed loop, at once.
        think_s = ctx.load.think_times_s(unit.seq, talk.turns - 1)
        return await talk.converse(unit.session, unit.seq, unit.phase, *conversation, intended_ns, think_s)

    await measure_units(ctx, measure, Work(talk.conversations, send, talk.count_prompts, talk.turns))


class _Conversations:
    """A cell's conversations: their first messages at the cell's context, their follow-ups, and how one is held."""

    def __init__(self, ctx: WorkloadContext) -> None:
        self.ctx = ctx
        w = ctx.workload
        self.turns: int = w["turns"]
        self.follow_up_tokens: int = max(1, w["tokens_per_turn"] - w["output_tokens"])

    def conversation(self, label: str) -> tuple[str, list[str]]:
        ctx = self.ctx
        opening = exact_chat_message(ctx, [], ctx.context, label)[0]
        later = [
            ctx.detokenize(ctx.builder.unique(self.follow_up_tokens, f"{label} turn {t}"))
            for t in range(2, self.turns + 1)
        ]
        return opening, later

    def conversations(self, units: list[tuple[int, int]]) -> list[tuple[str, list[str]]]:
        return [self.conversation(f"s{s} c{c}") for s, c in units]

    async def converse(
        self,
        session: int,
        seq: int,
        phase: str,
        opening: str,
        later: list[str],
        intended_ns: int,
        think_s: list[float] | None = None,
    ) -> int:
        """One conversation; ``think_s``: in open loop, the user's pause before each later turn (its send is due
        then, whatever else is in flight)."""
        ctx = self.ctx
        messages = [{"role": "user", "content": opening}]
        for turn in range(1, self.turns + 1):
            if turn > 1:
                messages.append({"role": "user", "content": later[turn - 2]})
                if think_s:
                    intended_ns += int(think_s[turn - 2] * 1e9)
                    await asyncio.sleep(max(0.0, (intended_ns - time.monotonic_ns()) / 1e9))
            record = ctx.new_record(session, seq, phase, 0, turn=turn)
            record.intended_send_ns = intended_ns
            await ctx.chat(record, messages)
            intended_ns = record.end_ns or time.monotonic_ns()
            if record.error:
                return intended_ns
            messages.append({"role": "assistant", "content": record.text})
        return intended_ns

    def count_prompts(self) -> None:
        # What each turn asked for, measured with the server's template after its stage, so that no
        # tokenizer round-trip sits between the turns that are timed (and the stage's samples are judged valid).
        for record in self.ctx.records:
            if record.messages is not None and not record.prompt_tokens_requested:
                record.prompt_tokens_requested = self.ctx.chat_prompt_tokens(record.messages)


def expected_hits(settings: CellSettings, measured: pd.DataFrame, cache: PrefixCache) -> float:
    """Each turn finds an earlier turn's prompt cached, in the whole blocks the server reuses (PrefixCache; the
    reply may add a little more, which makes the measured rate at least this): the previous turn's, or, where
    the cache needs a prefix carried twice (``cache.sightings``: a hybrid model's "align" mode, whose recurrent
    state is saved where a turn parts from the one before), the turn before that. Measured on the tiny hybrid,
    three turns from 1,024 tokens: 0.20 against 0.19 expected this way, 0.49 the dense way."""
    hits = total = 0
    lag = max(cache.sightings, 1)
    for _, conversation in measured.sort_values("turn").groupby(["session", "seq"]):
        earlier: list[float] = []
        for prompt in conversation["prompt_tokens_reported"].astype(float):
            total += prompt
            if len(earlier) >= lag:
                hits += cache.hit_tokens(earlier[-lag])
            earlier.append(prompt)
    return float(hits / total) if total else 0.0


def turn_columns(valid: pd.DataFrame, cell_frame: pd.DataFrame) -> dict[str, Any]:
    """TTFT p50 of turn 1, turn 2 and the last turn."""
    turns = valid[valid["turn"] > 0]
    last_turn = int(turns["turn"].max()) if len(turns) else None
    out: dict[str, Any] = {}
    for name, turn in (("ttft_turn1_p50", 1), ("ttft_turn2_p50", 2), ("ttft_last_turn_p50", last_turn)):
        values = turns.loc[turns["turn"] == turn, "ttft_s"] if turn is not None else turns["ttft_s"].iloc[0:0]
        out[name] = intervals.percentiles(values.to_numpy(dtype=float))["p50"]  # None below 6 conversations
    return out


MODE = register(
    Mode(
        name="multi_turn",
        run=run,
        uses_chat=True,
        primary=Primary(
            "ttft_s",
            higher_is_better=False,
            unit="seconds",
            axis_label=N_("turn-2 TTFT p50 (s)"),
            header=N_("turn-2 TTFT p50"),
            verdict_word="TTFT",
            turn=2,
        ),
        title=N_("Multi-turn"),
        short_title=N_("Multi-turn, turn-2 TTFT"),
        class_title=N_("Multi-turn, concurrent sessions, growing context"),
        section_title=N_("Multi-turn: concurrent sessions, growing context"),
        description=N_(
            "Conversations of %(turns)s turns through the chat endpoint, starting from the base context; each turn "
            "adds a user message and the assistant's actual reply (about %(per_turn)s tokens). The figure is the "
            "TTFT of turn 2, the first follow-up question, on a linear scale."
        ),
        context_title=N_("base context of %(tokens)s tokens"),
        context_header=N_("Context"),
        open_loop=True,
        schema={
            "turns": {"type": "integer", "minimum": 2, "default": 3},
            "tokens_per_turn": {"type": "integer", "minimum": 16, "default": 1024},
        },
        defaults={"output_tokens": 128, "requests_per_session": 1},
        figures=(
            FigureSpec(
                "multi_turn_ttft",
                "primary_by_concurrency",
                N_("Multi-turn turn-2 TTFT vs concurrent sessions"),
                N_("Turn-2 TTFT p50 (95%% CI) on a linear scale, one panel per base context."),
            ),
            FigureSpec(
                "multi_turn_by_context",
                "each_configuration_by_context",
                N_("Each configuration alone, one line per base context"),
                N_(
                    "Each configuration's turn-2 TTFT, one line per base context, each panel on its own linear scale "
                    "so that a flat curve shows as flat; points circled in red ran into the KV-cache capacity."
                ),
            ),
        ),
        conclusion=N_(
            "For conversational, multi-turn load, %(winner)s is the default: with concurrent sessions and a growing "
            "context it answers the next question up to %(factor)s faster."
        ),
        summary_columns=("ttft_turn1_p50", "ttft_turn2_p50", "ttft_last_turn_p50"),
        summarize=turn_columns,
        expected_hits=expected_hits,
        corpus_extra=lambda w: w["tokens_per_turn"],
        # The last turn carries every earlier turn's message and reply (the chat template adds a few more).
        longest_request=lambda context, w: context + (w["turns"] - 1) * w["tokens_per_turn"] + w["output_tokens"],
        # Turn t carries the conversation so far; all of it but the newest turn can come from the cache.
        unit_requests=lambda context, w: tuple(
            (
                context + t * w["tokens_per_turn"],
                context + (t - 1) * w["tokens_per_turn"] if t else 0,
                w["output_tokens"],
            )
            for t in range(w["turns"])
        ),
        describe=lambda w: {"turns": w["turns"], "per_turn": w["tokens_per_turn"]},
        # Its rate is of conversations; each brings every turn's request.
        requests_per_arrival=lambda w: float(w.get("turns", 1)),
    )
)
