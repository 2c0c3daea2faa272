"""A real one-node Slurm cluster with accounting (tools/slurm_localhost.py), started once per session.

Everything lives under a fresh /tmp/servegrid-slurm-* directory and on ports free at start, so it neither writes to /etc
nor collides with a cluster a user started with the tool's defaults. It needs root or passwordless sudo; without
either the tests that use it are skipped. With either, a cluster that does not come up is an error: the Slurm path
is then broken, not untestable.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from helpers import REPO

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "PREEMPTED")


def _tool() -> ModuleType:
    # tools/ is not a package (the script must run before any virtual environment exists): load it by path
    spec = importlib.util.spec_from_file_location("slurm_localhost", REPO / "tools" / "slurm_localhost.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["slurm_localhost"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _free_ports(count: int) -> list[int]:
    # held open together so that the kernel hands out distinct ports; free again once closed (best effort)
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


@dataclass
class SlurmCluster:
    dir: Path
    # os.environ plus SLURM_CONF and PATH with DIR/bin (wrappers pinning SLURM_CONF) first: pass to every Slurm
    # client and Snakemake run
    env: dict[str, str]

    def sacct(self, *args: str) -> str:
        done = subprocess.run(["sacct", *args], env=self.env, capture_output=True, text=True, timeout=30, check=True)
        return done.stdout

    def wait_job(self, job: str, timeout: float = 30) -> str:
        """Wait until sacct shows the job in a terminal state; return "STATE|EXITCODE" (e.g. "COMPLETED|0:0")."""
        deadline = time.monotonic() + timeout
        while True:
            row = self.sacct("-n", "-P", "-X", "-j", job, "-o", "State,ExitCode").strip()
            state = row.split("|")[0].split(" ")[0]  # "CANCELLED by 0" -> "CANCELLED"
            if state in TERMINAL:
                return row
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} not finished after {timeout:.0f} s (sacct: {row!r})")
            time.sleep(0.2)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    tool = _tool()
    if not tool.can_run():
        pytest.skip("a real Slurm cluster needs root or passwordless sudo (sudo -n), and this user has neither")
    # Not tmp_path_factory: pytest's basetemp is 0700 and munged wants a socket every user can reach (a job's
    # client runs as the submitting user). mkdtemp's own 0700 is opened to 0755 by the tool.
    directory = Path(tempfile.mkdtemp(prefix="servegrid-slurm-", dir="/tmp"))
    started: dict[str, dict[str, object]] = {}
    went_well = False
    try:
        ctld, slurmd, dbd, mysql = _free_ports(4)
        env = tool.up(directory, ctld_port=ctld, slurmd_port=slurmd, dbd_port=dbd, mysql_port=mysql)
        started = tool.recorded(directory)
        yield SlurmCluster(dir=directory, env={**os.environ, **env})
        went_well = True  # the session ran (tests may have failed: that does not come through the yield)
    finally:
        # whatever happened (up failed half-way, Ctrl-C, an error in a test's teardown): stop what was started,
        # then make sure. An assertion here chains onto an exception in flight, so neither hides the other.
        started = started or tool.recorded(directory)
        left = tool.down(directory)
        alive = sorted({*left, *(name for name, entry in started.items() if tool.alive(entry))})
        assert not alive, f"Slurm test cluster daemons still alive after down(): {alive} (see {directory}/log)"
        if went_well:
            shutil.rmtree(directory, ignore_errors=True)  # MariaDB's data alone is ~150 MB; logs stay on failure
