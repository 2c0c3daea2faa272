"""The process that owns one inference server.

Started by :mod:`servegrid.serving.server` in a session of its own, it launches the
server in another new session (so the server's whole tree shares one process
group), records pids, and tears that group down when asked (SIGTERM), when the
owner (Snakemake, or whoever started it) disappears, or when the server exits
by itself. It outlives the Snakemake job that started it, so that the next
cell of the same configuration can reuse the server.

Run as ``python -m servegrid.serving.supervisor LAUNCH.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from servegrid import atomic, redact
from servegrid.serving import procs
from servegrid.serving.state import STATE_FORMAT

POLL_S = 0.2
# Every poll: an engine forked just before its API server was killed must already be on the list
# (scanning once a second missed the fake server's engine child in a test that kills at once).
MEMBERS_EVERY_S = POLL_S


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def first_record(launch: dict[str, Any], supervisor: procs.ProcessRef) -> dict[str, Any]:
    """The record of a launch before its server runs: written by the process that launches the supervisor (so that
    a slow supervisor, on a network filesystem say, is not taken for a missing one) and by the supervisor itself."""
    return {
        "format_version": STATE_FORMAT,  # servegrid.serving.state.read takes it off
        "session": launch["session"],
        "configuration": launch["configuration"],
        "spec_hash": launch["spec_hash"],
        "url": launch["url"],
        "port": launch["port"],
        "gpus": launch["gpus"],
        "argv": redact.argv(launch["argv"]),
        "log_path": launch["log_path"],
        "owner": launch.get("owner"),
        "supervisor": supervisor.to_dict(),
        "server": None,
        "status": "launching",
        "returncode": None,
        "launched_at": now_iso(),
        "ended_at": None,
        "end_reason": None,
    }


class Supervisor:
    def __init__(self, launch: dict[str, Any]) -> None:
        self.launch = launch
        self.record_path = Path(launch["record_path"])
        self.owner = procs.ProcessRef.from_dict(launch.get("owner"))
        self.grace_s = float(launch["shutdown_timeout_s"])
        self.stop_reason: str | None = None
        self.members: list[procs.ProcessRef] = []
        self._members_checked = float("-inf")
        self.record = first_record(launch, procs.ProcessRef.of(os.getpid()))

    def _write(self, **changes: Any) -> None:
        self.record.update(changes)
        atomic.write_json(self.record_path, self.record)

    def _remember_members(self, server_pid: int, now: bool = False) -> None:
        """Every process of the server's tree, by pid and start time, in memory and in the record: what a
        stop signals besides the session's carriers (procs.terminate_group says why both)."""
        checked = time.monotonic()
        if not now and checked - self._members_checked < MEMBERS_EVERY_S:
            return
        self._members_checked = checked
        fresh = [ref for ref in procs.tree(server_pid) if ref not in self.members]
        if fresh:
            self.members += fresh
            self._write(members=[ref.to_dict() for ref in self.members])

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_reason = f"stop requested ({signal.Signals(signum).name})"

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        env = dict(os.environ)  # the server's environment came with this process's own, never through a file
        log = open(self.launch["log_path"], "ab", buffering=0)  # noqa: SIM115 - lives as long as the server
        try:
            if self.launch.get("cpus"):
                # Inherited by every process of the server, engine workers included.
                os.sched_setaffinity(0, self.launch["cpus"])
            if self.owner is not None and not self.owner.alive():
                raise OSError(f"owner process {self.owner.pid} is gone before the server started")
            proc = subprocess.Popen(
                self.launch["argv"],
                env=env,
                # If this supervisor is SIGKILLed, the server gets SIGTERM and shuts its engine down itself.
                preexec_fn=procs.die_with_parent,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.launch["cwd"],
            )
        except OSError as exc:  # also an affinity the kernel refuses
            log.write(f"servegrid: cannot execute {self.launch['argv'][0]!r}: {exc}\n".encode())
            self._write(status="exited", returncode=127, ended_at=now_iso(), end_reason=f"exec failed: {exc}")
            return 1
        server = procs.ProcessRef.of(proc.pid)
        self._write(server=server.to_dict(), pgid=proc.pid, status="running", members=[])
        session = self.launch["session"]

        while True:
            returncode = proc.poll()
            if returncode is not None:
                # The API server is gone; its engine processes may not be (orphaned, found by identity).
                procs.terminate_group(proc.pid, grace_s=min(self.grace_s, 5.0), session=session, known=self.members)
                self._write(status="exited", returncode=returncode, ended_at=now_iso(), end_reason="server exited")
                return 0
            self._remember_members(proc.pid)
            if self.stop_reason is None and self.owner is not None and not self.owner.alive():
                self.stop_reason = f"owner process {self.owner.pid} is gone"
            if self.stop_reason is not None:
                self._write(status="stopping", end_reason=self.stop_reason)
                self._remember_members(proc.pid, now=True)
                signals = procs.terminate_group(proc.pid, grace_s=self.grace_s, session=session, known=self.members)
                proc.wait()
                self._write(
                    status="stopped",
                    returncode=proc.returncode,
                    ended_at=now_iso(),
                    signals=signals,
                )
                return 0
            time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m servegrid.serving.supervisor LAUNCH.json", file=sys.stderr)
        return 2
    launch = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    launch.pop("format_version", None)  # written by the servegrid that started this supervisor: its own format
    return Supervisor(launch).run()


if __name__ == "__main__":
    sys.exit(main())
