"""One cell's measured phase against a running server: warm-up, stages of closed-loop sessions, metrics.

Around the workload (a mode's runner, servegrid.modes) it keeps what judges the client's own timing
(:mod:`servegrid.measuring.client_monitor`), the server's gauges and counters, and the stall guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import httpx

from servegrid import modes
from servegrid.config import Operations
from servegrid.control_http import async_control_client, control_client
from servegrid.engines import Engine, metrics
from servegrid.errors import CellError, CellStalled, ServerLost
from servegrid.measuring.client import Streamer, streaming_session
from servegrid.measuring.client_monitor import (
    ClientMonitor,
    CollectorPause,
    StallGuard,
    stall_limit_s,
    warmup_stall_limit_s,
)
from servegrid.measuring.route import Route, route_order
from servegrid.modes.open_loop import OpenLoop
from servegrid.modes.prompts import PromptBuilder
from servegrid.modes.runner import WorkloadContext
from servegrid.modes.stages import StagePlan
from servegrid.records.request import RequestRecord


def run_loop(coroutine: Any) -> Any:
    """Run on uvloop where it exists: less client CPU per SSE event (benchmarks/client_overhead.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _reset_prefix_cache(engine: Engine, client: httpx.Client, url: str) -> str:
    """Empty the server's prefix cache if the engine lets us: the repeat's cache state.

    Either way every cell's prompts start with a fresh nonce, so no earlier cell
    can have left a reusable prefix; the reset also frees the blocks they occupy.
    """
    return "reset" if engine.reset_prefix_cache(client, url) else "fresh content"


# What a server lost outside a measured stream raises (a measured request's own failure is counted in its record):
# httpx for control calls, aiohttp underneath them (httpx_aiohttp) and for the connections opened before a stage.
TRANSPORT_ERRORS = (httpx.HTTPError, aiohttp.ClientError, ConnectionError, TimeoutError)


async def measure(
    settings: dict[str, Any],
    engine: Engine,
    url: str,
    model: str,
    operations: Operations,
    headers: dict[str, str] | None = None,
    routes: Sequence[Route] | None = None,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Run a cell's workload against ``engine``'s server at ``url``, ``repeats`` times, each from a clean
    cache with fresh prompts, once per route (default: direct) in each repeat. ``settings`` is
    :meth:`Experiment.cell_settings`' shape. The result's top level is the first route's; the others' are
    under ``other_routes``. A server that stops answering between requests: :class:`ServerLost`."""
    try:
        return await _measure(settings, engine, url, model, operations, headers, routes)
    except TRANSPORT_ERRORS as exc:
        raise ServerLost(f"{type(exc).__name__}: {exc}") from exc


async def _measure(
    settings: dict[str, Any],
    engine: Engine,
    url: str,
    model: str,
    operations: Operations,
    headers: dict[str, str] | None,
    routes: Sequence[Route] | None,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    headers = headers or {}
    routes = list(routes or [Route("direct", url, model, headers, engine.health_path)])
    mode = modes.get(settings["mode"])
    load = OpenLoop.for_cell(settings)
    # Connections the pool may hold: a session's each, or an open-loop cell's ceiling on requests in flight.
    connections = load.max_in_flight if load else settings["concurrency"]
    timeout = httpx.Timeout(operations.request_timeout_s, connect=30.0)
    warmup_limit = warmup_stall_limit_s(operations.stall_floor_s, operations.request_timeout_s)
    all_records: list[RequestRecord] = []
    repeats: dict[str, list[dict[str, Any]]] = {r.name: [] for r in routes}
    with control_client(120.0, headers) as sync_client:

        def tokenize(text: str) -> list[int]:
            return engine.tokenize(sync_client, url, model, text)

        corpus = PromptBuilder(tokenize, settings["workload"]["seed"], mode.corpus_tokens(settings))
        # Control calls (metrics, cache resets) go through httpx's API over aiohttp's transport;
        # the measured streams through aiohttp itself, whose connections stamp every socket read
        # (servegrid.measuring.client; benchmarks/client_overhead.py measures what each path adds).
        async with contextlib.AsyncExitStack() as stack:
            client = await stack.enter_async_context(async_control_client(timeout, headers))
            sessions = {
                r.name: await stack.enter_async_context(
                    streaming_session(connections + 4, operations.request_timeout_s, dict(r.headers))
                )
                for r in routes
            }
            # Per route: what the client's watch and the server's gauges saw during that route's stages only.
            samplers = {r.name: metrics.GaugeSampler(client, url, engine, model, operations.metrics_interval_s)
                        for r in routes}  # fmt: skip
            monitors = {r.name: ClientMonitor() for r in routes}
            collector = CollectorPause()
            for repeat in range(settings["workload"]["repeats"]):
                for route in route_order(routes, repeat):
                    phase = await _measure_phase(
                        settings, engine, url, model, operations, sync_client, client, corpus, route,
                        sessions[route.name], samplers[route.name], monitors[route.name], collector, warmup_limit,
                    )  # fmt: skip
                    records, summary = phase
                    for record in records:
                        record.repeat, record.route = repeat, route.name
                    all_records += records
                    repeats[route.name].append({"repeat": repeat, "route": route.name, **summary})
    by_route = {
        r.name: _route_summary(repeats[r.name], samplers[r.name], monitors[r.name]) | {"route": r.name} for r in routes
    }
    first = routes[0].name
    measured = by_route[first] | {"other_routes": {n: v for n, v in by_route.items() if n != first}}
    return all_records, measured


def _route_summary(repeats: list[dict[str, Any]], sampler: Any, monitor: ClientMonitor) -> dict[str, Any]:
    counter_delta = metrics.sum_deltas([r["delta"] for r in repeats])
    return {
        "server_metrics": {
            "delta": counter_delta,
            "derived": metrics.derived(counter_delta),
            "gauges": sampler.summary(),
        },
        "client": monitor.summary() | {"cpus": sorted(os.sched_getaffinity(0))},
        "repeats": repeats,
        "duration_s": sum(r["duration_s"] for r in repeats),
        "sampling": repeats[-1]["sampling"] if repeats else None,
        # An open-loop cell's runs (servegrid.modes.open_loop.OpenLoopOutcome), one per repeat; None: closed loop.
        "open_loop": [r["open_loop"] for r in repeats] if repeats and repeats[0].get("open_loop") else None,
        # The weakest guarantee any repeat had.
        "cache_state": "reset" if all(r["cache_state"] == "reset" for r in repeats) else "fresh content",
    }


def stall_ceiling_s(settings: dict[str, Any], request_timeout_s: float) -> float:
    """The longest a cell's stall guard waits for a token: the cell's own measuring budget (sequential sampling's
    ``max_duration_s``), at most the request timeout (a stream silent that long fails anyway)."""
    rule = (settings.get("sampling") or {}).get("rule") or {}
    budget = float(rule.get("max_duration_s") or math.inf)
    return min(budget, request_timeout_s)


async def _measure_phase(
    settings: dict[str, Any],
    engine: Engine,
    url: str,
    server_model: str,
    operations: Operations,
    sync_client: httpx.Client,
    client: Any,
    corpus: PromptBuilder,
    route: Route,
    session: Any,
    sampler: Any,
    monitor: ClientMonitor,
    collector: CollectorPause,
    warmup_limit: float,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """One measured phase of one repeat by one route: warm-up, stages, the server's counters around them."""
    mode = modes.get(settings["mode"])
    load = OpenLoop.for_cell(settings)
    # An open-loop cell has no sessions: it opens connections for the requests its rate keeps in flight.
    concurrency = settings["concurrency"] or 1
    model = route.model
    ceiling_s = stall_ceiling_s(settings, operations.request_timeout_s)
    cache_state = _reset_prefix_cache(engine, sync_client, url)
    plan = StagePlan.from_settings(settings, mode.primary)
    ctx = WorkloadContext(
        mode=settings["mode"],
        context=settings["context"],
        concurrency=concurrency,
        open_loop=load,
        speedup=float(settings.get("speedup") or 1.0),
        workload=settings["workload"],
        temperature=settings["sampling"]["temperature"],
        model=model,
        engine=engine,
        streamer=Streamer(session, route.url, route.per_chunk_usage),
        builder=corpus.fresh(),
        sync_client=sync_client,
        url=url,
        plan=plan,
        # Tokenizer and chat-template calls go to the server under its own name, whatever the route calls it.
        server_model=server_model,
    )
    state: dict[str, Any] = {}
    guard = StallGuard(ctx.streamer)

    async def begin_measurement() -> None:
        nonlocal concurrency
        warmups = [r for r in ctx.records if r.phase == "warmup"]
        if load is not None:  # Little's law on the warm-up's latency: the requests in flight at the offered rate
            latency_s = max(((r.end_ns or r.sent_ns) - r.sent_ns) / 1e9 for r in warmups) if warmups else 1.0
            concurrency = load.expected_in_flight(latency_s)
        limit = stall_limit_s(warmups, concurrency, operations.stall_floor_s, warmup_limit, ceiling_s)
        basis = "from this cell's warm-up" if limit < ceiling_s else "the cell's own budget, its ceiling"
        guard.tighten(limit, basis)
        await ctx.streamer.open_connections(concurrency, *route.connection_check())
        state["before"] = await metrics.scrape(client, url, engine, server_model)
        state["t0_ns"] = time.monotonic_ns()
        state["first_sample"] = sampler.count
        sampler.start()
        monitor.start()
        collector.start()

    async def pause_timing() -> None:
        collector.stop()  # a good moment for the collections it held back
        await monitor.stop()
        await sampler.stop()  # the server's gauges, like the client's watch, cover the stages only

    async def resume_timing() -> None:
        # The server closes idle keep-alive connections (vLLM after 5 s): open them again before
        # the stage, or its sessions all connect at once while they are timed.
        await ctx.streamer.open_connections(concurrency, *route.connection_check())
        sampler.start()
        monitor.start()
        collector.start()

    ctx.pause_timing, ctx.resume_timing = pause_timing, resume_timing
    state["work"] = work = asyncio.ensure_future(mode.run(ctx, begin_measurement))
    # From the first request on: an engine that hangs during the warm-up is found too.
    guard.start(work, warmup_limit, "during the warm-up: 10 × operations.stall_floor_s")
    try:
        await work
    except asyncio.CancelledError:
        if guard.stalled_s is None:
            raise
        raise CellStalled(
            f"the server made no progress for {guard.stalled_s:.0f} s with requests in flight "
            f"(limit {guard.limit_s:.0f} s, {guard.basis}){' through the gateway' if route.name == 'proxy' else ''}: "
            "stopped, not reused"
        ) from None
    finally:
        await guard.stop()
        collector.stop()
        await monitor.stop()
        await sampler.stop()
    t1_ns = time.monotonic_ns()
    ctx.streamer.decode_pending()
    if "t0_ns" not in state:
        raise CellError("the workload ended before its measured phase began")
    after = await metrics.scrape(client, url, engine, server_model)
    for record in ctx.records:
        record.t0_ns = state["t0_ns"]
    outcome = ctx.open_outcome
    if outcome is not None:
        duration_s = outcome.window_s  # the measured arrivals' span: not the ramp, not the drain
    else:
        # The stages' time, without the pauses between them (multi-turn builds its next
        # conversations there): what throughput and goodput are per second of.
        duration_s = plan.active_s if plan.stages else (t1_ns - state["t0_ns"]) / 1e9
    return ctx.records, {
        "cache_state": cache_state,
        "duration_s": duration_s,
        "open_loop": outcome.summary() if outcome is not None else None,
        "sampling": plan.summary(),
        "before": state["before"],
        "after": after,
        "delta": metrics.delta(state["before"], after),
        "gauge_samples": [{**s, "t": s["t"] - state["t0_ns"] / 1e9} for s in sampler.samples(state["first_sample"])],
    }
