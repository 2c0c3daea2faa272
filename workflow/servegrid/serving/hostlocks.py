"""Host-wide claims on ports and GPUs, shared by every servegrid pipeline on the machine.

Each pipeline keeps its server state under its own ``results/``, so two pipelines in
two directories would each pick a "free" port or GPU on their own, and one could
start a server on the other's GPU. A claim is an ``flock`` on a file in one directory
outside any project, the same for every pipeline of a user on this host
(``$SERVEGRID_LOCK_DIR``, else ``/tmp/servegrid-locks-<uid>``; it must be the user's
own, mode 0700, not a link). The server's supervisor inherits the locked file
descriptors and holds them while it supervises the server, so the kernel releases
them when the supervisor ends, however it ends (a server it leaves behind dies with
it: ``procs.die_with_parent``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from servegrid.errors import ServerError
from servegrid.serving import placement


def lock_dir() -> Path:
    """The claims directory, made if missing; :class:`ServerError` if it is not safely this user's."""
    explicit = os.environ.get("SERVEGRID_LOCK_DIR")
    path = Path(explicit) if explicit else Path(tempfile.gettempdir()) / f"servegrid-locks-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise ServerError(f"host-wide claims: cannot use {path}: {exc}") from exc
    # In a shared /tmp another user could have made it first: use it only if it is ours alone.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ServerError(
            f"host-wide claims: {path} is not a directory of this user's with mode 0700; remove it, or set "
            "SERVEGRID_LOCK_DIR to one"
        )
    return path


def _try_claim(name: str, holder: str) -> int | None:
    """An fd holding the claim ``name``, or None when another process holds it."""
    try:
        fd = os.open(lock_dir() / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ServerError(f"host-wide claims: cannot open the claim '{name}': {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, holder.encode())  # who holds it, for the error another pipeline gets
    return fd


def _holder(name: str) -> str:
    with contextlib.suppress(OSError):
        return (lock_dir() / f"{name}.lock").read_text(encoding="utf-8") or "another process"
    return "another process"


def gpu_claim(gpu: int) -> str:
    """The claim's name for GPU ``gpu`` as this process numbers it. Inside a Slurm job, GPUs are numbered within
    the job's allocation (with device constraints every job's first GPU is 0), and Slurm gives each GPU to one job:
    the claim is the job's own, so two jobs on one node with a shared /tmp never refuse each other's GPU 0."""
    job = placement.slurm_job()
    return f"job{job}-gpu{gpu}" if job else f"gpu{gpu}"


# A holder that has just ended still holds its claims for a moment: measured here, a claim refused right after its
# supervisor was gone from every process's open files was granted 1 ms later (the kernel's release of an exiting
# process's locks can trail its exit; our reading, not proven). A refusal is therefore only believed once it has
# lasted this long; a claim really held by a running pipeline costs this much more to report.
EXITING_HOLDER_GRACE_S = 2.0


@contextlib.contextmanager
def claims(
    gpus: Sequence[int], ports: Sequence[int], port_free: Callable[[int], bool], holder: str
) -> Iterator[tuple[int, list[int]]]:
    """Claim every GPU of ``gpus`` and the first port of ``ports`` that no pipeline claims and
    ``port_free`` accepts; yields ``(port, fds)``. The fds are closed on exit: pass them to the
    process that must keep the claims (``subprocess.Popen(pass_fds=...)``) before that."""
    deadline = time.monotonic() + EXITING_HOLDER_GRACE_S
    held: list[int] = []
    try:
        while True:
            try:
                port = _claim_all(gpus, ports, port_free, holder, held)
                break
            except ServerError:
                if time.monotonic() >= deadline:
                    raise
            while held:
                os.close(held.pop())
            time.sleep(0.01)
        yield port, held  # outside the retry: an error of the caller's is never taken for a refused claim
    finally:
        for fd in held:
            os.close(fd)


def _claim_all(
    gpus: Sequence[int], ports: Sequence[int], port_free: Callable[[int], bool], holder: str, held: list[int]
) -> int:
    """One attempt at :func:`claims`, adding each claim taken to ``held``: the port, or :class:`ServerError`."""
    for gpu in gpus:
        fd = _try_claim(gpu_claim(gpu), holder)
        if fd is None:
            raise ServerError(f"GPU {gpu} is in use by another servegrid pipeline's server ({_holder(gpu_claim(gpu))})")
        held.append(fd)
    for port in ports:
        fd = _try_claim(f"port{port}", holder)
        if fd is None:
            continue
        if port_free(port):
            held.append(fd)
            return port
        os.close(fd)
    raise ServerError(
        f"no free port in operations.port_range {ports[0]}-{ports[-1]}: each is in use on this "
        "host or claimed by another servegrid pipeline"
    )
