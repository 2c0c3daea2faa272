"""Launching a supervised process (a server, or the gateway) and waiting until it answers as itself.

:func:`launch_supervised` claims a free port (host-wide, servegrid.serving.hostlocks), writes the launch file and
starts a :mod:`servegrid.serving.supervisor` in a session of its own; :func:`wait_healthy` waits for the process's
health check to answer as the launch's own name (:func:`identity`), and fails fast, with the log's tail, when
it will not. :mod:`~servegrid.serving.server` (inference servers) and :mod:`~servegrid.serving.gateway` (the LiteLLM
proxy) both launch this way, so both have the same guarantees.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import httpx
import psutil

from servegrid import atomic, paths, progress
from servegrid.control_http import control_client
from servegrid.errors import ServerError, StartRaced
from servegrid.serving import hostlocks, procs, state
from servegrid.serving import supervisor as supervisor_module
from servegrid.serving.state import Runtime

log = logging.getLogger("servegrid.serving.server")  # the servers' progress lines keep their logger's name

LOG_TAIL_LINES = 40
# What a server that lost its port to another process between the probe and its own bind says as it exits
# (uvicorn: "[Errno 98] error while attempting to bind on address ...: address already in use").
PORT_RACED = re.compile(r"address already in use|\[Errno 98\]", re.IGNORECASE)


def identity(session: str) -> str:
    """The extra name a server answers to: its launch's own, checked before it is used or reused."""
    return f"servegrid-{session}"


def port_bindable(runtime: Runtime, port: int) -> bool:
    """Whether nothing holds ``port``: a bind with neither SO_REUSEADDR nor SO_REUSEPORT succeeds, or the port's
    only sockets are connections in TIME_WAIT.

    Stricter than the server's own bind on purpose. A server still loading its weights may hold its port bound
    and not yet listening (vLLM binds before it loads), with SO_REUSEADDR (and SO_REUSEPORT with several API
    servers); a probe that set either option could bind beside it and call the port free, and a second server
    would then join it. The previous server's connections in TIME_WAIT fail the strict bind too, for a minute
    after it ended (issue 42: with a one-port ``port_range`` the next configuration could not start): they hold
    no server, and the servers' own binds (vLLM's, uvicorn's, aiohttp's) set SO_REUSEADDR, which the kernel lets
    bind beside them. The one case this lets through, a foreign server bound and loading on a port that still has
    our previous server's connections in TIME_WAIT, costs a start: the later of the two to listen fails to bind,
    and servegrid starts its server once more on another port (``PORT_RACED``).
    """
    with socket.socket(socket.AF_INET6 if ":" in runtime.host else socket.AF_INET) as probe:
        try:
            probe.bind((runtime.host, port))
        except OSError:
            return only_time_wait(port)
    return True


def only_time_wait(port: int) -> bool:
    """Whether every TCP socket on local ``port`` that the kernel lists is a connection in TIME_WAIT (a bound
    socket that is not listening is not listed: :func:`port_bindable`'s strict bind is what finds those)."""
    try:
        states = {c.status for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port}
    except psutil.Error:
        return False
    if states == {psutil.CONN_TIME_WAIT}:
        log.info("port %d: only connections in TIME_WAIT hold it (a previous server's); used", port)
        return True
    return False


def new_session() -> str:
    """A launch's own name: its log's, and what marks its processes (procs.SESSION_ENV)."""
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def launch_supervised(
    name: str,
    wanted: str,
    runtime: Runtime,
    owner: procs.ProcessRef | None,
    session: str,
    ports: Sequence[int],
    argv_and_env: Callable[[int], tuple[list[str], dict[str, str]]],
) -> tuple[str, Path, Path, list[str], dict[str, str]]:
    """Launch ``argv_and_env(port)`` under a :mod:`servegrid.serving.supervisor` as ``name`` in the state folder, on the
    first free port of ``ports``: the servers and the gateway alike. Returns its url, record and log paths,
    argv and environment overrides; the caller waits for it (:func:`wait_healthy`)."""
    holder = f"servegrid session {session} of {os.path.abspath(runtime.cwd)}"
    # Host-wide claims on the port and the GPUs, held by the supervisor for the process's lifetime, so
    # that no other servegrid pipeline on this machine takes either.
    with hostlocks.claims(runtime.gpus, ports, lambda port: port_bindable(runtime, port), holder) as (port, fds):
        log_dir = Path(paths.server_log_dir(name))
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{session}.log"
        argv, env = argv_and_env(port)
        url_host = f"[{runtime.host}]" if ":" in runtime.host else runtime.host
        url = f"http://{url_host}:{port}"
        record_path = state.record_path(runtime, name)
        launch = {
            "session": session,
            "configuration": name,
            "spec_hash": wanted,
            "argv": argv,
            "cwd": os.path.abspath(runtime.cwd),
            "url": url,
            "port": port,
            "gpus": runtime.gpus,
            "cpus": runtime.cpus,
            "log_path": str(log_path),
            "record_path": str(record_path),
            "owner": owner.to_dict() if owner else None,
            "shutdown_timeout_s": runtime.shutdown_timeout_s,
        }
        launch_path = state.launch_path(runtime, name)
        # The environment (API key included) goes to the supervisor in its own environment, never on disk;
        # the launch file is owner-only all the same.
        with atomic.atomic_path(launch_path) as tmp:
            os.chmod(tmp, 0o600)  # before anything is written to it
            tmp.write_text(json.dumps(state.stamped(launch)), encoding="utf-8")
        record_path.unlink(missing_ok=True)
        state.facts_path(runtime, name).unlink(missing_ok=True)
        state.failure_path(runtime, name).unlink(missing_ok=True)
        with open(log_dir / f"{session}.supervisor.log", "ab") as sup_log:
            supervisor = subprocess.Popen(
                [sys.executable, "-m", "servegrid.serving.supervisor", str(launch_path)],
                # The process's environment, inherited from its supervisor, and the session that marks every
                # process of it (procs.SESSION_ENV): what a later stop checks before it signals.
                env={**os.environ, **env, procs.SESSION_ENV: session},
                stdin=subprocess.DEVNULL,
                stdout=sup_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                pass_fds=fds,  # the claims: released by the kernel when the supervisor ends
            )
        _first_record(launch, record_path, supervisor)
    return url, record_path, log_path, argv, env


