"""Bring inference servers up, reuse them across cells, and take them down.

A cell job calls :func:`ensure` with its configuration's launch spec. If a
healthy server with the same spec is already up it is reused; otherwise any
server that would compete for the same devices is stopped and a new one is
launched under a :mod:`servegrid.supervisor`, health-checked, warmed up and
described (:class:`ServerFacts`). :func:`stop` and :func:`stop_all` take
servers down with their whole process tree.

Runtime state lives in ``results/.servegrid/``: one record per configuration
written by its supervisor, plus the facts written here. It is never a
Snakemake input, so a server's presence or absence never makes a cell stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from servegrid import atomic, hostinfo, metrics, paths, procs
from servegrid.config import spec_hash

KV_TOKENS_RE = re.compile(r"(?:GPU|CPU|XPU|TPU)? ?KV cache size: ([\d,]+) tokens")
MAX_CONCURRENCY_RE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
OWNER_ENV = "SERVEGRID_OWNER_PID"
LOG_TAIL_LINES = 40


class ServerError(RuntimeError):
    """A server could not be brought up or used; the message says why and where its log is."""


@dataclass
class Runtime:
    """Operational settings: how to run a server, never what it is."""

    host: str = "127.0.0.1"
    port_range: tuple[int, int] = (8100, 8199)
    startup_timeout_s: float = 1800.0
    shutdown_timeout_s: float = 30.0
    gpus: list[int] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)
    state_dir: str = paths.STATE_DIR
    cwd: str = "."

    @classmethod
    def from_config(cls, operations: dict[str, Any], configuration: dict[str, Any] | None = None) -> Runtime:
        """The runtime for one configuration (its GPUs and CPUs), or for none: state, ports and timeouts only."""
        placement = configuration or {}
        return cls(
            host=operations["host"],
            port_range=tuple(operations["port_range"]),  # type: ignore[arg-type]
            startup_timeout_s=operations["startup_timeout_s"],
            shutdown_timeout_s=operations["shutdown_timeout_s"],
            gpus=list(placement.get("gpus") or []),
            cpus=list(placement.get("cpus") or []),
        )


@dataclass
class ServerFacts:
    """What the report states about a server session."""

    configuration: str
    session: str
    spec_hash: str
    url: str
    argv: list[str]
    env: dict[str, str]
    gpus: list[int]
    log_path: str
    engine_version: str | None
    kv_cache_tokens: int | None
    max_concurrency: float | None
    max_model_len: int | None
    startup_s: float
    warmup_s: float
    started_at: str
    host: dict[str, Any]
    block_size: int | None = None  # KV-cache block (tokens): the granularity of prefix-cache hits
    cpus: list[int] = field(default_factory=list)  # cores the server was confined to; empty: all


def owner_from_env() -> procs.ProcessRef | None:
    """The process whose disappearance should take servers down: Snakemake, when it set one."""
    raw = os.environ.get(OWNER_ENV)
    if not raw:
        return None
    try:
        return procs.ProcessRef.of(int(raw))
    except (ValueError, Exception):  # noqa: BLE001 - a vanished owner is no owner
        return None


# ---- argv and environment ----------------------------------------------------


def server_argv(spec: dict[str, Any], host: str, port: int) -> list[str]:
    command = [part.replace("{model}", spec["model"]) for part in spec["command"]]
    return [
        *command,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        spec["served_name"],
        *spec["args"],
    ]


def server_env(spec: dict[str, Any], gpus: list[int]) -> dict[str, str]:
    """Environment overrides for the server (on top of the inherited environment)."""
    env = dict(spec["env"])
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    key_var = spec.get("api_key_env")
    if key_var:
        key = os.environ.get(key_var)
        if not key:
            raise ServerError(f"engine.api_key_env names {key_var}, but that variable is not set")
        env["VLLM_API_KEY"] = key
    return env


def public_env(spec: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """``env`` with secrets masked, for logs and reports."""
    return {k: ("***" if k == "VLLM_API_KEY" else v) for k, v in env.items()}


def auth_headers(spec: dict[str, Any]) -> dict[str, str]:
    key_var = spec.get("api_key_env")
    key = os.environ.get(key_var) if key_var else None
    return {"Authorization": f"Bearer {key}"} if key else {}


# ---- state --------------------------------------------------------------------


def _state(runtime: Runtime) -> Path:
    path = Path(runtime.state_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _record_path(runtime: Runtime, configuration: str) -> Path:
    return _state(runtime) / f"{configuration}.json"


def _facts_path(runtime: Runtime, configuration: str) -> Path:
    return _state(runtime) / f"{configuration}.facts.json"


def _failure_path(runtime: Runtime, configuration: str) -> Path:
    return _state(runtime) / f"{configuration}.failed.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None


@contextlib.contextmanager
def _locked(runtime: Runtime) -> Iterator[None]:
    """One process at a time decides which servers run."""
    with open(_state(runtime) / "lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _records(runtime: Runtime) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(_state(runtime).glob("*.json")):
        if path.name.endswith((".facts.json", ".failed.json", ".launch.json")):
            continue
        record = _read(path)
        if record:
            out[record["configuration"]] = record
    return out


def _live(record: dict[str, Any]) -> bool:
    server = procs.ProcessRef.from_dict(record.get("server"))
    return bool(server and server.alive())


def _conflicts(a_gpus: list[int], b_gpus: list[int]) -> bool:
    # CPU servers (no GPUs) share the host's cores with everything else.
    return not a_gpus or not b_gpus or bool(set(a_gpus) & set(b_gpus))


# ---- bring-up -----------------------------------------------------------------


def ensure(spec: dict[str, Any], runtime: Runtime, owner: procs.ProcessRef | None) -> ServerFacts:
    """Return a healthy, warmed-up server for ``spec``: reused if one is up, else started.

    A server that competes for the same devices is stopped first, but never
    while a cell holds its :func:`lease`: then this waits for the cell to end.
    """
    configuration = spec["configuration"]
    wanted = spec_hash(spec)
    while True:
        with _locked(runtime):
            record = _read(_record_path(runtime, configuration))
            facts = _read(_facts_path(runtime, configuration))
            if record and _live(record):
                if record["spec_hash"] == wanted and facts and _healthy(record["url"], spec):
                    return ServerFacts(**facts)
                _stop_record(record, runtime, reason="replaced by a server with another spec")
            _raise_if_failed_before(runtime, configuration, wanted, owner)
            rivals = [
                r
                for other, r in _records(runtime).items()
                if other != configuration and _live(r) and _conflicts(runtime.gpus, r["gpus"])
            ]
            with contextlib.ExitStack() as held:
                if all(held.enter_context(_try_lease(runtime, r["configuration"])) for r in rivals):
                    for rival in rivals:
                        _stop_record(rival, runtime, reason=f"devices needed by {configuration}")
                    try:
                        return _start(spec, wanted, runtime, owner)
                    except ServerError as exc:
                        atomic.write_json(
                            _failure_path(runtime, configuration),
                            {"spec_hash": wanted, "owner": owner.to_dict() if owner else None, "message": str(exc)},
                        )
                        raise
        # A rival server is measuring a cell right now: let it finish.
        time.sleep(1.0)


@contextlib.contextmanager
def lease(configuration: str, runtime: Runtime) -> Iterator[None]:
    """Held by a cell while it uses its configuration's server: one cell per server at a time,
    and no other configuration may stop the server under it."""
    with open(_state(runtime) / f"{configuration}.lease", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _try_lease(runtime: Runtime, configuration: str) -> Iterator[bool]:
    with open(_state(runtime) / f"{configuration}.lease", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _raise_if_failed_before(runtime: Runtime, configuration: str, wanted: str, owner: procs.ProcessRef | None) -> None:
    """Within one pipeline run, a spec that failed to start fails its other cells at once."""
    failure = _read(_failure_path(runtime, configuration))
    if failure and owner and failure["spec_hash"] == wanted and failure["owner"] == owner.to_dict():
        raise ServerError(f"(failed earlier in this run, not retried)\n{failure['message']}")


def _pick_port(runtime: Runtime) -> int:
    taken = {r["port"] for r in _records(runtime).values() if _live(r)}
    low, high = runtime.port_range
    for port in range(low, high + 1):
        if port in taken:
            continue
        with socket.socket(socket.AF_INET6 if ":" in runtime.host else socket.AF_INET) as probe:
            # As uvicorn binds: a port in TIME_WAIT from the previous server is free to take.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((runtime.host, port))
            except OSError:
                continue
        return port
    raise ServerError(f"no free port on {runtime.host} in operations.port_range {low}-{high}")


def check_cpus(cpus: list[int], key: str) -> None:
    """Fail, naming ``key``, when ``cpus`` asks for cores this process may not use."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ServerError(f"{key}: CPU(s) {missing} are not available here (this process may use {sorted(allowed)})")


