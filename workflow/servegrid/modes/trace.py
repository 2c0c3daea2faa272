"""trace: a request trace replayed on its own schedule, token-exact and prefix-exact.

The trace (servegrid.modes.trace_file: Mooncake JSONL or CSV, or the seeded generator) gives every arrival's time,
prompt and output length and which fixed-size blocks of its prompt it shares with other requests (``hash_ids``). Each
block id becomes one block of exactly ``block_tokens`` tokens, the same wherever it appears in the cell run
(servegrid.modes.trace_prompts), so requests that share ids in the trace share exactly those tokens on the wire, and the
server's prefix cache sees the trace's own reuse. A session's turns go in order, each after the previous answer plus its
delay; outputs are exact, as in every mode. Arrivals go out at their due times whatever the server does
(servegrid.load.strategies.ReplayStrategy), ``speedup`` times as fast as the trace. Two grid axes: the speedups and the
trace's ``windows`` (``ctx0_x2``: the whole trace at 2x; ``ctx0_x2_w600+300``: from 600 s for 300 s; a trace cell has no
context of its own, the trace gives every length). After a window's arrivals come the trace's next ones, the drain, so
the window's last requests meet the trace's own load. Primary figure: TTFT p50.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Mapping
from typing import Any

import pandas as pd

from servegrid.errors import ConfigError
from servegrid.load import ReplayArrivals, ReplayStrategy, Unit, Work
from servegrid.modes import trace_source
from servegrid.modes.base import N_, FigureSpec, Mode, PrefixCache, Primary
from servegrid.modes.registry import register
from servegrid.modes.runner import MeasureHook, WorkloadContext, measure_units, send_one_by_one
from servegrid.modes.trace_file import Trace
from servegrid.modes.trace_prompts import ArrivalPrompts, BlockPrompts
from servegrid.records.cell_settings import CellSettings


async def run(ctx: WorkloadContext, measure: MeasureHook) -> None:
    replay = trace_source.replayed(ctx.workload)
    trace = replay.sent  # the window's arrivals, then the drain's
    load = ctx.load
    if not isinstance(load, ReplayStrategy):
        raise ValueError("a trace cell is an open-loop cell (its load is a speedup)")
    prompts = BlockPrompts(ctx.builder, trace.block_tokens)
    # Warm-up: cold prompts of the trace's median length, none of them a trace block, so the cache holds nothing
    # of the trace when its first arrival comes.
    median = int(statistics.median(r.input_tokens for r in replay.window.requests))
    warmups = [ctx.builder.unique(median, f"warmup {i}") for i in range(ctx.workload["warmup_requests"])]
    await send_one_by_one(ctx, "warmup", warmups)
    first_ms = trace.conversations[0].arrival_ms

    def prepare(units: list[tuple[int, int]]) -> ArrivalPrompts:
        return ArrivalPrompts(trace, prompts, [i for _, i in units])

    async def arrives(unit: Unit, turn_prompts: list[list[int]], due_ns: int) -> int:
        """One arrival: a request, or a session's turns one after another (each due at its own timestamp or its
        delay after the previous answer, at the load's pace, and never before that answer)."""
        intended = due_ns
        previous = None
        index = unit.seq
        for number, (request, prompt) in enumerate(zip(trace.conversations[index].turns, turn_prompts, strict=True)):
            if previous is not None:
                answered = previous.end_ns or time.monotonic_ns()
                if request.delay_ms is not None:
                    intended = answered + load.at_pace_ns(request.delay_ms)
                else:
                    since = ctx.measuring_since_ns or answered
                    intended = max(answered, since + load.at_pace_ns((request.timestamp_ms or 0) - first_ms))
                await asyncio.sleep(max(0.0, (intended - time.monotonic_ns()) / 1e9))
            record = ctx.new_record(
                unit.session, index, unit.phase, len(prompt), turn=number + 1, output_tokens=request.output_tokens
            )
            record.intended_send_ns = intended
            await ctx.complete(record, prompt)
            if record.error:  # the conversation cannot go on without its answer
                break
            previous = record
        return intended

    await measure_units(ctx, measure, Work(prepare, arrives))


