"""Take servers down: one (via its supervisor, else directly), one configuration's, or all of a run's.

Only processes that carry the server's session, or that its supervisor recorded by pid and start time, are
ever signalled (:mod:`servegrid.serving.procs`): a recorded pid may be someone else's by now.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

from servegrid.errors import ServerError
from servegrid.serving import procs, state
from servegrid.serving.state import Runtime, lease


def stop_record(record: dict[str, Any], runtime: Runtime, reason: str) -> dict[str, Any]:
    """Stop one server (via its supervisor, else directly) and confirm its group is gone."""
    supervisor = procs.ProcessRef.from_dict(record.get("supervisor"))
    server = procs.ProcessRef.from_dict(record.get("server"))
    pgid = record.get("pgid")
    session = record["session"]

    def ours(ref: procs.ProcessRef | None) -> bool:
        # Pid and start time, and the session in its environment: a record from before a reboot can name a
        # process that is someone else's now.
        return ref is not None and ref.carries(session)

    outcome = {"session": session, "reason": reason, "was_running": ours(server)}
    if ours(supervisor):
        assert supervisor is not None
        with contextlib.suppress(ProcessLookupError):  # it may end by itself in between
            os.kill(supervisor.pid, signal.SIGTERM)
        procs.wait_gone([supervisor], runtime.shutdown_timeout_s + 10)
    # Only processes that carry this session, or that its supervisor recorded by pid and start time, are
    # ever signalled: a recorded pid or group number may be someone else's by now (a reboot, say).
    latest = state.read(state.record_path(runtime, record["configuration"]))
    if latest is None or latest.get("session") != session:
        latest = record  # the supervisor may have added members since ``record`` was read
    if pgid and (state.server_processes(latest) or ours(server)):
        # Supervisor missing or too slow: do its job.
        known = state.recorded_members(latest) + (procs.tree(server.pid) if server and ours(server) else [])
        procs.terminate_group(pgid, grace_s=runtime.shutdown_timeout_s, session=session, known=known)
    leftovers = state.server_processes(latest) if pgid else []
    outcome["left_running"] = [p.pid for p in leftovers]
    final = state.read(state.record_path(runtime, record["configuration"])) or record
    outcome["returncode"] = final.get("returncode")
    outcome["log_path"] = record.get("log_path")
    if leftovers:
        raise ServerError(f"processes of server session {record['session']} survived teardown: {outcome}")
    return outcome


def stop(configuration: str, runtime: Runtime, reason: str = "last cell done") -> list[dict[str, Any]]:
    """Stop the server of ``configuration`` if one is up, once no cell uses it; returns what was done."""
    with lease(configuration, runtime):
        return discard(configuration, runtime, reason)


def discard(configuration: str, runtime: Runtime, reason: str) -> list[dict[str, Any]]:
    """Stop the server of ``configuration`` now, for a caller that holds its lease (a cell that found it hung)."""
    with state.locked(runtime):
        record = state.read(state.record_path(runtime, configuration))
        if not record:
            return []
        outcome = stop_record(record, runtime, reason)
        state.facts_path(runtime, configuration).unlink(missing_ok=True)
        return [outcome]


def stop_all(runtime: Runtime, owner: procs.ProcessRef | None = None, reason: str = "pipeline ended") -> list[dict]:
    """Stop every server (or only those started on behalf of ``owner``): each one is tried even when an
    earlier one would not go; that failure is raised at the end."""
    stopped, failures = [], []
    with state.locked(runtime):
        for configuration, record in state.records(runtime).items():
            if owner is not None and record.get("owner") != owner.to_dict():
                continue
            try:
                stopped.append(stop_record(record, runtime, reason))
            except ServerError as exc:
                failures.append(str(exc))
            state.facts_path(runtime, configuration).unlink(missing_ok=True)
    if failures:
        raise ServerError("; ".join(failures))
    return stopped


def status(runtime: Runtime) -> list[dict[str, Any]]:
    """Every server record with whether it is alive now."""
    return [{**record, "alive": state.live(record)} for record in state.records(runtime).values()]