def check_gpus(gpus: list[int], key: str) -> None:
    """Fail, naming ``key``, when ``gpus`` asks for GPUs nvidia-smi does not list.

    A 27B model takes minutes to load before vLLM finds its GPU missing; this takes a second.
    Hosts without nvidia-smi are not checked.
    """
    if not gpus:
        return
    present = hostinfo.gpu_indices()
    missing = sorted(set(gpus) - set(present)) if present is not None else []
    if missing:
        raise ServerError(f"{key}: GPU(s) {missing} are not on this host (nvidia-smi lists {present})")


def _start(spec: dict[str, Any], wanted: str, runtime: Runtime, owner: procs.ProcessRef | None) -> ServerFacts:
    configuration = spec["configuration"]
    check_cpus(runtime.cpus, f"configurations.{configuration}.cpus")
    check_gpus(runtime.gpus, f"configurations.{configuration}.gpus")
    port = _pick_port(runtime)
    session = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    log_dir = Path(paths.server_log_dir(configuration))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{session}.log"
    argv = server_argv(spec, runtime.host, port)
    env = server_env(spec, runtime.gpus)
    url_host = f"[{runtime.host}]" if ":" in runtime.host else runtime.host
    url = f"http://{url_host}:{port}"
    launch = {
        "session": session,
        "configuration": configuration,
        "spec_hash": wanted,
        "argv": argv,
        "env": env,
        "cwd": os.path.abspath(runtime.cwd),
        "url": url,
        "port": port,
        "gpus": runtime.gpus,
        "cpus": runtime.cpus,
        "log_path": str(log_path),
        "record_path": str(_record_path(runtime, configuration)),
        "owner": owner.to_dict() if owner else None,
        "shutdown_timeout_s": runtime.shutdown_timeout_s,
    }
    launch_path = _state(runtime) / f"{configuration}.launch.json"
    # The launch file carries the environment, API key included: owner-only.
    with atomic.atomic_path(launch_path) as tmp:
        tmp.write_text(json.dumps(launch), encoding="utf-8")
        os.chmod(tmp, 0o600)
    _record_path(runtime, configuration).unlink(missing_ok=True)
    _facts_path(runtime, configuration).unlink(missing_ok=True)
    _failure_path(runtime, configuration).unlink(missing_ok=True)

    started = time.monotonic()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(log_dir / f"{session}.supervisor.log", "ab") as sup_log:
        subprocess.Popen(
            [sys.executable, "-m", "servegrid.supervisor", str(launch_path)],
            stdin=subprocess.DEVNULL,
            stdout=sup_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    record_path = _record_path(runtime, configuration)
    try:
        _wait_healthy(url, spec, record_path, log_path, runtime.startup_timeout_s, configuration)
        startup_s = time.monotonic() - started
        warm_started = time.monotonic()
        version, max_model_len, block_size = _warm_up(url, spec)
        warmup_s = time.monotonic() - warm_started
    except BaseException:
        record = _read(record_path)
        if record:
            _stop_record(record, runtime, reason="start-up failed")
        raise
    log_text = log_path.read_text(encoding="utf-8", errors="replace")
    kv = KV_TOKENS_RE.search(log_text)
    conc = MAX_CONCURRENCY_RE.search(log_text)
    facts = ServerFacts(
        configuration=configuration,
        session=session,
        spec_hash=wanted,
        url=url,
        argv=argv,
        env=public_env(spec, env),
        gpus=runtime.gpus,
        log_path=str(log_path),
        engine_version=version,
        kv_cache_tokens=int(kv.group(1).replace(",", "")) if kv else None,
        max_concurrency=float(conc.group(2)) if conc else None,
        max_model_len=max_model_len,
        startup_s=round(startup_s, 3),
        warmup_s=round(warmup_s, 3),
        started_at=started_at,
        host=hostinfo.describe(runtime.gpus),
        block_size=block_size,
        cpus=runtime.cpus,
    )
    atomic.write_json(_facts_path(runtime, configuration), asdict(facts))
    return facts


def log_tail(log_path: Path | str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _wait_healthy(
    url: str, spec: dict[str, Any], record_path: Path, log_path: Path, timeout_s: float, configuration: str
) -> None:
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    with httpx.Client(timeout=2.0, headers=auth_headers(spec)) as client:
        while True:
            record = _read(record_path)
            if record and record["status"] in ("exited", "stopped"):
                raise ServerError(
                    f"the server for configuration '{configuration}' exited during start-up "
                    f"(exit code {record['returncode']}, after {time.monotonic() - started:.1f} s).\n"
                    f"Log: {log_path}\n--- last lines ---\n{log_tail(log_path)}"
                )
            if record is None and time.monotonic() - started > 30:
                raise ServerError(
                    f"the supervisor for configuration '{configuration}' did not start; "
                    f"see {log_path.with_suffix('.supervisor.log')}"
                )
            if record and record["status"] == "running":
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}/health").status_code == 200:
                        return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"the server for configuration '{configuration}' did not become healthy within "
                    f"{timeout_s:.0f} s (operations.startup_timeout_s); it was stopped.\n"
                    f"Log: {log_path}\n--- last lines ---\n{log_tail(log_path)}"
                )
            time.sleep(0.5)


