"""The runtime state store of the servers, under ``Runtime.state_dir`` (``results/.servegrid/``), one folder per host.

A record names processes by pid, which mean something only on the host that started them: on a cluster whose
nodes share ``results/``, every node keeps its own folder (``results/.servegrid/<host>/``), so a cell never
finds, reuses or stops a server of another node; inside a Slurm job, every job its own
(``results/.servegrid/<host>-job<id>/``, :func:`scope`), so two jobs packed on one node never meet.
The locks that serialise decisions are not in that folder: ``flock`` across NFS is not to be relied on, so
they are files in this host's own claims directory (:func:`servegrid.serving.hostlocks.lock_dir`,
node-local), one set per state folder.

Per configuration the host's folder holds:

- ``<configuration>.json``: the server's record, written by its supervisor
  (pids, process group, port, status, exit code);
- ``<configuration>.facts.json``: the :class:`~servegrid.serving.server.ServerFacts`
  of the server that is up, written once it is healthy and warmed up;
- ``<configuration>.failed.json``: why its last start failed, and for whom;
- ``<configuration>.launch.json``: what its supervisor launches (owner-only; no environment: that, API key
  included, reaches the supervisor in its own environment, never on disk);
- (node-local) ``<configuration>.lease``: the lock a cell holds while it uses the server;

plus, node-local, one lock that serialises every decision about which servers run.
:class:`Runtime` says where that state lives and how servers are run;
:class:`ServerFacts` is what a facts file holds.
None of it is ever a Snakemake input, so a server's presence or absence never
makes a cell stale.

Each of these files carries ``format_version`` (:data:`STATE_FORMAT`); :func:`read` takes it off, reads a file
without one as format 1 (every state file before 2026-12-06) and refuses one of a newer format, which a newer
servegrid wrote: its server is that servegrid's to manage.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from servegrid import atomic, paths
from servegrid.config.sections import Configuration, Operations
from servegrid.errors import NewerFormatError
from servegrid.serving import hostlocks, placement, procs

# 1: the state files from before 2026-12-06 (no number in them); 2: the number in each file.
STATE_FORMAT = 2

# The gateway's name in the state folder, beside the configurations' (which cannot contain "-"): its supervisor,
# record and teardown are the servers' own (servegrid.serving.gateway).
GATEWAY = "gateway-proxy"


@dataclass
class Runtime:
    """Operational settings: how to run a server, never what it is."""

    host: str = "127.0.0.1"
    port_range: tuple[int, int] = (8100, 8199)
    startup_timeout_s: float = 1800.0
    shutdown_timeout_s: float = 30.0
    # A server to be reused must complete one tiny request within 10 × the one it completed at start-up,
    # and at least this long (operations.stall_floor_s): longer is a hung engine.
    liveness_floor_s: float = 30.0
    gpus: list[int] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)
    state_dir: str = paths.STATE_DIR
    cwd: str = "."

    @classmethod
    def from_config(cls, operations: Operations, configuration: Configuration | None = None) -> Runtime:
        """The runtime for one configuration (its GPUs and CPUs, where :mod:`servegrid.serving.placement` puts them),
        or for none: state, ports and timeouts only."""
        where = (
            placement.place(configuration.name, configuration.cpus, configuration.gpus, operations.client_cpus)
            if configuration
            else None
        )
        return cls(
            host=operations.host,
            port_range=(operations.port_range[0], operations.port_range[1]),
            startup_timeout_s=operations.startup_timeout_s,
            shutdown_timeout_s=operations.shutdown_timeout_s,
            liveness_floor_s=operations.stall_floor_s,
            gpus=where.gpus if where else [],
            cpus=where.server_cpus if where else [],
        )


@dataclass
class ServerFacts:
    """What the report states about a server session."""

    configuration: str
    engine: str  # the engine's kind (engine.kind in the config)
    session: str
    spec_hash: str
    url: str
    argv: list[str]
    env: dict[str, str]  # secrets masked
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
    cache_mode: str | None = None  # a hybrid model's recurrent-state cache ("align"), as the server says
    hit_blocks_dropped: int = 0  # matched blocks of a prefix hit the server does not reuse (its draft method)
    prefix_sightings: int = 1  # requests that carry a shared prefix before the next one hits it (PrefixCache)
    # The warm-up across the cache (Engine.warm_up): prompt_tokens, block_tokens, and hit_tokens counted by the
    # server on its second send. None: the engine warms up with one request (the stand-in), or a server started by
    # a servegrid before issue 42.
    warmup_cache: dict[str, int] | None = None
    # The KV-cache groups' block sizes where the engine has several (StartupFacts), and whether prefix hits land on
    # ``block_size`` for sure (PrefixCache.judged): where not, cells' hit rates are reported, never judged.
    kv_group_block_sizes: list[int] | None = None
    hits_judged: bool = True


_NOT_RECORDS = (".facts.json", ".failed.json", ".launch.json")


def this_host() -> str:
    """The name this host's state folder goes by (the short host name, as Slurm's NodeName)."""
    return socket.gethostname().split(".")[0] or "localhost"


def scope(environ: Mapping[str, str] | None = None) -> str:
    """The name of this process's state folder: the host's, and inside a Slurm allocation its job's too.

    Slurm packs jobs onto nodes: two configurations' jobs on one node must not see each other's servers (each
    would take the other's for a rival and stop it between cells), nor share a gateway that dies with whichever
    job started it. The job id alone, not the step's: a job's cells and its server_stop run in different steps.
    """
    job = placement.slurm_job(environ)
    return f"{this_host()}-job{job}" if job else this_host()


def host_directory(state_dir: str | Path, host: str | None = None) -> Path:
    """The state folder of ``host`` (this process's :func:`scope` by default) under ``state_dir``; not made."""
    return Path(state_dir) / (host or scope())


def directory(runtime: Runtime) -> Path:
    path = host_directory(runtime.state_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _lock_file(runtime: Runtime, name: str) -> Path:
    # Keyed by the state folder's real path: two pipelines in two directories lock apart, one pipeline's
    # processes on this host lock together, and no lock crosses a network filesystem.
    key = hashlib.sha256(str(directory(runtime).resolve()).encode()).hexdigest()[:16]
    return hostlocks.lock_dir() / f"state-{key}-{name}"


def record_path(runtime: Runtime, configuration: str) -> Path:
    return directory(runtime) / f"{configuration}.json"


def facts_path(runtime: Runtime, configuration: str) -> Path:
    return directory(runtime) / f"{configuration}.facts.json"


def failure_path(runtime: Runtime, configuration: str) -> Path:
    return directory(runtime) / f"{configuration}.failed.json"


def launch_path(runtime: Runtime, configuration: str) -> Path:
    return directory(runtime) / f"{configuration}.launch.json"


def read(path: Path) -> dict[str, Any] | None:
    """A state file's content, without its format number; None when it is missing or half-written by a process
    that died. :class:`NewerFormatError` when a newer servegrid wrote it."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if not isinstance(content, dict):
        return None
    version = content.pop("format_version", 1)
    if not isinstance(version, int) or version > STATE_FORMAT:
        raise NewerFormatError(
            f"{path}: a server state file of format {version}, written by a newer servegrid (this one reads formats "
            f"1 to {STATE_FORMAT}): that servegrid manages this server; stop it with that servegrid, or upgrade"
        )
    return content


def stamped(content: Mapping[str, Any]) -> dict[str, Any]:
    """``content`` as a state file holds it: with its format number."""
    return {**content, "format_version": STATE_FORMAT}


def write(path: Path, content: Mapping[str, Any]) -> None:
    """Write a state file atomically, with its format number."""
    atomic.write_json(path, stamped(content))


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def locked(runtime: Runtime) -> contextlib.AbstractContextManager[None]:
    """One process at a time decides which servers run."""
    return _exclusive(_lock_file(runtime, "lock"))


def lease(configuration: str, runtime: Runtime) -> contextlib.AbstractContextManager[None]:
    """Held by a cell while it uses its configuration's server: one cell per server at a time,
    and no other configuration may stop the server under it."""
    return _exclusive(_lock_file(runtime, f"{configuration}.lease"))


@contextlib.contextmanager
def try_lease(runtime: Runtime, configuration: str) -> Iterator[bool]:
    """The lease of ``configuration`` if no cell holds it now (True), else False at once."""
    with open(_lock_file(runtime, f"{configuration}.lease"), "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def records(runtime: Runtime) -> dict[str, dict[str, Any]]:
    """Every server record, by configuration."""
    return records_in(directory(runtime))


def records_in(folder: Path) -> dict[str, dict[str, Any]]:
    """Every server record of one state folder, by configuration."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        if path.name.endswith(_NOT_RECORDS):
            continue
        try:
            record = read(path)
        except NewerFormatError:  # a newer servegrid's server: never stopped or reused by this one
            continue
        if record:
            out[record["configuration"]] = record
    return out


def supervised(record: dict[str, Any]) -> bool:
    """Whether the server of ``record`` runs under its supervisor: both processes alive (the same ones)."""
    supervisor = procs.ProcessRef.from_dict(record.get("supervisor"))
    return live(record) and bool(supervisor and supervisor.alive())


def recorded_members(record: dict[str, Any]) -> list[procs.ProcessRef]:
    """The server's processes its supervisor recorded by pid and start time (live or not)."""
    return [ref for m in record.get("members") or [] if (ref := procs.ProcessRef.from_dict(m)) is not None]


def server_processes(record: dict[str, Any]) -> list[psutil.Process]:
    """The live processes of ``record``'s server: members of its group that carry its session, and the
    processes its supervisor recorded by pid and start time (procs.terminate_group says why both)."""
    pgid, session = record.get("pgid"), record.get("session")
    found = {p.pid: p for p in (procs.group_members(pgid, session) if pgid and session else [])}
    for ref in recorded_members(record):
        with contextlib.suppress(psutil.Error):
            if ref.alive():
                found[ref.pid] = psutil.Process(ref.pid)
    return list(found.values())


def anything_running(record: dict[str, Any]) -> bool:
    """Whether any process of ``record`` still runs: its supervisor, its server, or one of the server's."""
    supervisor = procs.ProcessRef.from_dict(record.get("supervisor"))
    return live(record) or bool(supervisor and supervisor.alive()) or bool(server_processes(record))


def live(record: dict[str, Any]) -> bool:
    """Whether the server process of ``record`` is still running (the same process, not a reused pid)."""
    server = procs.ProcessRef.from_dict(record.get("server"))
    return bool(server and server.alive())
