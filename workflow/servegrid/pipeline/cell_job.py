"""Run one grid cell: ensure its server, measure (servegrid.measuring.measured_phase), write the cell file.

A cell whose Snakemake or whose server's supervisor goes away stops at once, writing nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from servegrid import engines
from servegrid.config import CellSpec, Experiment
from servegrid.engines import Engine
from servegrid.errors import CellError, CellStalled, EngineRefused, GatewayError, ServerError, ServerLost
from servegrid.measuring import gateway_check, gpu_watch, measured_phase
from servegrid.pipeline import grid_progress
from servegrid.pipeline.grid_progress import grid_line
from servegrid.records import cell_file
from servegrid.records.cell_record import CellRecord
from servegrid.records.request import RequestRecord
from servegrid.serving import gateway, hostinfo, launch, placement, procs, server, state

log = logging.getLogger(__name__)


def run_cell(
    experiment: Experiment,
    cell: CellSpec,
    out_path: Path | str,
    owner: procs.ProcessRef | None,
    spec: dict[str, Any] | None = None,
    runtime: server.Runtime | None = None,
    top_up_round: int = 0,
    settings: dict[str, Any] | None = None,
) -> CellRecord:
    """Measure ``cell`` and write its file; returns its record (what the file's footer holds). With
    ``top_up_round``, the cell's measured phase again, as that round's top-up (servegrid.analysis.top_ups); with
    ``settings``, the cell measured as they say, outside the grid (a calibration's probe)."""
    spec = spec or experiment.launch_spec(cell.configuration)
    engine = engines.get(spec["engine"])
    in_grid = settings is None and not top_up_round  # the grid's progress counts cells; a top-up adds to one
    if settings is None:
        settings = experiment.top_up_settings(cell, top_up_round) if top_up_round else experiment.cell_settings(cell)
    configuration = experiment.configuration(cell.configuration)
    runtime = runtime or server.Runtime.from_config(experiment.operations, configuration)
    # A cell whose Snakemake is gone stops at once (its server is being stopped by its supervisor anyway);
    # nothing half-measured is written, since the cell file is written atomically at the end.
    watching = procs.watch(owner, lambda: _stop_orphaned_cell(cell, owner)) if owner is not None else None
    try:
        record = _run_cell(_CellJob(experiment, cell, spec, engine, settings, runtime, owner, in_grid), out_path)
    finally:
        if watching is not None:
            watching.set()
    if in_grid:
        grid_progress.record(cell, out_path, record)  # the grid's progress line reads it there, not from the footer
    return record


@dataclass(frozen=True)
class _CellJob:
    """What one cell's run is of: the experiment and the cell, its server's spec, engine and runtime, the cell's
    settings (Experiment.cell_settings), and the process that owns the run (None: none watched)."""

    experiment: Experiment
    cell: CellSpec
    spec: dict[str, Any]
    engine: Engine
    settings: dict[str, Any]
    runtime: server.Runtime
    owner: procs.ProcessRef | None
    in_grid: bool = True  # a step of the grid (not a top-up, nor a calibration's probe)


def _routes(
    job: _CellJob,
    facts: server.ServerFacts,
    headers: dict[str, str],
    held: contextlib.ExitStack,
    host_cpus: list[int],
) -> tuple[list[measured_phase.Route], dict[str, Any] | None]:
    """The cell's routes (experiment.routes()), and what its gateway is and changes; with a gateway, its lease
    is entered on ``held`` (kept until the cell is measured)."""
    experiment, cell, engine, runtime = job.experiment, job.cell, job.engine, job.runtime
    served = experiment.model.served_name
    direct = measured_phase.Route(
        "direct",
        facts.url,
        served,
        headers,
        engine.health_path,
        identity=launch.identity(facts.session),
        names_path=engine.names_path,
        names=engine.names,
    )
    if experiment.route == "direct":
        return [direct], None
    proxy = experiment.proxy
    assert proxy is not None  # checks._gateway
    held.enter_context(gateway.lease(runtime))
    # Not the client's cores, which a process started from here would inherit (proxy.cpus, else the host's).
    if set(proxy.cpus) - set(host_cpus):
        raise GatewayError(
            f"proxy.cpus: CPU(s) {sorted(set(proxy.cpus) - set(host_cpus))} are not available here "
            f"(this job may use {host_cpus})"
        )
    facts_gw = gateway.ensure(experiment, cell.configuration, runtime, job.owner, list(proxy.cpus) or host_cpus)
    model, gw_headers = facts_gw.model(cell.configuration, proxy), gateway.headers(proxy)
    findings = gateway_check.check(engine, facts.url, headers, served, facts_gw.url, gw_headers, model, chat=True)
    if not findings["per_chunk_usage"]:
        log.info("cell %s: the gateway drops the per-chunk token count; tokens are counted by chunk", cell.id)
    proxied = measured_phase.Route(
        "proxy",
        facts_gw.url,
        model,
        gw_headers,
        gateway.LiteLLMProbe.health_path,
        findings["per_chunk_usage"],
        identity=launch.identity(facts_gw.session) if facts_gw.started_by_servegrid and facts_gw.session else None,
        names_path=gateway.LiteLLMProbe.names_path,
        names=gateway.LiteLLMProbe.names,
    )
    routes = {"direct": [direct], "proxy": [proxied], "both": [direct, proxied]}[experiment.route]
    return routes, {"facts": asdict(facts_gw), "model": model, "check": findings}


def _raise_if_gateway_ended(cell: CellSpec, runtime: server.Runtime, gateway_meta: dict[str, Any] | None) -> None:
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


def _stop_orphaned_cell(cell: CellSpec, owner: procs.ProcessRef) -> None:
    log.error("cell %s: the process that owns this run (pid %d) is gone; stopping", cell.id, owner.pid)
    os.kill(os.getpid(), signal.SIGTERM)


# How long a cell whose server's supervisor is gone may take to end on its own before it is stopped. A server whose
# engine died exits (vLLM's API server does, and so does the calibration server's engine-death fault), and its
# supervisor with it: the cell's requests then fail at once and the cell records the death (issue 42, item 2), which a
# SIGTERM at the first poll cut short. Reproduced 2026-12-07 with the CPU loaded: the engine-death fault test's pytest
# process was SIGTERMed in 1 run of 6 (a CI worker "not properly terminated" the same morning); with the grace, 8 of 8
# passed. A server still up without its supervisor keeps the cell's streams open: stopped after the grace.
SUPERVISOR_GONE_GRACE_S = 10.0


def _supervisor_of(runtime: server.Runtime, configuration: str, session: str) -> procs.ProcessRef | None:
    record = state.read(state.record_path(runtime, configuration))
    if not record or record.get("session") != session:
        return None
    return procs.ProcessRef.from_dict(record.get("supervisor"))


def _stop_unsupervised_cell(cell: CellSpec, supervisor: procs.ProcessRef, session: str) -> None:
    # Killed, its server got SIGTERM from the kernel and stops its engine, but the API server then waits
    # for this cell's open streams to close (seen with vLLM 0.32): stop now, and let the teardown
    # (Snakemake's onerror, or the next cell's ensure) finish the server by its recorded processes.
    log.error(
        "cell %s: the supervisor (pid %d) of server session %s is gone, so the server is going down; stopping",
        cell.id,
        supervisor.pid,
        session,
    )
    os.kill(os.getpid(), signal.SIGTERM)


def _run_cell(job: _CellJob, out_path: Path | str) -> CellRecord:
    experiment, cell = job.experiment, job.cell
    configuration = experiment.configuration(cell.configuration)
    client_cpus = placement.place(
        configuration.name, configuration.cpus, configuration.gpus, experiment.operations.client_cpus
    ).client_cpus
    hostinfo.check_cpus(client_cpus, "operations.client_cpus")
    started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
    log.info("%s", grid_line(experiment, cell) if job.in_grid else f"cell {cell.id}, outside the grid's count")
    with server.lease(cell.configuration, job.runtime):
        try:
            facts = server.ensure(job.spec, job.runtime, job.owner)
        except EngineRefused as refused:
            return _write_refused(cell, out_path, job.settings, started_at, refused)
        _raise_if_too_long(experiment, cell, facts)
        host_cpus = sorted(os.sched_getaffinity(0))  # before the client narrows them: the gateway's default
        if client_cpus:
            # After the server is up (it must not inherit them): off the server's cores, so that the
            # engine's busy threads do not delay the client's timestamps.
            os.sched_setaffinity(0, client_cpus)
        log.info("cell %s on %s (session %s)", cell.id, facts.url, facts.session)
        try:
            request_records, measured, gateway_meta = _measure_supervised(job, facts, host_cpus)
        except CellError as lost:
            _raise_if_engine_died(job, facts, lost)
            raise
        _raise_if_engine_died(job, facts, None)
    _raise_if_nothing_measured(cell, request_records)
    record = CellRecord.measured(
        cell,
        job.settings,
        asdict(facts),
        measured,
        started_at=started_at,
        ended_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
        slurm_job=placement.slurm_job(),  # which cluster job measured it (None: no cluster)
        gateway=gateway_meta,  # None: measured directly only
    )
    cell_file.write_cell(out_path, request_records, record)
    return record


def _raise_if_engine_died(job: _CellJob, facts: server.ServerFacts, lost: CellError | None) -> None:
    """The server's engine died during the cell (after it started healthy and answered its warm-up): the cell is not
    written, whatever it measured before. A death of the engine's own error is recorded for the run (issue 42: every
    later cell restarted the same dying server, minutes each on a GPU): the configuration's other cells of this run
    fail at once and a rerun tries again; a death of the moment (out of memory, a killed process) is not."""
    try:
        log_text = Path(facts.log_path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    death = job.engine.death(log_text)
    if death is None:
        return
    cell = job.cell
    said = f"the engine of server session {facts.session} died during the cell: {death.cause}; " + (
        "a fault of the moment: the next cell starts the server again"
        if death.transient
        else "its other cells of this run are not measured (a rerun tries again)"
    )
    if lost is not None:  # its own words first (the server's url, the transport's error, the log's tail)
        message = f"{lost}\n{said}"
    else:
        tail = launch.log_tail(facts.log_path)
        message = f"cell {cell.id}: {said}\nServer log: {facts.log_path}\n--- last lines ---\n{tail}"
    if not death.transient:
        server.record_failure(job.runtime, cell.configuration, facts.spec_hash, job.owner, ServerError(message))
    raise CellError(message) from lost


def _raise_if_too_long(experiment: Experiment, cell: CellSpec, facts: server.ServerFacts) -> None:
    """Where the config does not state the limit, the server's first answer does: fail before measuring."""
    need = experiment.longest_request(cell)
    if facts.max_model_len is not None and need > facts.max_model_len:
        raise CellError(
            f"cell {cell.id}: workloads.{cell.mode}.contexts: at context {cell.context} a request holds about "
            f"{need} tokens, more than the {facts.max_model_len} the running server accepts"
        )


def _measure_supervised(
    job: _CellJob, facts: server.ServerFacts, host_cpus: list[int]
) -> tuple[list[RequestRecord], dict[str, Any], dict[str, Any] | None]:
    """Measure the cell on its server (through its gateway, if it has one) while watching the server's supervisor:
    the records, the measured phase's summary, and the gateway's facts (None: measured directly only)."""
    cell, runtime = job.cell, job.runtime
    supervisor = _supervisor_of(runtime, cell.configuration, facts.session)
    watching_supervisor = (
        procs.watch(
            supervisor,
            lambda: _stop_unsupervised_cell(cell, supervisor, facts.session),
            grace_s=SUPERVISOR_GONE_GRACE_S,
        )
        if supervisor is not None
        else None
    )
    gateway_meta: dict[str, Any] | None = None
    try:
        headers = server.auth_headers(job.spec)
        with contextlib.ExitStack() as through_gateway:
            routes, gateway_meta = _routes(job, facts, headers, through_gateway, host_cpus)
            request_records, measured = measured_phase.run_loop(
                measured_phase.measure(
                    job.settings,
                    job.engine,
                    facts.url,
                    job.spec["served_name"],
                    job.experiment.operations,
                    headers,
                    routes,
                    _gpu_watch(job, facts),
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
    return request_records, measured, gateway_meta


def _gpu_watch(job: _CellJob, facts: server.ServerFacts) -> gpu_watch.GpuWatch:
    """What watches the server's GPUs during the cell, knowing the server's own processes (theirs on a GPU are
    expected; a process of anyone else's is not)."""
    record = state.read(state.record_path(job.runtime, job.cell.configuration)) or {}
    ours = gpu_watch.server_pids(state.server_processes(record)) if record.get("session") == facts.session else set()
    return gpu_watch.GpuWatch(facts.gpus, ours, job.experiment.operations.metrics_interval_s)


def _raise_if_nothing_measured(cell: CellSpec, request_records: list[RequestRecord]) -> None:
    """Nothing was measured: no file, so the cell stays stale and the failure is seen."""
    measured_records = [r for r in request_records if r.phase == "measured"]
    if measured_records and all(r.error for r in measured_records):
        raise CellError(
            f"cell {cell.id}: all {len(measured_records)} measured requests failed; "
            f"the first: {measured_records[0].error}"
        )


def _write_refused(
    cell: CellSpec,
    out_path: Path | str,
    settings: dict[str, Any],
    started_at: str,
    refused: EngineRefused,
) -> CellRecord:
    """The cell's result when its configuration's engine died at its first request: no request, the engine's
    reason. Written like any cell (a rerun measures it again only when its settings or spec change)."""
    log.warning("cell %s: %s; written as refused, the run goes on", cell.id, refused)
    record = CellRecord(
        cell,
        settings,
        refused.server.get("spec_hash"),
        dict(refused.server),
        started_at=started_at,
        ended_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
        slurm_job=placement.slurm_job(),
        refused=refused.reason,
    )
    cell_file.write_cell(out_path, [], record)
    return record
