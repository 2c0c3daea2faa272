"""The fault matrix: every fault the suite in tests/faults provokes, and the four checks each test makes.

Each test provokes its fault for real and checks: (1) the time to a clear error, (2) what is left on disk
(no file that looks complete and is not), (3) that no process survives, (4) that the next run completes
the grid. The times it measures are recorded with :meth:`Matrix.record` and printed at the end of the
run as the fault matrix of docs/reliability.md (``results/fault-matrix.md``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from helpers import REPO, engine_for_tests, free_port_range, placed


@dataclass(frozen=True)
class Fault:
    what: str  # the fault, as the fault matrix (docs/reliability.md) names it
    behaviour: str  # what servegrid does
    rerun: str  # what the next run does


FAULTS: dict[str, Fault] = {
    # ---- the server's faults: real vLLM (CPU build) ------------------------------------------------
    "server-killed": Fault(
        "vLLM server SIGKILLed mid-cell",
        "the cell fails naming the lost server and its log's tail; no cell file",
        "measures the cell on a new server",
    ),
    "engine-hang": Fault(
        "vLLM engine hangs mid-cell (engine core SIGSTOPped, `/health` still 200)",
        "the cell fails after 10 × its warm-up × its sessions without a token (at least `stall_floor_s`, at most "
        "the cell's own budget, `max_duration_s`); the server is stopped, not reused",
        "measures the cell on a new server",
    ),
    "hang-between-cells": Fault(
        "vLLM engine hangs between two cells",
        "the next cell's liveness check (one tiny completion) fails; the server is replaced",
        "nothing left to do: the cell was measured on the new server",
    ),
    "supervisor-killed": Fault(
        "the server's supervisor SIGKILLed",
        "the server gets SIGTERM from the kernel (`PR_SET_PDEATHSIG`) and takes its engine down; the cell job "
        "sees its supervisor gone and stops at once; the teardown ends what is left",
        "measures the cell on a new server",
    ),
    "snakemake-sigint": Fault(
        "Ctrl-C while a cell measures",
        "Snakemake stops the job; the server is stopped; no cell file",
        "measures the cell again",
    ),
    "snakemake-sigterm": Fault(
        "`kill` (SIGTERM) of Snakemake while a cell measures",
        "Snakemake lets the running cell finish, then stops; the server is stopped",
        "nothing left to do for that cell",
    ),
    "snakemake-sigkill": Fault(
        "`kill -9` of Snakemake while a cell measures",
        "the supervisor sees its owner gone and stops the server; the orphaned cell job stops at once; no cell file",
        "`snakemake --unlock` (Snakemake's lock outlives `kill -9`), then measures the cell again",
    ),
    "gateway-run": Fault(
        "a grid measured both ways through a LiteLLM proxy (route: both)",
        "not a fault: the proxy starts once, serves every cell and is stopped at the end; its key is nowhere on disk",
        "nothing left to do",
    ),
    "snakemake-sigkill-gateway": Fault(
        "`kill -9` of Snakemake while a cell measures through the LiteLLM proxy",
        "the supervisors see their owner gone and stop the proxy and the server; no cell file",
        "`snakemake --unlock`, then measures the cell again",
    ),
    "gateway-dies-mid-cell": Fault(
        "the gateway (LiteLLM proxy) SIGKILLed while a cell measures through it (`route: both`)",
        "the cell fails naming the gateway's end and its log's tail; no cell file (its proxied requests failed for "
        "the gateway's sake)",
        "measures the cell through a new gateway",
    ),
    "snakemake-sigkill-next-cell": Fault(
        "`kill -9` of Snakemake as the next cell job starts",
        "the server is stopped; the starting cell job starts no server for an owner that is gone",
        "`snakemake --unlock`, then measures the remaining cells",
    ),
    "server-fails-to-start": Fault(
        "vLLM exits during start-up (an unknown flag)",
        "its cells fail naming the exit code and the log's tail; `--keep-going` measures the other "
        "configurations; not retried within the run",
        "tries the server again",
    ),
    "server-not-healthy": Fault(
        "vLLM not healthy within `startup_timeout_s`",
        "the cell fails naming the key; the server is stopped",
        "tries the server again",
    ),
    "context-over-server-limit": Fault(
        "a context longer than the running server accepts (limit not in the config)",
        "the cell fails at the server's first answer, naming the key and both lengths; nothing is sent",
        "fails again until the config changes",
    ),
    # ---- the host's faults: calibration server standing in for the engine process ------------------
    "port-taken": Fault(
        "the first port of `port_range` taken by another program",
        "the server starts on the next free port",
        "nothing left to do",
    ),
    "two-pipelines": Fault(
        "two pipelines in two directories on one host, same `port_range`",
        "host-wide claims give each its own port; each measures only the server it launched",
        "nothing left to do",
    ),
    "port-in-time-wait": Fault(
        "the only port of `port_range` held by the previous server's connections in TIME_WAIT (a minute after it "
        "ended)",
        "the port is used at once: TIME_WAIT holds no server, and the servers' own binds (SO_REUSEADDR) share a port "
        "with it",
        "nothing left to do",
    ),
    "port-held-while-loading": Fault(
        "the first port of `port_range` bound, not yet listening, with SO_REUSEADDR and SO_REUSEPORT (a vLLM still "
        "loading its weights)",
        "the port counts as taken (the probe binds with neither option); the server starts on the next port",
        "nothing left to do",
    ),
    "port-raced": Fault(
        "the server's port taken by another process between the probe and the server's bind",
        "the server exits ('Address already in use'); servegrid says so and starts it once more on another port",
        "nothing left to do",
    ),
    "slow-start-beside-others": Fault(
        "one configuration's server slow to start while another configuration's cells run (`--cores 2`)",
        "the other configuration starts, reuses and stops its server meanwhile: the host's state lock is held "
        "only to decide and launch, a start's wait by its own configuration's lease",
        "nothing left to do",
    ),
    "clock-step": Fault(
        "the wall clock stepped by 1 s while servers run (NTP, a VM's resume, `date`)",
        "nothing stops: a process is known by the kernel's start ticks and the boot's id, never by an epoch time",
        "nothing left to do",
    ),
    "two-jobs-one-node": Fault(
        "two configurations' Slurm jobs packed on one node at once, /tmp shared by them and per job (localhost Slurm)",
        "each job keeps its own state folder (`<host>-job<id>`: records, leases, gateway) and its own GPU claims; "
        "each measures all its cells on its own server, neither stops the other's",
        "nothing left to do",
    ),
    "config-edited-while-queued": Fault(
        "`config.yaml` edited while the run's Slurm job waits in the queue (an output length changed)",
        "the job measures the config its run planned (`results/.plans/<id>.json`, named by `SERVEGRID_PLAN`) and its "
        "log names the edited key; tables and cells agree with the plan",
        "measures the edited cells (their params changed)",
    ),
    "stale-records": Fault(
        "server records left from before a reboot (pids now someone else's)",
        "`servegrid server down --all` signals only processes that carry the server's session",
        "starts new servers",
    ),
    "proxy-variables": Fault(
        "`http_proxy`, `https_proxy` and `all_proxy` set to a dead proxy, no `no_proxy` (a cluster's download proxy)",
        "control calls (health, warm-up, metrics, tokenize) never go through a proxy: the servers they call are the "
        "ones servegrid launched on this host",
        "nothing left to do",
    ),
    "disk-full": Fault(
        "disk full while a cell file is written (`RLIMIT_FSIZE`)",
        "the cell fails naming the file and the error; no cell file, no partial one",
        "measures the cell again",
    ),
    "corrupt-cell": Fault(
        "a cell file damaged on disk",
        "`aggregate` fails naming the file (page checksums); the file is moved aside",
        "measures that cell again, then aggregates",
    ),
    "ctrl-c-aggregate": Fault(
        "Ctrl-C during `aggregate`",
        "no table, no partial one",
        "aggregates again",
    ),
    "ctrl-c-report": Fault(
        "Ctrl-C while the report is written",
        "no report, no partial one",
        "writes the report again",
    ),
    # ---- the wire's faults: calibration server ---------------------------------------------------
    "engine-refuses": Fault(
        "the engine dies at its first request of its own error (vLLM's CPU build: Qwen3-Next, MTP and prefix "
        "caching together)",
        "once a second fresh start dies of the same root cause, the configuration's cells are written as refused, "
        "naming the engine's exception and where it was raised; "
        "its other cells in the run start no server; the report names it and the verdict compares the others",
        "nothing left to do: the refusal is the configuration's result until its spec changes",
    ),
    "engine-oom": Fault(
        "the engine dies at its first request of a fault of the moment (CUDA out of memory, a CUDA or NCCL error, "
        "an engine process killed)",
        "a failed start, not a refusal: the server is started once more; a second such death fails the "
        "configuration's cells in this run, writes no cell file and records no refusal",
        "measures the cells",
    ),
    "engine-dies-mid-cell": Fault(
        "the engine dies of its own error after good requests of a cell",
        "the cell fails, written nowhere, naming the engine's exception; the configuration's other cells of the run "
        "fail at once without starting a server (a death of the moment, such as out of memory, is not recorded: "
        "the next cell starts the server again)",
        "measures the cells",
    ),
    "wire-reset": Fault(
        "connection reset mid-stream",
        "that request is an error, counted; the rest of the cell is measured",
        "nothing left to do (the cell is judged by `validity`)",
    ),
    "wire-5xx": Fault(
        "HTTP 500 or 503 for one request",
        "that request is an error, counted; the rest of the cell is measured",
        "nothing left to do (the cell is judged by `validity`)",
    ),
    "wire-malformed": Fault(
        "an SSE event that is JSON but not an object, or `completion_tokens: null`",
        "that request is an error, counted; the rest of the cell is measured",
        "nothing left to do (the cell is judged by `validity`)",
    ),
    "warmup-fails": Fault(
        "a warm-up request fails",
        "counted; the cell is marked invalid (its shared prefix may not be primed)",
        "nothing left to do (the cell is judged by `validity`)",
    ),
    "foreign-traffic": Fault(
        "another client's requests reach the cell's server while the cell measures (another user of the host)",
        "the cell is measured, then marked invalid: the server counted more first tokens in the measured phase than "
        "the client sent (`foreign_requests`)",
        "nothing left to do (the cell is judged by `validity`); measure it again when the server is yours alone",
    ),
    "dev-route-intruder": Fault(
        "another user of the host calls the server's development routes while a cell measures (`/reset_prefix_cache` "
        "every 50 ms, `/sleep`, `/collective_rpc`, `/server_info`)",
        "refused (403) and logged in the server's log, on both routes: outside the OpenAI API, servegrid's vLLM "
        "answers its own user only; the cell measures as if alone",
        "nothing to do",
    ),
    "lost-between-stages": Fault(
        "the server exits between the cell's warm-up and its measured phase (killed, out of memory)",
        "the cell fails naming the lost server, the transport's error and its log's tail (no traceback); no cell file",
        "measures the cell on a new server",
    ),
    "warmup-hang": Fault(
        "the server hangs during a cell's warm-up",
        "the cell fails after 10 × `stall_floor_s` (not `request_timeout_s`); the server is stopped",
        "measures the cell on a new server",
    ),
    # ---- bad input ---------------------------------------------------------------------------------
    "config-duplicate-key": Fault(
        "a YAML key given twice (two configurations of one name)",
        "refused before anything runs, naming both lines",
        "runs once the key is fixed",
    ),
    "config-not-integer": Fault(
        "`concurrency: [1, 2.0]`",
        "refused before anything runs, naming the key",
        "runs once fixed",
    ),
    "config-flag-spelling": Fault(
        "`--enable_prefix_caching` in a configuration's `args`",
        "refused before anything runs: servegrid sets that flag, in any spelling",
        "runs once fixed",
    ),
    "config-context-too-long": Fault(
        "a context longer than `--max-model-len` in the config",
        "refused before anything runs, naming the key and both lengths",
        "runs once fixed",
    ),
    "config-tiny-over-folder": Fault(
        "`model.tiny` set and `model.path` an existing folder it did not build",
        "refused before anything runs; the folder is left as it was",
        "runs once fixed",
    ),
}


@dataclass
class Measured:
    fault: str
    seconds: float | None  # time to a clear error; None where there is no error to wait for
    detail: str = ""


class Matrix:
    """What the suite measured, fault by fault, rendered as the fault matrix of docs/reliability.md."""

    def __init__(self) -> None:
        self.rows: dict[str, Measured] = {}
        self.fresh: list[Measured] = []  # recorded by the test running now (helpers.fault_matrix sends them on)

    def record(self, fault: str, seconds: float | None, detail: str = "") -> None:
        if fault not in FAULTS:
            raise KeyError(f"{fault!r} is not in helpers.faults.FAULTS")
        self.rows[fault] = Measured(fault, seconds, detail)
        self.fresh.append(self.rows[fault])

    def merge(self, row: Measured) -> None:
        """A row another process recorded (an xdist worker): where two tests timed one fault, the slower time."""
        seen = self.rows.get(row.fault)
        if seen is None or seen.seconds is None or (row.seconds is not None and row.seconds >= seen.seconds):
            self.rows[row.fault] = row

    def markdown(self) -> str:
        lines = [
            "| fault | behaviour | time to a clear error | what a rerun does |",
            "|---|---|---|---|",
        ]
        for key, fault in FAULTS.items():
            row = self.rows.get(key)
            if row is None:
                continue
            took = "no error" if row.seconds is None else f"{row.seconds:.1f} s"
            if row.detail:
                took += f" ({row.detail})"
            lines.append(f"| {fault.what} | {fault.behaviour} | {took} | {fault.rerun} |")
        return "\n".join(lines) + "\n"


# ---- the four checks ---------------------------------------------------------------------------------


def survivors(workdir: Path) -> list[psutil.Process]:
    """Every live process that belongs to the pipeline in ``workdir``: whatever runs there (Snakemake, its
    jobs, supervisors, servers: they all start in it) or carries a server session recorded there."""
    root = str(workdir.resolve())
    sessions = {p.stem.split(".")[0] for p in (workdir / "results" / "servers").glob("*/logs/*.log")}
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cwd = proc.cwd()
            if cwd == root or cwd.startswith(root + os.sep) or proc.environ().get("SERVEGRID_SESSION") in sessions:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_no_survivors(workdir: Path, timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for every process of ``workdir``'s pipeline to end; those still alive."""
    deadline = time.monotonic() + timeout_s
    while (alive := survivors(workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def kill_survivors(workdir: Path) -> None:
    """After a failed assertion: nothing a test started outlives it."""
    for proc in survivors(workdir):
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)


def half_written(workdir: Path) -> list[Path]:
    """Files that look like outputs but are not finished: atomic writes' leftovers (``.*.partial``)."""
    results = workdir / "results"
    return sorted(p for p in results.rglob("*.partial*")) if results.exists() else []


def wait_for(predicate, timeout_s: float, step_s: float = 0.2) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return bool(predicate())


# ---- the grids the fault tests start from -----------------------------------------------------------


def vllm_config(**workloads: Any) -> dict[str, Any]:
    """The CPU demo's config with one configuration (prefix caching) and the given workloads, its server on this test
    worker's core (helpers.placed)."""
    raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    # A fixed count (requests_per_session), not the demo's sequential sampling: each fault needs a cell of a
    # known length to strike into.
    raw["sampling"] = {"temperature": raw["sampling"]["temperature"]}
    raw["workloads"] = workloads or {
        "decode": {"contexts": [256], "concurrency": [1], "output_tokens": 16, "requests_per_session": 2}
    }
    raw["engine"] = engine_for_tests(raw["engine"])
    raw["operations"]["shutdown_timeout_s"] = 10
    raw["operations"]["port_range"] = list(free_port_range(40))
    # The faults are the servers' and the pipeline's: the preflight (an import of vLLM, 10-30 s here) has its own
    # tests (tests/unit/test_preflight.py, and tests/integration/test_pipeline.py runs it on real vLLM).
    raw["operations"]["preflight"] = False
    return placed(raw)


def calibration_config(*server_args: str, **workloads: Any) -> dict[str, Any]:
    """A one-configuration grid served by the calibration server in vLLM's dialect (fast, no model)."""
    return {
        "experiment": {"title": "fault suite"},
        "model": {"path": "none", "served_name": "calibration"},
        "engine": {"command": [sys.executable, "-m", "servegrid.testing.calibration", "--model", "{model}"]},
        "configurations": {"only": {"label": "only", "prefix_caching": True, "args": list(server_args)}},
        "workloads": workloads
        or {"decode": {"contexts": [32, 64], "concurrency": [2], "output_tokens": 8, "requests_per_session": 2}},
        "operations": {
            "preflight": False,  # the calibration stand-in serves no checkpoint (model.path "none" would be its error)
            "port_range": list(free_port_range(40)),
            "startup_timeout_s": 60,
            "shutdown_timeout_s": 5,
            "request_timeout_s": 120,
        },
    }