def arrivals(settings: Mapping[str, Any]) -> ReplayArrivals:
    """What a cell replays, as its load paces it: every arrival's time at 1x (its window's, then its drain's)."""
    replay = trace_source.replayed(settings)
    return ReplayArrivals(tuple(replay.sent.due_offsets_s(1.0)), len(replay.window.conversations))


def reusable_tokens(trace: Trace, cache: PrefixCache) -> dict[tuple[int, int], int]:
    """Per request (arrival index, turn): the prompt tokens a prefix cache can hold from earlier requests of the
    trace, in the order they are due, in the cache's whole blocks. Two requests share ``k`` leading block ids:
    they share ``k`` blocks, at most the shorter prompt (a last block is partial); the server computes at least
    a prompt's last token itself."""
    seen: dict[tuple[int, ...], tuple[int, int]] = {}  # prefix of ids -> (longest prompt carrying it, times seen)
    out: dict[tuple[int, int], int] = {}
    order = sorted(
        (
            (c.arrival_ms, index, turn, request)
            for index, c in enumerate(trace.conversations)
            for turn, request in enumerate(c.turns, start=1)
        ),
        key=lambda item: (item[0], item[1], item[2]),
    )
    block = trace.block_tokens
    for _, index, turn, request in order:
        shared = 0
        for k in range(1, len(request.hash_ids) + 1):
            carried = seen.get(request.hash_ids[:k])
            if carried is None:
                break
            if carried[1] >= max(cache.sightings, 1):
                shared = max(shared, min(k * block, carried[0]))
        out[(index, turn)] = cache.hit_tokens(min(shared, request.input_tokens - 1))
        for k in range(1, len(request.hash_ids) + 1):
            longest, times = seen.get(request.hash_ids[:k], (0, 0))
            seen[request.hash_ids[:k]] = (max(longest, min(k * block, request.input_tokens)), times + 1)
    return out


def expected_hits(settings: CellSettings, measured: pd.DataFrame, cache: PrefixCache) -> float:
    """The trace's own reuse over the measured requests (:func:`reusable_tokens`). An upper bound where requests
    sharing a prefix overlap in time: a block is cached once its computation is done."""
    reusable = reusable_tokens(trace_source.replayed(settings.workload).sent, cache)
    hits = sum(reusable.get((int(r.seq), int(r.turn)), 0) for r in measured.itertuples())
    total = float(measured["prompt_tokens_reported"].astype(float).sum())
    return hits / total if total else 0.0


