"""One cell's measured phase against a running server: warm-up, stages of closed-loop sessions, metrics.

Around the workload (a mode's runner, servegrid.modes) it keeps what judges the client's own timing
(:mod:`servegrid.measuring.client_monitor`), the server's gauges and counters, and the stall guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx

from servegrid import load, modes
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
from servegrid.measuring.gpu_watch import GpuWatch
from servegrid.measuring.route import Route, route_order
from servegrid.modes.prompts import PromptBuilder
from servegrid.modes.runner import WorkloadContext
from servegrid.records.cell_settings import CellSettings
from servegrid.records.request import RequestRecord

log = logging.getLogger(__name__)


def run_loop(coroutine: Any) -> Any:
    """Run on uvloop where it exists: less client CPU per SSE event (benchmarks/client_overhead.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


# vLLM refuses a reset while blocks are still held (a request of the warm-up still being freed, an in-flight KV
# transfer) and says callers may retry: again after each of these pauses, 6.3 s in all.
RESET_RETRY_PAUSES_S = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


def _reset_prefix_cache(engine: Engine, client: httpx.Client, url: str) -> str:
    """Empty the server's prefix cache if the engine lets us: the repeat's cache state.

    Either way every cell's prompts start with a fresh nonce, so no earlier cell
    can have left a reusable prefix; the reset also frees the blocks they occupy.
    """
    outcome = engine.reset_prefix_cache(client, url)
    for pause in RESET_RETRY_PAUSES_S:
        if outcome != "blocks held":
            break
        log.info("prefix cache reset refused by the engine (blocks still held): again in %.1f s", pause)
        time.sleep(pause)
        outcome = engine.reset_prefix_cache(client, url)
    if outcome == "blocks held":
        log.warning(
            "prefix cache not reset: the engine still held blocks after %.1f s of retries; this repeat starts from "
            "fresh prompt content instead (its cache state says so)",
            sum(RESET_RETRY_PAUSES_S),
        )
    return "reset" if outcome == "reset" else "fresh content"


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
    gpus: GpuWatch | None = None,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Run a cell's workload against ``engine``'s server at ``url``, ``repeats`` times, each from a clean
    cache with fresh prompts, once per route (default: direct) in each repeat. ``settings`` is
    :meth:`Experiment.cell_settings`' shape. The result's top level is the first route's; the others' are
    under ``other_routes``; ``gpus`` watches the server's GPUs during every stage (its summary: ``gpus``). A
    server that stops answering between requests: :class:`ServerLost`."""
    try:
        return await _measure(settings, engine, url, model, operations, headers, routes, gpus)
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
    gpus: GpuWatch | None,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    headers = headers or {}
    routes = list(routes or [Route("direct", url, model, headers, engine.health_path)])
    typed = CellSettings(settings)
    mode = modes.get(typed.mode)
    # Connections the pool may hold: a session's each, or an open-loop cell's ceiling on requests in flight.
    connections = load.for_cell(settings, mode.arrivals).connections
    timeout = httpx.Timeout(operations.request_timeout_s, connect=30.0)
    warmup_limit = warmup_stall_limit_s(operations.stall_floor_s, operations.request_timeout_s)
    all_records: list[RequestRecord] = []
    repeats: dict[str, list[dict[str, Any]]] = {r.name: [] for r in routes}
    with control_client(120.0, headers) as sync_client:

        def tokenize(text: str) -> list[int]:
            return engine.tokenize(sync_client, url, model, text)

        corpus = PromptBuilder(tokenize, typed.seed, mode.corpus_tokens(typed))
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
            samplers = {
                r.name: metrics.GaugeSampler(client, url, engine, model, operations.metrics_interval_s) for r in routes
            }
            monitors = {r.name: ClientMonitor() for r in routes}
            parts = PhaseParts(settings, corpus, CollectorPause(), warmup_limit, gpus)
            server = ServerHandles(engine, url, model, operations, sync_client, client)
            # A top-up measures repeats numbered after its cell's (CellSettings.first_repeat).
            for repeat in range(typed.first_repeat, typed.first_repeat + typed.repeats):
                for route in route_order(routes, repeat):
                    tools = RouteTools(route, sessions[route.name], samplers[route.name], monitors[route.name])
                    records, summary = await _measure_phase(parts, server, tools)
                    for record in records:
                        record.repeat, record.route = repeat, route.name
                    all_records += records
                    repeats[route.name].append({"repeat": repeat, "route": route.name, **summary})
    by_route = {
        r.name: _route_summary(repeats[r.name], samplers[r.name], monitors[r.name]) | {"route": r.name} for r in routes
    }
    first = routes[0].name
    measured = by_route[first] | {"other_routes": {n: v for n, v in by_route.items() if n != first}}
    measured["gpus"] = gpus.summary() if gpus is not None else None  # every route's stages, one summary
    return all_records, measured


def _route_summary(repeats: list[dict[str, Any]], sampler: Any, monitor: ClientMonitor) -> dict[str, Any]:
    counter_delta = metrics.sum_deltas([r["delta"] for r in repeats])
    return {
        "server_metrics": {
            "delta": counter_delta,
            "derived": metrics.derived(counter_delta),
            "gauges": sampler.summary(),
        },
        "client": monitor.summary()
        | {
            "cpus": sorted(os.sched_getaffinity(0)),
            "requests_in_window": sum(r["requests_in_window"] for r in repeats),
        },
        "repeats": repeats,
        "duration_s": sum(r["duration_s"] for r in repeats),
        "sampling": repeats[-1]["sampling"] if repeats else None,
        # An open-loop cell's runs (servegrid.load.open_loop.OpenLoopOutcome), one per repeat; None: closed loop.
        "open_loop": [r["open_loop"] for r in repeats] if repeats and repeats[0].get("open_loop") else None,
        # The weakest guarantee any repeat had.
        "cache_state": "reset" if all(r["cache_state"] == "reset" for r in repeats) else "fresh content",
    }


def stall_ceiling_s(settings: dict[str, Any], request_timeout_s: float) -> float:
    """The longest a cell's stall guard waits for a token: the cell's own measuring budget (sequential sampling's
    ``max_duration_s``), at most the request timeout (a stream silent that long fails anyway)."""
    rule = CellSettings(settings).rule or {}
    budget = float(rule.get("max_duration_s") or math.inf)
    return min(budget, request_timeout_s)


@dataclass(frozen=True)
class ServerHandles:
    """What every phase of a cell reaches its server through, whichever route it measures: the engine at ``url``
    under its own name ``model`` (tokenizer, chat-template and metrics calls), the cell's limits, and the two
    control clients (blocking: tokenizer, cache reset; async: metrics)."""

    engine: Engine
    url: str
    model: str
    operations: Operations
    sync_client: httpx.Client
    client: Any


@dataclass(frozen=True)
class RouteTools:
    """One route's own: its streaming session, and what watches the server's gauges and the client's timing
    during its stages only."""

    route: Route
    session: Any
    sampler: Any
    monitor: ClientMonitor


@dataclass(frozen=True)
class PhaseParts:
    """What every phase of one cell shares: its settings, its prompts' corpus, the collector held back during its
    stages, and the stall limit of its warm-ups."""

    settings: dict[str, Any]
    corpus: PromptBuilder
    collector: CollectorPause
    warmup_limit: float
    gpus: GpuWatch | None = None


async def _measure_phase(
    parts: PhaseParts, server: ServerHandles, tools: RouteTools
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """One measured phase of one repeat by one route: warm-up, stages, the server's counters around them."""
    route = tools.route
    mode = modes.get(CellSettings(parts.settings).mode)
    cache_state = _reset_prefix_cache(server.engine, server.sync_client, server.url)
    streamer = Streamer(tools.session, route.url, route.per_chunk_usage)
    ctx = _workload_context(parts, server, tools, streamer)
    guard = StallGuard(streamer)
    timing = _PhaseTiming(parts, server, tools, ctx, streamer, guard)
    ctx.pause_timing, ctx.resume_timing = timing.pause, timing.resume
    work = asyncio.ensure_future(mode.run(ctx, timing.begin))
    # From the first request on: an engine that hangs during the warm-up is found too.
    guard.start(work, parts.warmup_limit, "during the warm-up: 10 × operations.stall_floor_s")
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
        await timing.pause()
    t1_ns = time.monotonic_ns()
    streamer.decode_pending()
    if timing.t0_ns is None:
        raise CellError("the workload ended before its measured phase began")
    after = await metrics.scrape(server.client, server.url, server.engine, server.model)
    for record in ctx.records:
        record.t0_ns = timing.t0_ns
    return ctx.records, _phase_summary(ctx, timing, cache_state, after, t1_ns)


def _workload_context(
    parts: PhaseParts, server: ServerHandles, tools: RouteTools, streamer: Streamer
) -> WorkloadContext:
    """What the mode's runner sends through: the cell's settings, the route's streams, a fresh prompt builder."""
    settings, route = parts.settings, tools.route
    typed = CellSettings(settings)
    mode = modes.get(typed.mode)
    return WorkloadContext(
        mode=typed.mode,
        context=typed.context,
        workload=typed.workload,
        temperature=typed.temperature,
        model=route.model,
        engine=server.engine,
        streamer=streamer,
        builder=parts.corpus.fresh(),
        sync_client=server.sync_client,
        url=server.url,
        plan=load.StagePlan.from_settings(settings, mode.primary),
        load=load.for_cell(settings, mode.arrivals),
        # Tokenizer and chat-template calls go to the server under its own name, whatever the route calls it.
        server_model=server.model,
    )


class _PhaseTiming:
    """When the measured phase begins (the stall guard tightened, the connections opened, the server's counters
    read) and the pauses between its stages, around which what watches the timing stops and starts again."""

    def __init__(
        self,
        parts: PhaseParts,
        server: ServerHandles,
        tools: RouteTools,
        ctx: WorkloadContext,
        streamer: Streamer,
        guard: StallGuard,
    ) -> None:
        self.parts, self.server, self.tools, self.ctx, self.guard = parts, server, tools, ctx, guard
        self.streamer = streamer
        self.concurrency = ctx.load.connections  # until begin(): the connections it expects in flight
        self.ceiling_s = stall_ceiling_s(parts.settings, server.operations.request_timeout_s)
        self.before: dict[str, Any] = {}
        self.t0_ns: int | None = None
        self.first_sample = 0
        self.energy_mj_before: int | None = None  # the GPU watch's count when this phase began (it spans repeats)

    async def begin(self) -> None:
        warmups = [r for r in self.ctx.records if r.phase == "warmup"]
        # Sessions: one each; open loop: Little's law on the warm-up's latency, the requests in flight at its rate.
        self.concurrency = self.ctx.load.expected_in_flight(warmups)
        operations = self.server.operations
        limit = stall_limit_s(
            warmups, self.concurrency, operations.stall_floor_s, self.parts.warmup_limit, self.ceiling_s
        )
        basis = "from this cell's warm-up" if limit < self.ceiling_s else "the cell's own budget, its ceiling"
        self.guard.tighten(limit, basis)
        await self.streamer.open_connections(self.concurrency, *self.tools.route.connection_check())
        server = self.server
        self.before = await metrics.scrape(server.client, server.url, server.engine, server.model)
        self.t0_ns = time.monotonic_ns()
        self.first_sample = self.tools.sampler.count
        self.energy_mj_before = self.parts.gpus.energy_mj if self.parts.gpus is not None else None
        self._start_watching()

    async def pause(self) -> None:
        self.parts.collector.stop()  # a good moment for the collections it held back
        await self.tools.monitor.stop()
        await self.tools.sampler.stop()  # the server's gauges, like the client's watch, cover the stages only
        if self.parts.gpus is not None:
            await self.parts.gpus.stop()

    async def resume(self) -> None:
        # The server closes idle keep-alive connections (vLLM after 5 s): open them again before
        # the stage, or its sessions all connect at once while they are timed.
        await self.streamer.open_connections(self.concurrency, *self.tools.route.connection_check())
        self._start_watching()

    def _start_watching(self) -> None:
        self.tools.sampler.start()
        if self.parts.gpus is not None:
            self.parts.gpus.start()
        self.tools.monitor.start()
        self.parts.collector.start()


def _phase_summary(
    ctx: WorkloadContext, timing: _PhaseTiming, cache_state: str, after: dict[str, Any], t1_ns: int
) -> dict[str, Any]:
    """The repeat's summary: its cache state, duration, open-loop run, sampling, the server's counters and gauges."""
    t0_ns = timing.t0_ns or 0
    plan, outcome = ctx.plan, ctx.open_outcome
    if outcome is not None:
        duration_s = outcome.window_s  # the measured arrivals' span: not the ramp, not the drain
    else:
        # The stages' time, without the pauses between them (multi-turn builds its next
        # conversations there): what throughput and goodput are per second of.
        duration_s = plan.active_s if plan.stages else (t1_ns - t0_ns) / 1e9
    samples = timing.tools.sampler.samples(timing.first_sample)
    return {
        "cache_state": cache_state,
        "duration_s": duration_s,
        "open_loop": outcome.summary() if outcome is not None else None,
        "sampling": plan.summary(),
        "before": timing.before,
        "after": after,
        "delta": metrics.delta(timing.before, after),
        # Every request of ours the server could have counted between the two scrapes: those not finished before
        # the first. A server that counted more first tokens served someone else's requests too.
        "requests_in_window": sum(1 for r in ctx.records if r.end_ns is None or r.end_ns >= t0_ns),
        "gauge_samples": [{**s, "t": s["t"] - t0_ns / 1e9} for s in samples],
        # What this repeat's stages drew, by this route alone (None: not measured; the watch says why).
        "gpu_energy_j": _energy_j(timing),
    }


def _energy_j(timing: _PhaseTiming) -> float | None:
    gpus, before = timing.parts.gpus, timing.energy_mj_before
    if gpus is None or gpus.energy_mj is None or before is None:
        return None
    return (gpus.energy_mj - before) / 1000
