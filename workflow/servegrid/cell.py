"""Run one grid cell: ensure its server, run the workload, write the cell file."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from httpx_aiohttp import HttpxAiohttpClient

from servegrid import engines, hostinfo, metrics, modes, procs, records, server, state
from servegrid.client import Streamer, streaming_session
from servegrid.client_monitor import ClientMonitor, CollectorPause, StallGuard, stall_limit_s, warmup_stall_limit_s
from servegrid.config import Cell, Experiment, Operations
from servegrid.engines import Engine
from servegrid.errors import CellError, CellStalled
from servegrid.modes import WorkloadContext
from servegrid.prompts import PromptBuilder
from servegrid.request_record import RequestRecord

log = logging.getLogger(__name__)


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


async def measure(
    settings: dict[str, Any],
    engine: Engine,
    url: str,
    model: str,
    operations: Operations,
    headers: dict[str, str] | None = None,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Run a cell's workload against ``engine``'s server at ``url``, ``repeats`` times, each from a clean
    cache with fresh prompts. ``settings`` is :meth:`Experiment.cell_settings`' shape."""
    headers = headers or {}
    mode = modes.get(settings["mode"])
    concurrency = settings["concurrency"]
    timeout = httpx.Timeout(operations.request_timeout_s, connect=30.0)
    warmup_limit = warmup_stall_limit_s(operations.stall_floor_s, operations.request_timeout_s)
    all_records: list[RequestRecord] = []
    repeats: list[dict[str, Any]] = []
    with httpx.Client(timeout=120.0, headers=headers) as sync_client:

        def tokenize(text: str) -> list[int]:
            return engine.tokenize(sync_client, url, model, text)

        corpus = PromptBuilder(tokenize, settings["workload"]["seed"], mode.corpus_tokens(settings))
        # Control calls (metrics, cache resets) go through httpx's API over aiohttp's transport;
        # the measured streams through aiohttp itself, whose connections stamp every socket read
        # (servegrid.client; benchmarks/client_overhead.py measures what each path adds).
        async with (
            HttpxAiohttpClient(timeout=timeout, headers=headers) as client,
            streaming_session(concurrency + 4, operations.request_timeout_s, headers) as session,
        ):
            sampler = metrics.GaugeSampler(client, url, engine, model, operations.metrics_interval_s)
            monitor, collector = ClientMonitor(), CollectorPause()
            for repeat in range(settings["workload"]["repeats"]):
                cache_state = _reset_prefix_cache(engine, sync_client, url)
                ctx = WorkloadContext(
                    mode=settings["mode"],
                    context=settings["context"],
                    concurrency=concurrency,
                    workload=settings["workload"],
                    temperature=settings["sampling"]["temperature"],
                    model=model,
                    engine=engine,
                    streamer=Streamer(session, url),
                    builder=corpus.fresh(),
                    sync_client=sync_client,
                    url=url,
                )
                state: dict[str, Any] = {}

                guard = StallGuard(ctx.streamer)

                async def begin_measurement(
                    state: dict[str, Any] = state,
                    streamer: Streamer = ctx.streamer,
                    guard: StallGuard = guard,
                    records: list[RequestRecord] = ctx.records,
                ) -> None:
                    warmups = [r for r in records if r.phase == "warmup"]
                    limit = stall_limit_s(warmups, concurrency, operations.stall_floor_s, warmup_limit)
                    guard.tighten(limit, "from this cell's warm-up")
                    await streamer.open_connections(concurrency, engine.health_path)
                    state["before"] = await metrics.scrape(client, url, engine, model)
                    state["t0_ns"] = time.monotonic_ns()
                    state["first_sample"] = sampler.count
                    sampler.start()
                    monitor.start()
                    collector.start()

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
                        f"(limit {guard.limit_s:.0f} s, {guard.basis}): stopped, not reused"
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
                after = await metrics.scrape(client, url, engine, model)
                for record in ctx.records:
                    record.repeat, record.t0_ns = repeat, state["t0_ns"]
                all_records += ctx.records
                repeats.append(
                    {
                        "repeat": repeat,
                        "cache_state": cache_state,
                        "duration_s": (t1_ns - state["t0_ns"]) / 1e9,
                        "before": state["before"],
                        "after": after,
                        "delta": metrics.delta(state["before"], after),
                        "gauge_samples": [
                            {**s, "t": s["t"] - state["t0_ns"] / 1e9} for s in sampler.samples(state["first_sample"])
                        ],
                    }
                )
    counter_delta = metrics.sum_deltas([r["delta"] for r in repeats])
    server_metrics = {
        "delta": counter_delta,
        "derived": metrics.derived(counter_delta),
        "gauges": sampler.summary(),
    }
    measured = {
        "server_metrics": server_metrics,
        "client": monitor.summary() | {"cpus": sorted(os.sched_getaffinity(0))},
        "repeats": repeats,
        "duration_s": sum(r["duration_s"] for r in repeats),
        # The weakest guarantee any repeat had.
        "cache_state": "reset" if all(r["cache_state"] == "reset" for r in repeats) else "fresh content",
    }
    return all_records, measured