def resolve(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The whole trace's identity (its content's hash, its size): what the report and its figures show. A cell's
    settings hold what that cell replays instead (:func:`windows`)."""
    source = settings["source"]
    if (source.get("file") is None) == (source.get("generate") is None):
        raise ConfigError("source: give either file (a trace to replay) or generate (the seeded one)")
    return {"trace": trace_source.identity(trace_source.whole(settings))}


def windows(settings: Mapping[str, Any], drain_arrivals: int) -> dict[str, dict[str, Any]]:
    """Per window (by its label, the last part of its cells' names), the workload settings of its cells: the
    window, the drain after it and what they replay (servegrid.modes.trace_source.cell_workload)."""
    listed = trace_source.windows(settings)
    if len(set(listed)) < len(listed):
        raise ConfigError("windows: a window is listed twice")
    return {w.label: trace_source.cell_workload(settings, w, drain_arrivals) for w in listed}


def sent(settings: Mapping[str, Any]) -> Trace:
    """What a cell sends, from its workload settings: its window's arrivals and its drain's."""
    return trace_source.replayed(settings).sent


def where_longest(settings: Mapping[str, Any]) -> str:
    trace = sent(settings)
    return f"the trace's request at {trace.source}:{trace.longest().line}"


def median_request(trace: Trace) -> tuple[int, int, int]:
    middle = sorted(trace.requests, key=lambda r: r.total_tokens)[len(trace.requests) // 2]
    return middle.input_tokens, 0, middle.output_tokens


def describe(settings: Mapping[str, Any]) -> dict[str, Any]:
    trace = trace_source.whole(settings)
    return {
        "requests": len(trace.requests),
        "arrivals": len(trace.conversations),
        "span": round(trace.span_s),
        "block": trace.block_tokens,
    }


GENERATE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "description": "The seeded generator's settings (servegrid.modes.trace_generator.TraceShape); every one "
    "has a default.",
    "properties": {
        **{k: {"type": "integer", "minimum": 0} for k in ("seed", "system_prompts", "system_prompt_blocks")},
        **{k: {"type": "integer", "minimum": 1} for k in ("input_median", "output_median", "max_input", "max_output")},
        "max_turns": {"type": "integer", "minimum": 2},
        **{k: {"type": "number", "exclusiveMinimum": 0} for k in ("duration_s", "rate", "burstiness")},
        **{k: {"type": "number", "minimum": 0} for k in ("input_sigma", "output_sigma", "think_mean_s")},
        **{k: {"type": "number", "minimum": 0, "maximum": 1} for k in ("system_prompt_share", "session_share")},
    },
}

MODE = register(
    Mode(
        name="trace",
        run=run,
        primary=Primary(
            "ttft_s",
            higher_is_better=False,
            unit="seconds",
            axis_label=N_("TTFT p50 (s)"),
            header=N_("TTFT p50"),
            verdict_word="TTFT",
        ),
        title=N_("Trace"),
        short_title=N_("Trace replay"),
        class_title=N_("Your traffic, replayed from a trace"),
        section_title=N_("Trace replay: your traffic on its own schedule"),
        description=N_(
            "%(requests)s requests (%(arrivals)s arrivals over %(span)s s) replayed at their own times, at each "
            "speedup of the trace's pace; requests that share blocks of %(block)s tokens in the trace share exactly "
            "those tokens, so the prefix cache sees the trace's own reuse."
        ),
        context_title=N_("the trace's own lengths"),
        context_header=N_("Trace"),
        open_loop=True,
        schema={
            "contexts": {
                "description": "A trace cell has no context of its own (the trace gives every length): [0].",
                "type": "array",
                "items": {"const": 0},
                "minItems": 1,
                "maxItems": 1,
                "default": [0],
            },
            "speedups": {
                "description": "The load axis: replay at these multiples of the trace's pace (cells ctx0_x<speedup>).",
                "type": "array",
                "uniqueItems": True,
                "minItems": 1,
                "items": {"type": "number", "exclusiveMinimum": 0},
                "default": [1],
            },
            "source": {
                "type": "object",
                "additionalProperties": False,
                "default": {"generate": {}},
                "properties": {
                    "file": {"type": ["string", "null"], "description": "A Mooncake JSONL or CSV trace (by suffix)."},
                    "format": {"enum": ["auto", "mooncake", "csv"], "default": "auto"},
                    "generate": {"oneOf": [{"type": "null"}, GENERATE_SCHEMA]},
                },
            },
            "block_tokens": {
                "description": "Tokens per hash_ids block (Mooncake's traces: 512).",
                "type": "integer",
                "minimum": 16,
                "default": 512,
            },
            "windows": {
                "description": "The parts of the trace replayed, a grid axis beside the speedups: each from start_s "
                "after the trace's first arrival, for duration_s (null: to the end). Cells ctx0_x<speedup> for the "
                "whole trace (the default), ctx0_x<speedup>_w<start>[+<duration>] for any other window.",
                "type": "array",
                "minItems": 1,
                "default": [{"start_s": 0, "duration_s": None}],
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "start_s": {"type": "number", "minimum": 0, "default": 0},
                        "duration_s": {"type": ["number", "null"], "exclusiveMinimum": 0, "default": None},
                    },
                },
            },
        },
        defaults={"output_tokens": 2, "requests_per_session": 1},  # output_tokens: the warm-up's (the trace says each)
        figures=(
            FigureSpec(
                "trace_shape",
                "trace_shape",
                N_("The replayed trace"),
                N_(
                    "What was replayed, at 1x: arrivals per second over time, prompt and output lengths, and the "
                    "share of each prompt that earlier requests of the trace carried (prefix reuse)."
                ),
            ),
        ),
        expected_hits=expected_hits,
        longest_request=lambda context, w: sent(w).longest().total_tokens,
        # What servegrid estimate prices a request by: the window's median one.
        unit_requests=lambda context, w: (median_request(trace_source.replayed(w).window),),
        describe=describe,
        resolve=resolve,
        windows=windows,
        longest_where=where_longest,
        arrivals=arrivals,
    )
)
