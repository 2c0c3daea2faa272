"""Run one grid cell: ensure its server, measure (servegrid.measuring.measured_phase), write the cell file.

A cell whose Snakemake or whose server's supervisor goes away stops at once, writing nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from servegrid import engines, progress
from servegrid.config import Cell, Experiment
from servegrid.engines import Engine
from servegrid.errors import CellError, CellFileError, CellStalled, EngineRefused, GatewayError, ServerLost
from servegrid.measuring import gateway_check, measured_phase
from servegrid.records import cell_file
from servegrid.serving import gateway, hostinfo, launch, placement, procs, server, state

log = logging.getLogger(__name__)

RECENT_CELLS = 20  # the grid's ETA: the mean wall time of this many most recently written cells


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


def _routes(
    experiment: Experiment,
    cell: Cell,
    engine: Engine,
    facts: server.ServerFacts,
    headers: dict[str, str],
    runtime: server.Runtime,
    owner: procs.ProcessRef | None,
    held: contextlib.ExitStack,
    host_cpus: list[int],
) -> tuple[list[measured_phase.Route], dict[str, Any] | None]:
    """The cell's routes (experiment.routes()), and what its gateway is and changes; with a gateway, its lease
    is entered on ``held`` (kept until the cell is measured)."""
    served = experiment.model.served_name
    direct = measured_phase.Route(
        "direct", facts.url, served, headers, engine.health_path,
        identity=launch.identity(facts.session), names_path=engine.names_path, names=engine.names,
    )  # fmt: skip
    if experiment.route == "direct":
        return [direct], None
    proxy = experiment.proxy
    assert proxy is not None  # checks._gateway
    held.enter_context(gateway.lease(runtime))
    # Not the client's cores, which a process started from here would inherit (proxy.cpus, else the host's).
    if set(proxy.cpus) - set(host_cpus):
        raise GatewayError(f"proxy.cpus: CPU(s) {sorted(set(proxy.cpus) - set(host_cpus))} are not available here "
                           f"(this job may use {host_cpus})")  # fmt: skip
    facts_gw = gateway.ensure(experiment, cell.configuration, runtime, owner, list(proxy.cpus) or host_cpus)
    model, gw_headers = facts_gw.model(cell.configuration, proxy), gateway.headers(proxy)
    findings = gateway_check.check(engine, facts.url, headers, served, facts_gw.url, gw_headers, model, chat=True)
    if not findings["per_chunk_usage"]:
        log.info("cell %s: the gateway drops the per-chunk token count; tokens are counted by chunk", cell.id)
    proxied = measured_phase.Route(
        "proxy", facts_gw.url, model, gw_headers, gateway.LiteLLMProbe.health_path, findings["per_chunk_usage"],
        identity=launch.identity(facts_gw.session) if facts_gw.started_by_servegrid and facts_gw.session else None,
        names_path=gateway.LiteLLMProbe.names_path, names=gateway.LiteLLMProbe.names,
    )  # fmt: skip
    routes = {"direct": [direct], "proxy": [proxied], "both": [direct, proxied]}[experiment.route]
    return routes, {"facts": asdict(facts_gw), "model": model, "check": findings}


def _raise_if_gateway_ended(cell: Cell, runtime: server.Runtime, gateway_meta: dict[str, Any] | None) -> None:
    """A cell measured through servegrid's own gateway, which is gone now (killed, crashed): its proxied requests
    failed for the gateway's sake, not the configuration's, so nothing is written and the next run measures the
    cell again (a cell file would stand, invalid, for good)."""
    gateway_facts = (gateway_meta or {}).get("facts") or {}
    if not gateway_facts.get("started_by_servegrid"):
        return
    record = state.read(state.record_path(runtime, state.GATEWAY))
    if record and record.get("session") == gateway_facts["session"] and state.supervised(record):
        return
    log_path = gateway_facts["log_path"]
    raise CellError(
        f"cell {cell.id}: the gateway (session {gateway_facts['session']}) ended while the cell measured through "
        f"it: nothing written, the next run measures the cell again.\n"
        f"Gateway log: {log_path}\n--- last lines ---\n{launch.log_tail(log_path)}"
    )


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
    configuration = experiment.configuration(cell.configuration)
    client_cpus = placement.place(
        configuration.name, configuration.cpus, configuration.gpus, experiment.operations.client_cpus
    ).client_cpus
    hostinfo.check_cpus(client_cpus, "operations.client_cpus")
    started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
    log.info("%s", grid_line(experiment, cell))
    with server.lease(cell.configuration, runtime):
        try:
            facts = server.ensure(spec, runtime, owner)
        except EngineRefused as refused:
            return _write_refused(cell, out_path, settings, started_at, refused)
        need = experiment.longest_request(cell)
        if facts.max_model_len is not None and need > facts.max_model_len:
            # Where the config does not state the limit, the server's first answer does: fail before measuring.
            raise CellError(
                f"cell {cell.id}: workloads.{cell.mode}.contexts: at context {cell.context} a request holds about "
                f"{need} tokens, more than the {facts.max_model_len} the running server accepts"
            )
        host_cpus = sorted(os.sched_getaffinity(0))  # before the client narrows them: the gateway's default
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
        gateway_meta: dict[str, Any] | None = None
        try:
            headers = server.auth_headers(spec)
            with contextlib.ExitStack() as through_gateway:
                routes, gateway_meta = _routes(
                    experiment, cell, engine, facts, headers, runtime, owner, through_gateway, host_cpus
                )
                request_records, measured = measured_phase.run_loop(
                    measured_phase.measure(
                        settings, engine, facts.url, spec["served_name"], experiment.operations, headers, routes
                    )
                )
                _raise_if_gateway_ended(cell, runtime, gateway_meta)  # its lease still held: no one replaced it
        except CellStalled as exc:
            # Hung: the next cell must not get it. The lease is this cell's, so stop it here (no longer
            # watching its supervisor, which this stop ends).
            if watching_supervisor is not None:
                watching_supervisor.set()
            server.discard(cell.configuration, runtime, reason=f"cell {cell.id} stalled")
            raise CellStalled(
                f"cell {cell.id}: {exc}\n"
                f"Server log: {facts.log_path}\n--- last lines ---\n{launch.log_tail(facts.log_path)}"
            ) from None
        except (ServerLost, httpx.HTTPError) as exc:  # httpx: the gateway check before the measured phase
            _raise_if_gateway_ended(cell, runtime, gateway_meta)
            raise CellError(
                f"cell {cell.id}: lost the server at {facts.url}: {exc}\n"
                f"Server log: {facts.log_path}\n--- last lines ---\n{launch.log_tail(facts.log_path)}"
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
        "slurm_job": placement.slurm_job(),  # which cluster job measured it (None: no cluster)
        "gateway": gateway_meta,  # None: measured directly only
        **measured,
    }
    cell_file.write_cell(out_path, request_records, meta)
    return meta


def _write_refused(
    cell: Cell,
    out_path: Path | str,
    settings: dict[str, Any],
    started_at: str,
    refused: EngineRefused,
) -> dict[str, Any]:
    """The cell's result when its configuration's engine died at its first request: no request, the engine's
    reason. Written like any cell (a rerun measures it again only when its settings or spec change)."""
    log.warning("cell %s: %s; written as refused, the run goes on", cell.id, refused)
    meta = {
        "cell": asdict(cell) | {"id": cell.id},
        "settings": settings,
        "spec_hash": refused.server.get("spec_hash"),
        "server": refused.server,
        "started_at": started_at,
        "ended_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "slurm_job": placement.slurm_job(),
        "gateway": None,
        "refused": refused.reason,
    }
    cell_file.write_cell(out_path, [], meta)
    return meta


# ---- the grid's progress line, written as each cell starts (before its server is asked for) ----


def _wall_s(path: Path) -> float | None:
    """A cell file's wall time (its server's start included, if it started it), from the file's footer."""
    try:
        meta = cell_file.metadata(path, pq.read_schema(path).metadata)
        return (datetime.fromisoformat(meta["ended_at"]) - datetime.fromisoformat(meta["started_at"])).total_seconds()
    except (OSError, KeyError, ValueError, TypeError, CellFileError):
        return None


def grid_line(experiment: Experiment, cell: Cell) -> str:
    """How far the grid is: its cells with a file, and an ETA from the most recently written ones."""
    cells = experiment.cells()
    # A file measured with other settings is to be measured again (a rerun after a config edit): not counted.
    present = [Path(c.path) for c in cells if _up_to_date(c.path, experiment.cell_settings(c))]
    left = len(cells) - len(present)
    line = f"grid: {len(present)} of {len(cells)} cells measured, starting {cell.id}"
    recent = sorted(present, key=lambda p: p.stat().st_mtime)[-RECENT_CELLS:]
    walls = [w for w in map(_wall_s, recent) if w is not None]
    if walls and left:
        mean = sum(walls) / len(walls)
        pace = f"{progress.duration(mean)} a cell over the last {len(walls)}"
        line += f"; about {progress.duration(mean * left)} left ({pace})"
    return line


def _up_to_date(path: str, settings: dict[str, object]) -> bool:
    """The cell file exists and was measured with ``settings`` (its footer's metadata only is read)."""
    try:
        return bool(cell_file.metadata(path, pq.read_schema(path).metadata).get("settings") == settings)
    except (OSError, ValueError, pa.ArrowException, CellFileError):
        return False