def run_cell(
    experiment: Experiment,
    cell: Cell,
    out_path: Path | str,
    owner: procs.ProcessRef | None,
    spec: dict[str, Any] | None = None,
    runtime: server.Runtime | None = None,
) -> dict[str, Any]:
    """Measure ``cell`` and write its file; returns the file's metadata."""
    spec = spec or experiment.launch_spec(cell.configuration)
    engine = engines.get(spec["engine"])
    settings = experiment.cell_settings(cell)
    configuration = experiment.configuration(cell.configuration)
    runtime = runtime or server.Runtime.from_config(experiment.operations, configuration)
    # A cell whose Snakemake is gone stops at once (its server is being stopped by its supervisor anyway);
    # nothing half-measured is written, since the cell file is written atomically at the end.
    watching = procs.watch(owner, lambda: _stop_orphaned_cell(cell, owner)) if owner is not None else None
    try:
        return _run_cell(experiment, cell, out_path, owner, spec, engine, settings, runtime)
    finally:
        if watching is not None:
            watching.set()


def _stop_orphaned_cell(cell: Cell, owner: procs.ProcessRef) -> None:
    log.error("cell %s: the process that owns this run (pid %d) is gone; stopping", cell.id, owner.pid)
    os.kill(os.getpid(), signal.SIGTERM)


def _supervisor_of(runtime: server.Runtime, configuration: str, session: str) -> procs.ProcessRef | None:
    record = state.read(state.record_path(runtime, configuration))
    if not record or record.get("session") != session:
        return None
    return procs.ProcessRef.from_dict(record.get("supervisor"))


def _stop_unsupervised_cell(cell: Cell, supervisor: procs.ProcessRef, session: str) -> None:
    # Killed, its server got SIGTERM from the kernel and stops its engine, but the API server then waits
    # for this cell's open streams to close (seen with vLLM 0.32): stop now, and let the teardown
    # (Snakemake's onerror, or the next cell's ensure) finish the server by its recorded processes.
    log.error(
        "cell %s: the supervisor (pid %d) of server session %s is gone, so the server is going down; stopping",
        cell.id, supervisor.pid, session,
    )  # fmt: skip
    os.kill(os.getpid(), signal.SIGTERM)


def _run_cell(
    experiment: Experiment,
    cell: Cell,
    out_path: Path | str,
    owner: procs.ProcessRef | None,
    spec: dict[str, Any],
    engine: Engine,
    settings: dict[str, Any],
    runtime: server.Runtime,
) -> dict[str, Any]:
    client_cpus = list(experiment.operations.client_cpus)
    hostinfo.check_cpus(client_cpus, "operations.client_cpus")
    started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
    with server.lease(cell.configuration, runtime):
        facts = server.ensure(spec, runtime, owner)
        need = experiment.longest_request(cell.mode, cell.context)
        if facts.max_model_len is not None and need > facts.max_model_len:
            # Where the config does not state the limit, the server's first answer does: fail before measuring.
            raise CellError(
                f"cell {cell.id}: workloads.{cell.mode}.contexts: at context {cell.context} a request holds about "
                f"{need} tokens, more than the {facts.max_model_len} the running server accepts"
            )
        if client_cpus:
            # After the server is up (it must not inherit them): off the server's cores, so that the
            # engine's busy threads do not delay the client's timestamps.
            os.sched_setaffinity(0, client_cpus)
        log.info("cell %s on %s (session %s)", cell.id, facts.url, facts.session)
        supervisor = _supervisor_of(runtime, cell.configuration, facts.session)
        watching_supervisor = (
            procs.watch(supervisor, lambda: _stop_unsupervised_cell(cell, supervisor, facts.session))
            if supervisor is not None
            else None
        )
        try:
            headers = server.auth_headers(spec)
            request_records, measured = run_loop(
                measure(settings, engine, facts.url, spec["served_name"], experiment.operations, headers)
            )
        except CellStalled as exc:
            # Hung: the next cell must not get it. The lease is this cell's, so stop it here (no longer
            # watching its supervisor, which this stop ends).
            if watching_supervisor is not None:
                watching_supervisor.set()
            server.discard(cell.configuration, runtime, reason=f"cell {cell.id} stalled")
            raise CellStalled(
                f"cell {cell.id}: {exc}\n"
                f"Server log: {facts.log_path}\n--- last lines ---\n{server.log_tail(facts.log_path)}"
            ) from None
        except httpx.HTTPError as exc:
            raise CellError(
                f"cell {cell.id}: lost the server at {facts.url}: {exc}\n"
                f"Server log: {facts.log_path}\n--- last lines ---\n{server.log_tail(facts.log_path)}"
            ) from exc
        finally:
            if watching_supervisor is not None:
                watching_supervisor.set()
    measured_records = [r for r in request_records if r.phase == "measured"]
    if measured_records and all(r.error for r in measured_records):
        # Nothing was measured: no file, so the cell stays stale and the failure is seen.
        raise CellError(
            f"cell {cell.id}: all {len(measured_records)} measured requests failed; "
            f"the first: {measured_records[0].error}"
        )
    meta = {
        "cell": asdict(cell) | {"id": cell.id},
        "settings": settings,
        "spec_hash": facts.spec_hash,
        "server": asdict(facts),
        "started_at": started_at,
        "ended_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        **measured,
    }
    records.write_cell(out_path, request_records, meta)
    return meta
