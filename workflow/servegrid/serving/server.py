"""Bring inference servers up, reuse them across cells, and take them down.

Reuse, rivals, launch and the wait for health are one
protocol, each step stopping or replacing servers that the others start
(the stops themselves are :mod:`servegrid.serving.teardown`'s).

A cell job calls :func:`ensure` with its configuration's launch spec. If a
healthy server with the same spec is already up it is reused; otherwise any
server that would compete for the same devices is stopped and a new one is
launched under a :mod:`servegrid.serving.supervisor`, health-checked, warmed up and
described (:class:`ServerFacts`). :func:`stop` and :func:`stop_all`
(:mod:`~servegrid.serving.teardown`) take servers down with their whole process tree.

What is particular to one kind of server (its argv, environment, health
endpoint, warm-up request, start-up log and self-description) comes from the
spec's engine (:mod:`servegrid.engines`). Records, facts, leases and the lock
that serialises these decisions live in :mod:`servegrid.serving.state`; the launch
under a supervisor and the wait for health, shared with the gateway, in
:mod:`servegrid.serving.launch`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from servegrid import engines, redact
from servegrid.config import spec_hash
from servegrid.control_http import control_client
from servegrid.engines import Engine
from servegrid.errors import EngineRefused, ServerError, StartRaced
from servegrid.serving import first_request, hostinfo, liveness, procs, state
from servegrid.serving.launch import identity, launch_supervised, new_session, wait_healthy
from servegrid.serving.state import Runtime, ServerFacts, lease
from servegrid.serving.teardown import discard, status, stop, stop_all, stop_record

__all__ = [
    "OWNER_ENV",
    "Runtime",
    "ServerFacts",
    "discard",
    "ensure",
    "launch_command",
    "lease",
    "owner_from_env",
    "owner_token",
    "status",
    "stop",
    "stop_all",
    "stop_record",
]

log = logging.getLogger(__name__)

OWNER_ENV = "SERVEGRID_OWNER"


def owner_token(owner: procs.ProcessRef) -> str:
    """How a job learns its owner: pid and start time (a pid alone may be someone else's by then)."""
    return owner.token()


def owner_from_env() -> procs.ProcessRef | None:
    """The process whose disappearance should take servers down: Snakemake, when it set one.

    A job whose Snakemake is already gone (killed while this job was starting) gets an error, not
    None: a server started with no owner would outlive everyone. So does one whose owner's pid now
    belongs to another process (the start time differs).
    """
    raw = os.environ.get(OWNER_ENV)
    if not raw:
        return None
    try:
        owner = procs.ProcessRef.from_token(raw)
    except ValueError:
        raise ServerError(
            f"{OWNER_ENV}={raw!r} is not 'pid:start-ticks:boot-id' (servegrid.serving.server.owner_token)"
        ) from None
    if not owner.alive():
        raise ServerError(
            f"the Snakemake process ({OWNER_ENV}={raw}) that runs this job is gone: no server is started for it"
        )
    return owner


# ---- argv, environment, authentication ---------------------------------------


def _api_key(spec: dict[str, Any]) -> str | None:
    key_var = spec.get("api_key_env")
    if not key_var:
        return None
    key = os.environ.get(key_var)
    if not key:
        raise ServerError(f"engine.api_key_env names {key_var}, but that variable is not set")
    return key


def _argv_and_env(spec: dict[str, Any], runtime: Runtime, port: int, session: str) -> tuple[list[str], dict[str, str]]:
    """The server's argv and its environment overrides, API key included."""
    engine = engines.get(spec["engine"])
    names = [spec["served_name"], identity(session)]
    argv = engine.argv(spec["command"], spec["model"], names, runtime.host, port, spec["args"])
    return argv, engine.server_env(spec["env"], runtime.gpus, _api_key(spec))


def launch_command(
    spec: dict[str, Any], runtime: Runtime, port: int, session: str = "SESSION"
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment overrides (secrets masked) that ``spec``'s server gets on ``port``."""
    argv, env = _argv_and_env(spec, runtime, port, session)
    return redact.argv(argv), engines.get(spec["engine"]).public_env(env)


def auth_headers(spec: dict[str, Any]) -> dict[str, str]:
    """The bearer token the client sends, from the variable engine.api_key_env names (none without one)."""
    key = _api_key(spec)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _conflicts(a_gpus: Sequence[int], b_gpus: Sequence[int]) -> bool:
    # CPU servers (no GPUs) share the host's cores with everything else.
    return not a_gpus or not b_gpus or bool(set(a_gpus) & set(b_gpus))


# ---- bring-up -----------------------------------------------------------------


def ensure(spec: dict[str, Any], runtime: Runtime, owner: procs.ProcessRef | None) -> ServerFacts:
    """Return a healthy, warmed-up server for ``spec``: reused if one is up, else started.

    A server that competes for the same devices is stopped first, but never
    while a cell holds its :func:`lease`: then this waits for the cell to end.
    The caller holds ``spec``'s own lease (a cell job does), so no other process starts or stops this
    configuration's server meanwhile. The host's state lock is held only while deciding and launching: the wait
    for health and the warm-up (minutes on a GPU) run outside it, so another configuration's cell can reuse,
    start or stop its own server in the meantime.
    A start that met a passing condition (:class:`StartRaced`) is made once more; a second failure is final. So is
    an engine's death of its own error at its first request (:class:`EngineRefused`): refused only when the second
    start dies of the same root cause.
    """
    configuration = spec["configuration"]
    engine = engines.get(spec["engine"])
    wanted = spec_hash(spec)
    raced: StartRaced | None = None
    refused_once: EngineRefused | None = None
    while True:
        with state.locked(runtime):
            decided = _reuse_or_launch(spec, engine, wanted, runtime, owner)
        if isinstance(decided, ServerFacts):
            return decided
        if decided is None:  # a rival server is measuring a cell right now: let it finish
            time.sleep(1.0)
            continue
        try:
            return _finish_start(spec, engine, wanted, runtime, decided)
        except EngineRefused as exc:
            # A refusal is the configuration's result for good (its cells are written as refused): only the same
            # root cause on a second fresh start makes it one (issue 42: a death of the moment was taken for one).
            if refused_once is None:
                refused_once = exc
                log.warning(
                    "server %s: its engine died of its own error at its first request (%s); starting it once more: "
                    "the same error again is the configuration's refusal",
                    configuration,
                    exc.reason,
                )
                continue
            failure: ServerError = exc
            if exc.reason != refused_once.reason:
                failure = ServerError(
                    f"the engine of configuration '{configuration}' died at its first request on two starts, of two "
                    f"errors: {refused_once.reason}; then {exc.reason}. Not a refusal: a failed start\n{exc}"
                )
            record_failure(runtime, configuration, wanted, owner, failure)
            raise failure from exc
        except StartRaced as exc:
            if raced is None:
                raced = exc
                log.warning(
                    "server %s: start-up failed for a passing reason, starting it once more: %s",
                    configuration,
                    str(exc).splitlines()[0],
                )
                continue
            record_failure(runtime, configuration, wanted, owner, exc)
            raise
        except ServerError as exc:
            record_failure(runtime, configuration, wanted, owner, exc)
            raise


def record_failure(
    runtime: Runtime, configuration: str, wanted: str, owner: procs.ProcessRef | None, exc: ServerError
) -> None:
    """Record that ``configuration``'s spec failed in ``owner``'s run: its other cells of that run fail at once,
    without a start (a failed start, or an engine that died of its own error during a cell)."""
    refused = isinstance(exc, EngineRefused) and {"reason": exc.reason, "server": exc.server}
    state.write(
        state.failure_path(runtime, configuration),
        {
            "spec_hash": wanted,
            "owner": owner.to_dict() if owner else None,
            "message": str(exc),
            "refused": refused or None,
        },
    )


def _reuse_or_launch(
    spec: dict[str, Any], engine: Engine, wanted: str, runtime: Runtime, owner: procs.ProcessRef | None
) -> ServerFacts | Launched | None:
    """Under the host's state lock: the running server's facts (reused), a new server's launch (to wait for), or
    None when a rival server that must give way is measuring a cell."""
    configuration = spec["configuration"]
    record = state.read(state.record_path(runtime, configuration))
    facts = state.read(state.facts_path(runtime, configuration))
    if record and state.supervised(record):
        if record["spec_hash"] != wanted or not facts:
            stop_record(record, runtime, reason="replaced by a server with another spec")
        elif liveness.healthy(engine, record, auth_headers(spec)) and liveness.answers(
            engine, record, facts, spec, runtime, auth_headers(spec)
        ):
            return ServerFacts(**facts)
        else:
            # Its health check can say 200 while its engine is stuck: a hung server is replaced, not
            # handed to the next cell, whose every request would wait out its timeout.
            stop_record(record, runtime, reason="not answering a tiny completion: replaced")
    elif record and state.anything_running(record):
        # Its server exited and its supervisor is still winding down (holding the host claims and
        # about to write its record), or its supervisor is gone and its server is not: finish either.
        stop_record(record, runtime, reason="half gone: server or supervisor no longer running")
    _raise_if_failed_before(runtime, configuration, wanted, owner)
    rivals = [
        r
        for other, r in state.records(runtime).items()
        # The gateway holds no device: it stays up while the servers behind it change. A rival still starting
        # counts (its cell holds its lease while it waits for health, outside the state lock).
        if other not in (configuration, state.GATEWAY)
        and state.anything_running(r)
        and _conflicts(runtime.gpus, r["gpus"])
    ]
    with contextlib.ExitStack() as held:
        if not all(held.enter_context(state.try_lease(runtime, r["configuration"])) for r in rivals):
            return None
        for rival in rivals:
            stop_record(rival, runtime, reason=f"devices needed by {configuration}")
        return _launch(spec, wanted, runtime, owner)


def _raise_if_failed_before(runtime: Runtime, configuration: str, wanted: str, owner: procs.ProcessRef | None) -> None:
    """Within one pipeline run, a spec that failed to start fails its other cells at once."""
    failure = state.read(state.failure_path(runtime, configuration))
    if failure and owner and failure["spec_hash"] == wanted and failure["owner"] == owner.to_dict():
        refused = failure.get("refused")
        if refused:  # the engine's answer to this spec, not a fault: the same for every cell of the run
            raise EngineRefused(failure["message"], refused["reason"], refused["server"])
        raise ServerError(f"(failed earlier in this run, not retried)\n{failure['message']}")


def _refuse_if_owner_gone(owner: procs.ProcessRef | None) -> None:
    if owner is not None and not owner.alive():
        raise ServerError(f"the process that owns this run (pid {owner.pid}) is gone: no server is started for it")


@dataclass(frozen=True)
class Launched:
    """A server launched under its supervisor, not yet healthy."""

    session: str
    url: str
    record_path: Path
    log_path: Path
    argv: list[str]
    env: dict[str, str]
    started: float  # time.monotonic() at the launch
    started_at: str


def _launch(spec: dict[str, Any], wanted: str, runtime: Runtime, owner: procs.ProcessRef | None) -> Launched:
    configuration = spec["configuration"]
    _refuse_if_owner_gone(owner)
    hostinfo.check_cpus(runtime.cpus, f"configurations.{configuration}.cpus")
    hostinfo.check_gpus(runtime.gpus, f"configurations.{configuration}.gpus")
    session = new_session()
    ports = range(runtime.port_range[0], runtime.port_range[1] + 1)
    started = time.monotonic()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    url, record_path, log_path, argv, env = launch_supervised(
        configuration, wanted, runtime, owner, session, ports, lambda port: _argv_and_env(spec, runtime, port, session)
    )
    return Launched(session, url, record_path, log_path, argv, env, started, started_at)


def _finish_start(spec: dict[str, Any], engine: Engine, wanted: str, runtime: Runtime, up: Launched) -> ServerFacts:
    """Wait for the launched server's health, warm it up and describe it; on any failure, stop it."""
    configuration = spec["configuration"]
    session, url, log_path, argv, env, started_at = up.session, up.url, up.log_path, up.argv, up.env, up.started_at
    try:
        wait_healthy(
            engine,
            f"the server for configuration '{configuration}'",
            url,
            auth_headers(spec),
            up.record_path,
            log_path,
            (runtime.startup_timeout_s, "operations.startup_timeout_s"),
            identity(session),
            f"server {configuration}",
        )
        startup_s = time.monotonic() - up.started
        with control_client(600.0, auth_headers(spec)) as client:
            warmup_s, warmup_cache = first_request.warm_up(
                engine,
                client,
                url,
                spec["served_name"],
                configuration,
                log_path,
                lambda: {
                    "configuration": configuration,
                    "engine": engine.kind,
                    "session": session,
                    "spec_hash": wanted,
                    "url": url,
                    "argv": redact.argv(argv),
                    "env": engine.public_env(env),
                    "gpus": runtime.gpus,
                    "cpus": runtime.cpus,
                    "log_path": str(log_path),
                    "startup_s": round(startup_s, 3),
                    "started_at": started_at,
                    "host": hostinfo.describe(runtime.gpus),
                },
            )
            described = engine.describe(client, url, spec["served_name"])
    except BaseException:
        with state.locked(runtime):
            record = state.read(up.record_path)
            if record and record.get("session") == session:
                stop_record(record, runtime, reason="start-up failed")
        raise
    capacity = engine.startup_facts(log_path.read_text(encoding="utf-8", errors="replace"))
    prefix_cache = engine.prefix_cache(described, spec.get("speculative"), capacity)
    facts = ServerFacts(
        configuration=configuration,
        engine=engine.kind,
        session=session,
        spec_hash=wanted,
        url=url,
        argv=redact.argv(argv),
        env=engine.public_env(env),
        gpus=runtime.gpus,
        log_path=str(log_path),
        engine_version=described.version,
        kv_cache_tokens=capacity.kv_cache_tokens,
        max_concurrency=capacity.max_concurrency,
        max_model_len=described.max_model_len,
        startup_s=round(startup_s, 3),
        warmup_s=round(warmup_s, 3),
        started_at=started_at,
        host=hostinfo.describe(runtime.gpus),
        block_size=described.block_size,
        cpus=runtime.cpus,
        cache_mode=described.cache_mode,
        hit_blocks_dropped=prefix_cache.dropped,
        prefix_sightings=prefix_cache.sightings,
        kv_group_block_sizes=list(capacity.kv_group_block_sizes) if capacity.kv_group_block_sizes else None,
        hits_judged=prefix_cache.judged,
        warmup_cache=warmup_cache,
    )
    state.write(state.facts_path(runtime, configuration), asdict(facts))
    return facts
