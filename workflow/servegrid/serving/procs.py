"""Process identity and process-group teardown.

A pid alone is not an identity (pids are reused), so every pid servegrid keeps is paired with the process's
start time as the kernel keeps it: clock ticks since boot (``/proc/<pid>/stat`` field 22) and the boot's id
(``/proc/sys/kernel/random/boot_id``). Never an epoch time: psutil's ``create_time()`` adds the boot time, which
moves when the wall clock is stepped (NTP, a VM's resume, ``date``), and after a 1 s step every process would
look like another one, stopping every server of the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


@functools.cache
def boot_id() -> str:
    """This boot's id: start ticks restart from zero at a reboot."""
    with open(BOOT_ID_PATH, encoding="ascii") as f:
        return f.read().strip()


def _stat(pid: int) -> tuple[int, str] | None:
    """(start ticks, state letter) of ``pid`` from ``/proc/<pid>/stat``, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': the fields after its last ')'.
    fields = raw.rsplit(")", 1)[1].split()
    return int(fields[19]), fields[0]  # field 22 (starttime) and field 3 (state)


@dataclass(frozen=True)
class ProcessRef:
    pid: int
    start_ticks: int  # the kernel's start time, clock ticks after boot: untouched by wall-clock steps
    boot: str = ""  # the boot's id ("" only for a record of an older servegrid's, converted once)

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        stat = _stat(pid)
        if stat is None:
            raise psutil.NoSuchProcess(pid)
        return cls(pid, stat[0], boot_id())

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return (
            stat is not None
            and stat[0] == self.start_ticks
            and stat[1] != "Z"
            and (not self.boot or self.boot == boot_id())
        )

    def carries(self, session: str) -> bool:
        """Alive, and one of that server session's processes (:data:`SESSION_ENV` in its environment)."""
        try:
            return self.alive() and in_session(psutil.Process(self.pid), session)
        except psutil.Error:
            return False

    def to_dict(self) -> dict[str, int | str]:
        return {"pid": self.pid, "start_ticks": self.start_ticks, "boot": self.boot}

    @classmethod
    def from_dict(cls, data: dict | None) -> ProcessRef | None:
        if not data:
            return None
        if "start_ticks" in data:
            return cls(int(data["pid"]), int(data["start_ticks"]), str(data.get("boot") or ""))
        # A record an older servegrid wrote (an epoch start time): its ticks as psutil derived the time from them.
        ticks = round((float(data["create_time"]) - psutil.boot_time()) * os.sysconf("SC_CLK_TCK"))
        return cls(int(data["pid"]), ticks, "")

    def token(self) -> str:
        """``pid:ticks:boot`` (an environment variable's value): see :meth:`from_token`."""
        return f"{self.pid}:{self.start_ticks}:{self.boot}"

    @classmethod
    def from_token(cls, raw: str) -> ProcessRef:
        pid, ticks, boot = raw.split(":")  # ValueError if it is not three fields
        return cls(int(pid), int(ticks), boot)


# Every process of a server carries its session in its environment (inherited by the engine's
# workers too): the identity a recorded process group is checked against before any signal, since
# after the server's group is gone (or a reboot) its number can belong to someone else's.
SESSION_ENV = "SERVEGRID_SESSION"


def in_session(proc: psutil.Process, session: str) -> bool:
    try:
        return bool(proc.environ().get(SESSION_ENV) == session)
    except psutil.Error:  # gone, or another user's: not ours
        return False


def group_members(pgid: int, session: str | None = None) -> list[psutil.Process]:
    """Live processes whose process group is ``pgid`` (and, given ``session``, that carry it)."""
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            # The group first: reading a process's environment is the costly check.
            if os.getpgid(proc.pid) != pgid or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if session is None or in_session(proc, session):
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def tree(pid: int) -> list[ProcessRef]:
    """``pid`` and all its descendants (those that left its process group too), as identities."""
    refs = []
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                refs.append(ProcessRef.of(proc.pid))
    except psutil.Error:
        pass
    return refs


def terminate_group(
    pgid: int, grace_s: float, session: str | None = None, known: Iterable[ProcessRef] = ()
) -> dict[str, int]:
    """SIGTERM the whole group and the ``known`` processes, SIGKILL what is left after ``grace_s``.

    Given ``session``, only group members that carry it are signalled, one by one, never the group as
    such; ``known`` processes are signalled if their pid and start time still match. The two differ
    because a process that renames itself (vLLM's ``VLLM::EngineCore``, through setproctitle) overwrites
    its environment as /proc shows it, so the session cannot be read from it: the supervisor records
    those by identity while they live. Returns how many processes each signal reached, for the record.
    """
    if pgid in (0, 1, os.getpgrp()):
        raise ValueError(f"refusing to signal process group {pgid}: it is not a server's own group")
    known = list(known)

    def targets() -> dict[int, psutil.Process]:
        found = {p.pid: p for p in group_members(pgid, session)}
        for ref in known:
            with contextlib.suppress(psutil.Error):
                if ref.alive():
                    found[ref.pid] = psutil.Process(ref.pid)
        return found

    first = targets()
    if session is None:
        _signal_group(pgid, signal.SIGTERM)
    for proc in first.values():
        _signal(proc, signal.SIGTERM)
        # A stopped process (a hung engine found SIGSTOPped, say) handles SIGTERM only once it runs again.
        _signal(proc, signal.SIGCONT)
    _, alive = psutil.wait_procs(list(first.values()), timeout=grace_s)
    # Members may have forked during shutdown: look again.
    leftovers = {p.pid: p for p in alive} | targets()
    if session is None:
        _signal_group(pgid, signal.SIGKILL)
    for proc in leftovers.values():
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(list(leftovers.values()), timeout=5)
    return {"sigterm": len(first), "sigkill": len(leftovers)}


def watch(
    ref: ProcessRef, on_gone: Callable[[], None], interval_s: float = 0.5, grace_s: float = 0.0
) -> threading.Event:
    """Call ``on_gone()`` (once, from a daemon thread) when ``ref`` disappears, unless the returned event is set
    within ``grace_s`` of that (the watcher's work ended on its own meanwhile); set the event to stop watching."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval_s):
            if not ref.alive():
                if not stop.wait(grace_s):
                    on_gone()
                return

    threading.Thread(target=poll, name=f"watch-{ref.pid}", daemon=True).start()
    return stop


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """In a child between fork and exec (``preexec_fn``): get ``sig`` when the parent dies (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def wait_gone(refs: list[ProcessRef], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(r.alive() for r in refs):
            return True
        time.sleep(0.1)
    return not any(r.alive() for r in refs)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _signal(proc: psutil.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(psutil.Error):
        proc.send_signal(sig)