def _healthy(url: str, spec: dict[str, Any]) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0, headers=auth_headers(spec)).status_code == 200
    except httpx.HTTPError:
        return False


def _warm_up(url: str, spec: dict[str, Any]) -> tuple[str | None, int | None, int | None]:
    """One unmeasured request (the first after start is slow), then what the engine says of itself."""
    headers = auth_headers(spec)
    with httpx.Client(timeout=600.0, headers=headers) as client:
        response = client.post(
            f"{url}/v1/completions",
            json={"model": spec["served_name"], "prompt": "warm up", "max_tokens": 8, "temperature": 0},
        )
        if response.status_code != 200:
            raise ServerError(f"warm-up request failed: HTTP {response.status_code}: {response.text[:500]}")
        version = None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            version = client.get(f"{url}/version").json()["version"]
        max_model_len = None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            max_model_len = client.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        block_size = None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            block_size = int(metrics.cache_config(client.get(f"{url}/metrics").text)["block_size"])
    return version, max_model_len, block_size


# ---- teardown -----------------------------------------------------------------


def _stop_record(record: dict[str, Any], runtime: Runtime, reason: str) -> dict[str, Any]:
    """Stop one server (via its supervisor, else directly) and confirm its group is gone."""
    supervisor = procs.ProcessRef.from_dict(record.get("supervisor"))
    server = procs.ProcessRef.from_dict(record.get("server"))
    pgid = record.get("pgid")
    outcome = {"session": record["session"], "reason": reason, "was_running": bool(server and server.alive())}
    if supervisor and supervisor.alive():
        os.kill(supervisor.pid, signal.SIGTERM)
        procs.wait_gone([supervisor], runtime.shutdown_timeout_s + 10)
    if pgid and (procs.group_members(pgid) or (server and server.alive())):
        # Supervisor missing or too slow: do its job.
        extra = procs.tree(server.pid) if server else []
        procs.terminate_group(pgid, grace_s=runtime.shutdown_timeout_s, extra=extra)
    leftovers = procs.group_members(pgid) if pgid else []
    outcome["left_running"] = [p.pid for p in leftovers]
    final = _read(_record_path(runtime, record["configuration"])) or record
    outcome["returncode"] = final.get("returncode")
    outcome["log_path"] = record.get("log_path")
    if leftovers:
        raise ServerError(f"processes of server session {record['session']} survived teardown: {outcome}")
    return outcome


def stop(configuration: str, runtime: Runtime, reason: str = "last cell done") -> list[dict[str, Any]]:
    """Stop the server of ``configuration`` if one is up, once no cell uses it; returns what was done."""
    with lease(configuration, runtime), _locked(runtime):
        record = _read(_record_path(runtime, configuration))
        if not record:
            return []
        outcome = _stop_record(record, runtime, reason)
        _facts_path(runtime, configuration).unlink(missing_ok=True)
        return [outcome]


def stop_all(runtime: Runtime, owner: procs.ProcessRef | None = None, reason: str = "pipeline ended") -> list[dict]:
    """Stop every server (or only those started on behalf of ``owner``)."""
    stopped = []
    with _locked(runtime):
        for configuration, record in _records(runtime).items():
            if owner is not None and record.get("owner") != owner.to_dict():
                continue
            stopped.append(_stop_record(record, runtime, reason))
            _facts_path(runtime, configuration).unlink(missing_ok=True)
    return stopped


def status(runtime: Runtime) -> list[dict[str, Any]]:
    """Every server record with whether it is alive now."""
    return [{**record, "alive": _live(record)} for record in _records(runtime).values()]