def _supervisor_alive(record: dict) -> bool:
    supervisor = procs.ProcessRef.from_dict(record.get("supervisor"))
    return supervisor is not None and supervisor.alive()


def _first_record(launch: dict, record_path: Path, supervisor: subprocess.Popen) -> None:
    """The launch's record before its supervisor writes one (unless it already has): from here on the launch is
    seen, by a rival's start or a stop, and a supervisor slow to start (a virtual environment on a network
    filesystem) is told from a dead one by its process, not by a time limit."""
    try:
        record = supervisor_module.first_record(launch, procs.ProcessRef.of(supervisor.pid))
    except psutil.NoSuchProcess:  # it ended at once
        record = supervisor_module.first_record(launch, procs.ProcessRef(supervisor.pid, -1, procs.boot_id()))
        record.update(status="exited", returncode=supervisor.wait(), end_reason="the supervisor ended at once")
    atomic.write_json_if_absent(record_path, record)


def log_tail(log_path: Path | str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class HealthProbe(Protocol):
    """What :func:`wait_healthy` asks of a process it waits for: an engine, or the gateway."""

    health_path: str

    def served_names(self, client: httpx.Client, url: str) -> list[str]: ...


def wait_healthy(
    probe: HealthProbe,
    what: str,
    url: str,
    headers: dict[str, str],
    record_path: Path,
    log_path: Path,
    limit: tuple[float, str],
    expected_name: str,
    short_name: str,
) -> None:
    """Wait until ``url`` answers its health check as ``expected_name``; fail fast, with the log's last lines,
    when the process exits, its supervisor never starts, another process answers, or ``limit`` (seconds, and
    the config key that sets them) runs out. ``what`` names it in errors, ``short_name`` in progress lines."""
    timeout_s, timeout_key = limit
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    tick = progress.Every()
    with control_client(2.0, headers) as client:
        while True:
            if tick.due():  # a GPU server can take many minutes: say it is on its way, and where
                last = log_tail(log_path, 1).strip()[:200] or "(nothing logged yet)"
                log.info(
                    "%s starting: %s of at most %s; its log says: %s",
                    short_name,
                    progress.duration(time.monotonic() - started),
                    progress.duration(timeout_s),
                    last,
                )
            record = state.read(record_path)
            if record and identity(record.get("session", "")) != expected_name:
                record = None  # an earlier session's last words, not this launch's
            if record and record["status"] in ("exited", "stopped"):
                tail = log_tail(log_path)
                raced = PORT_RACED.search(tail)
                raise (StartRaced if raced else ServerError)(
                    f"{what} exited during start-up "
                    f"(exit code {record['returncode']}, after {time.monotonic() - started:.1f} s)"
                    f"{': its port was taken by another process in between' if raced else ''}.\n"
                    f"Log: {log_path}\n--- last lines ---\n{tail}"
                )
            if record and record["status"] == "launching" and not _supervisor_alive(record):
                if (state.read(record_path) or {}).get("status") == "launching":  # not its last words just now
                    supervisor_log = log_path.with_suffix(".supervisor.log")
                    raise ServerError(f"the supervisor of {what} ended before it started it; see {supervisor_log}")
                continue
            if record and record["status"] == "running":
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}{probe.health_path}").status_code == 200:
                        names = probe.served_names(client, url)
                        if expected_name in names:
                            return
                        if not names:  # no answer about names yet (slow): ask again
                            time.sleep(0.5)
                            continue
                        # Healthy, but not ours: another process answers on this port (another pipeline's
                        # server, say). Measuring it would measure the wrong server, silently.
                        raise StartRaced(
                            f"{url} answers, but as {names or 'an unnamed server'}, not as {what} that servegrid "
                            f"just launched ({expected_name}): another process holds that port; it was not used"
                        )
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{what} did not become healthy within {timeout_s:.0f} s ({timeout_key}); it was stopped.\n"
                    f"Log: {log_path}\n--- last lines ---\n{log_tail(log_path)}"
                )
            time.sleep(0.5)
