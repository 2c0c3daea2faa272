"""The server's faults and Snakemake's end, provoked for real on vLLM (CPU build) under Snakemake.

Each test checks the four things of helpers.faults: the time to a clear error, what is left on disk,
that no process survives (the whole server tree: API server, engine core, workers), and that the next
run completes the grid. A vLLM CPU start costs about a minute, so grids are one or two small cells, and the
faults that strike while a cell measures run as one chain (each one's rerun is the next one's run; see below).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from helpers import TEST_ENGINE_ARGS, copy_workflow, snakemake, write_yaml
from helpers.faults import half_written, kill_survivors, vllm_config, wait_for, wait_no_survivors
from servegrid import paths
from servegrid.engines.vllm import VLLMEngine
from servegrid.records import cell_file
from servegrid.serving import state

pytestmark = [pytest.mark.vllm, pytest.mark.pipeline]

CELL = "results/cells/prefix_cache/decode/ctx256_c1.parquet"
CELL_LOG = "results/logs/cells/prefix_cache/decode/ctx256_c1.log"
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.MULTILINE)


# The engine hang strikes a cell of several sessions: requests of the others go on being sent beside the hung ones
# (no progress), and its stall limit scales with the sessions (servegrid.measuring.client_monitor).
HANG_SESSIONS = 4
HANG_CELL = f"results/cells/prefix_cache/decode/ctx256_c{HANG_SESSIONS}.parquet"
HANG_CELL_LOG = f"results/logs/cells/prefix_cache/decode/ctx256_c{HANG_SESSIONS}.log"


def long_cell(sessions: int = 1, **operations: Any) -> dict[str, Any]:
    """One decode cell that measures for about 20 s (eager, 2 cores): time to provoke a fault while it measures
    (each strikes within its first 4 s), short enough for the runs that complete it."""
    grid = {"contexts": [256], "concurrency": [sessions], "output_tokens": 64, "requests_per_session": 20}
    raw = vllm_config(decode=grid)
    raw["operations"].update(operations)
    return raw


def start(workdir: Path, raw: dict[str, Any], target: str = "aggregate") -> subprocess.Popen:
    """Snakemake in its own session, as in a terminal; output to a file (a pipe could fill up and block)."""
    write_yaml(workdir / "fault.yaml", raw)
    with open(workdir / "snakemake.out", "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "1", target, "--configfile", "fault.yaml"],
            cwd=workdir,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
            # As in a terminal: a test runner started in the background inherits SIGINT ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def wait_measuring(workdir: Path, log: str = CELL_LOG, timeout_s: float = 600) -> None:
    """Until the cell's server is up and the cell runs on it."""
    path = workdir / log
    assert wait_for(lambda: path.exists() and " on http://" in path.read_text(), timeout_s), "no cell started"


def requests_started(record: dict[str, Any]) -> float:
    """Requests the server has answered a first token to, by its own counter (servegrid's canonical name)."""
    exposition = httpx.get(f"http://127.0.0.1:{record['port']}/metrics", timeout=5).text
    return VLLMEngine().parse_metrics(exposition, None).get("time_to_first_token_seconds_count", 0.0)


def wait_in_measured_phase(record: dict[str, Any], warmup_requests: int = 1) -> None:
    """Until the cell's first measured request is under way: the server has begun the cell's warm-up requests and
    one more since the cell started (an event on the server's own counter, not a guess at how long warm-up takes).
    Called once the cell runs on the server (wait_measuring), so its warm-up is still to come or under way."""
    before = requests_started(record)
    assert wait_for(lambda: requests_started(record) >= before + warmup_requests + 1, 120), "no measured request"


def server_record(workdir: Path, configuration: str = "prefix_cache") -> dict[str, Any]:
    return json.loads((state.host_directory(workdir / paths.STATE_DIR) / f"{configuration}.json").read_text())


def engine_core(record: dict[str, Any]) -> psutil.Process:
    """vLLM's engine process: renamed VLLM::EngineCore, in the API server's process group."""
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == record["pgid"] and "EngineCore" in " ".join(proc.cmdline() or [proc.name()]):
                return proc
    raise AssertionError(f"no engine core in process group {record['pgid']}")


def log_seconds(text: str, end: str) -> float:
    """Seconds from a job log's first timestamped line to the first line containing ``end``."""
    first = None
    for line in text.splitlines():
        match = LOG_TIME.match(line)
        if not match:
            continue
        when = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")
        first = first or when
        if end in line:
            return (when - first).total_seconds()
    raise AssertionError(f"no log line with {end!r} in:\n{text[-3000:]}")


def rerun_completes(workdir: Path, expected: list[str] = [CELL], unlock: bool = False) -> None:  # noqa: B006
    """Check 4: the same command again, fault gone, completes the grid. After ``kill -9`` Snakemake's own lock
    on the directory is left behind (no handler ran): ``snakemake --unlock`` first, as Snakemake says."""
    if unlock:
        rerun_after_kill_9_is_refused_until_unlocked(workdir)
    result = snakemake(workdir, "--cores", "1", "aggregate", "--configfile", "fault.yaml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert all((workdir / cell).exists() for cell in expected)
    assert (workdir / "results" / "tables" / "summary.parquet").exists()
    assert wait_no_survivors(workdir, 45) == []


def rerun_after_kill_9_is_refused_until_unlocked(workdir: Path) -> None:
    refused = snakemake(workdir, "--cores", "1", "aggregate", "--configfile", "fault.yaml")
    assert refused.returncode != 0 and "Directory cannot be locked" in refused.stdout + refused.stderr
    assert snakemake(workdir, "--unlock", "--configfile", "fault.yaml").returncode == 0


def ended_cleanly(workdir: Path, proc: subprocess.Popen, cell: str | None = CELL) -> None:
    """Checks 2 and 3 after a failed or interrupted run: no half or false cell file, no process."""
    proc.wait(timeout=300)
    if cell is not None:
        assert not (workdir / cell).exists()
    assert half_written(workdir) == []
    assert wait_no_survivors(workdir, 45) == []


# ---- faults while a cell measures: one chain on one working copy --------------------------------------
#
# Each of these faults ends in the same state, checked by its own test: the run failed or stopped, no cell
# file, no half-written file, no process of the pipeline alive. The run after it (check 4) is the next
# fault's run: it must start a new server (a session none of the earlier runs had) and measure on it before
# that fault strikes; the last run completes the grid. Six vLLM starts for six faults instead of eleven (the first,
# a start cut short at 3 s, loads nothing; a start costs 20-60 s here, and the suite must fit CI).


class Chain:
    """The working copy the mid-cell faults run in, one after another, and the server sessions seen so far."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.sessions: list[str] = []
        self.needs_unlock = False  # after kill -9 Snakemake's own lock is left behind

    def next_run(self, sessions: int = 1, **operations: Any) -> tuple[subprocess.Popen, dict[str, Any]]:
        """The previous fault's rerun, started until its cell measures on a new server: (Snakemake, record)."""
        kill_survivors(self.workdir)  # nothing to kill unless an earlier test of the chain failed
        if self.needs_unlock:
            rerun_after_kill_9_is_refused_until_unlocked(self.workdir)
            self.needs_unlock = False
        cell_log = CELL_LOG if sessions == 1 else HANG_CELL_LOG
        log = self.workdir / cell_log
        if log.exists():  # the previous fault's log, kept beside for reading; the rerun writes its own
            log.rename(log.with_suffix(f".fault-{len(self.sessions)}.log"))
        proc = start(self.workdir, long_cell(sessions, **operations))
        try:
            wait_measuring(self.workdir, cell_log)
        except AssertionError:
            proc.kill()
            raise
        record = server_record(self.workdir)
        assert record["session"] not in self.sessions, "the rerun measured on a server of an earlier run"
        self.sessions.append(record["session"])
        return proc, record


@pytest.fixture(scope="module")
def chain(tmp_path_factory):  # type: ignore[no-untyped-def]
    workdir = copy_workflow(tmp_path_factory.mktemp("chain") / "wf")
    yield Chain(workdir)
    kill_survivors(workdir)


def test_a_server_that_is_not_healthy_in_time_is_stopped(chain, matrix):
    """First in the chain: a start-up cut short at 3 s costs no server start of its own, and its rerun (check 4) is
    the next fault's run, which starts a server in time and measures on it."""
    write_yaml(chain.workdir / "fault.yaml", long_cell(startup_timeout_s=3))
    started = time.monotonic()
    result = snakemake(chain.workdir, "--cores", "1", "aggregate", "--configfile", "fault.yaml")
    seconds = time.monotonic() - started
    assert result.returncode != 0
    log = (chain.workdir / CELL_LOG).read_text()
    assert "did not become healthy within 3 s (operations.startup_timeout_s); it was stopped" in log
    assert not (chain.workdir / CELL).exists() and half_written(chain.workdir) == []
    assert wait_no_survivors(chain.workdir, 30) == []
    matrix.record("server-not-healthy", seconds, "the whole run, `startup_timeout_s` = 3 s")


def test_server_killed_mid_cell(chain, matrix):
    proc, record = chain.next_run()
    wait_in_measured_phase(record)
    os.kill(record["server"]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    proc.wait(timeout=300)
    seconds = time.monotonic() - killed
    log = (chain.workdir / CELL_LOG).read_text()
    assert proc.returncode != 0
    assert "lost the server" in log or "measured requests failed" in log, log[-3000:]
    assert "Server log: " in log and "--- last lines ---" in log
    ended_cleanly(chain.workdir, proc)
    matrix.record("server-killed", seconds, "to the end of the run")


def test_engine_hang_mid_cell(chain, matrix):
    """Four sessions: when the engine stops, each session's request hangs; none of them counts as progress."""
    proc, record = chain.next_run(HANG_SESSIONS, stall_floor_s=2, request_timeout_s=600)
    wait_in_measured_phase(record)
    engine_core(record).send_signal(signal.SIGSTOP)  # the engine stops; the API server's /health still says 200
    stopped = time.monotonic()
    proc.wait(timeout=400)
    seconds = time.monotonic() - stopped
    log = (chain.workdir / HANG_CELL_LOG).read_text()
    assert proc.returncode != 0
    assert re.search(
        r"made no progress for \d+ s with requests in flight \(limit \d+ s, from this cell's warm-up\): "
        r"stopped, not reused",
        log,
    ), log[-3000:]
    assert seconds < 300  # not request_timeout_s (600 s here; 1800 s in config.yaml)
    ended_cleanly(chain.workdir, proc, HANG_CELL)
    matrix.record("engine-hang", seconds, f"to the end of the run; {HANG_SESSIONS} sessions, `stall_floor_s` 2 s")


def test_supervisor_killed_takes_the_server_with_it(chain, matrix):
    proc, record = chain.next_run()
    # Looked up before the kill: vLLM may have stopped its engine a moment after it.
    server_tree = [psutil.Process(record["server"]["pid"]), engine_core(record)]
    os.kill(record["supervisor"]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    # PR_SET_PDEATHSIG: the kernel sends the API server SIGTERM; vLLM shuts its engine down itself.
    assert wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in server_tree), 60)
    gone_after = time.monotonic() - killed
    proc.wait(timeout=300)
    log = (chain.workdir / CELL_LOG).read_text()
    assert proc.returncode != 0
    # The cell watches its server's supervisor (vLLM's API server can wait for the cell's open streams after
    # its SIGTERM); or it lost the server first.
    gone = f"the supervisor (pid {record['supervisor']['pid']}) of server session {record['session']} is gone"
    assert gone in log or "lost the server" in log or "measured requests failed" in log, log[-3000:]
    ended_cleanly(chain.workdir, proc)
    matrix.record("supervisor-killed", gone_after, "until the server's processes are gone")


@pytest.mark.parametrize(("fault", "sig"), [("snakemake-sigint", signal.SIGINT), ("snakemake-sigkill", signal.SIGKILL)])
def test_no_server_outlives_an_interrupted_snakemake(chain, matrix, fault, sig):
    proc, _ = chain.next_run()
    try:
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole foreground group
        else:
            os.kill(proc.pid, sig)  # only Snakemake itself
        signalled = time.monotonic()
        proc.wait(timeout=300)
        # After kill -9 no handler runs in Snakemake: the supervisor must notice its owner is gone.
        assert wait_no_survivors(chain.workdir, 45) == [], f"processes still running after {fault}"
        seconds = time.monotonic() - signalled
        assert not (chain.workdir / CELL).exists()  # interrupted: no file that looks complete
        assert half_written(chain.workdir) == []
        matrix.record(fault, seconds, "until no process is left")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the orphaned cell job after kill -9
        chain.needs_unlock = sig == signal.SIGKILL


def test_the_run_after_the_last_fault_completes_the_grid(chain):
    """Check 4 of the chain's last fault; the earlier ones' reruns each measured on a new server (next_run)."""
    kill_survivors(chain.workdir)
    rerun_completes(chain.workdir, unlock=chain.needs_unlock)
    session = cell_file.read_cell(chain.workdir / CELL)[1].server["session"]
    assert session not in chain.sessions  # measured on a new server, not on one a fault left behind


def test_no_server_outlives_a_terminated_snakemake(workdir, matrix):
    raw = long_cell()
    raw["workloads"]["decode"]["requests_per_session"] = 10  # Snakemake lets the running cell finish: keep it short
    proc = start(workdir, raw)
    wait_measuring(workdir)
    try:
        os.kill(proc.pid, signal.SIGTERM)  # only Snakemake itself
        signalled = time.monotonic()
        proc.wait(timeout=300)
        assert wait_no_survivors(workdir, 45) == [], "processes still running after snakemake-sigterm"
        seconds = time.monotonic() - signalled
        assert half_written(workdir) == []
        # The running cell was let finish: its file is there, whole, and holds the cell's measured requests.
        table, meta = cell_file.read_cell(workdir / CELL)
        assert meta.spec.id == "prefix_cache/decode/ctx256_c1"
        assert table.column("phase").to_pylist().count("measured") > 0
        matrix.record("snakemake-sigterm", seconds, "until no process is left")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    rerun_completes(workdir)


# ---- faults between two cells: a second chain ------------------------------------------------------------
#
# A grid of three short cells on one working copy. The first fault (kill -9 of Snakemake as its second cell starts)
# leaves one cell measured; its rerun (check 4) is the second fault's run: it measures the other two, the engine
# hung between them, and completes the grid. Three vLLM starts for two faults instead of four.

BETWEEN_CONTEXTS = (256, 512, 768)


def between_cells(workdir: Path) -> dict[int, Path]:
    return {c: workdir / f"results/cells/prefix_cache/decode/ctx{c}_c1.parquet" for c in BETWEEN_CONTEXTS}


def between_grid(**operations: Any) -> dict[str, Any]:
    raw = vllm_config(decode={"contexts": list(BETWEEN_CONTEXTS), "concurrency": [1], "output_tokens": 16})
    raw["operations"].update(operations)
    return raw


@pytest.fixture(scope="module")
def between(tmp_path_factory):  # type: ignore[no-untyped-def]
    workdir = copy_workflow(tmp_path_factory.mktemp("between") / "wf")
    yield workdir
    kill_survivors(workdir)


def test_kill_9_as_the_next_cell_starts_leaves_no_server(between, matrix):
    workdir = between
    proc = start(workdir, between_grid())
    cells = between_cells(workdir)
    try:
        assert wait_for(lambda: any(p.exists() for p in cells.values()), 600, step_s=0.05), "no cell finished"
        (first,) = [c for c, path in cells.items() if path.exists()]
        # The next cell Snakemake picks (its order is its own): whichever log appears first.
        logs = {c: workdir / f"results/logs/cells/prefix_cache/decode/ctx{c}_c1.log" for c in cells if c != first}
        assert wait_for(lambda: any(log.exists() for log in logs.values()), 60, step_s=0.02), "no next cell started"
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_no_survivors(workdir, 60) == []
        seconds = time.monotonic() - killed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    sessions = list((workdir / "results/servers/prefix_cache/logs").glob("*[0-9a-f].log"))
    assert len(sessions) == 1, f"a server was started after its owner was gone: {sessions}"
    assert [c for c, path in cells.items() if path.exists()] == [first]  # the next cell left nothing
    assert half_written(workdir) == []
    matrix.record("snakemake-sigkill-next-cell", seconds, "until no process is left")


def test_engine_hang_between_cells_is_not_reused(between, matrix):
    """Also check 4 of the kill -9 before it: refused until unlocked, then this run completes the grid."""
    workdir = between
    kill_survivors(workdir)  # nothing to kill unless the test before failed
    rerun_after_kill_9_is_refused_until_unlocked(workdir)
    cells = between_cells(workdir)
    measured_before = {c for c, path in cells.items() if path.exists()}
    assert len(measured_before) == 1, measured_before
    proc = start(workdir, between_grid(stall_floor_s=3))
    left = {c: path for c, path in cells.items() if c not in measured_before}
    assert wait_for(lambda: any(p.exists() for p in left.values()), 600, step_s=0.05), "no cell finished"
    hung = server_record(workdir)
    engine_core(hung).send_signal(signal.SIGSTOP)  # before the next cell's job asks to reuse the server
    (second,) = [c for c, path in left.items() if not path.exists()]  # Snakemake picks the order
    proc.wait(timeout=600)
    assert proc.returncode == 0, (workdir / "snakemake.out").read_text()[-3000:]
    second_log = (workdir / f"results/logs/cells/prefix_cache/decode/ctx{second}_c1.log").read_text()
    replaced = f"server session {hung['session']} of configuration 'prefix_cache' did not complete a tiny request"
    assert replaced in second_log
    match = re.search(r"\(ReadTimeout after ([\d.]+) s, limit (\d+) s\): replaced, not reused", second_log)
    assert match, second_log[-3000:]
    measured_on = cell_file.read_cell(cells[second])[1].server
    assert measured_on["session"] != hung["session"]
    assert all(path.exists() for path in cells.values())
    assert (workdir / "results" / "tables" / "summary.parquet").exists()
    assert half_written(workdir) == []
    assert wait_no_survivors(workdir, 45) == []  # the SIGSTOPped engine included
    matrix.record("hang-between-cells", float(match[1]), f"the liveness check; limit {match[2]} s")


# ---- start-up faults and a server's own limit ----------------------------------------------------------


def test_keep_going_past_a_broken_server_and_a_too_long_cell(workdir, matrix):
    raw = vllm_config(decode={"contexts": [256, 40000], "concurrency": [1], "output_tokens": 16})
    # No --max-model-len in the config, so that only the running server can tell that 40,000 tokens do not
    # fit (the tiny model's 32,768 positions); with it in the config, the config itself is refused.
    raw["engine"]["args"] = ["--load-format", "dummy", *TEST_ENGINE_ARGS]  # vllm_config's, less --max-model-len
    raw["configurations"] = {
        "broken": {"label": "broken", "prefix_caching": True, "args": ["--no-such-flag"]},
        "prefix_cache": raw["configurations"]["prefix_cache"],
    }
    write_yaml(workdir / "fault.yaml", raw)
    result = snakemake(workdir, "--cores", "1", "--keep-going", "aggregate", "--configfile", "fault.yaml")
    assert result.returncode != 0
    assert "Error in rule cell" in result.stdout + result.stderr
    cells = workdir / "results" / "cells"
    # The healthy configuration still ran; the 40,000-token cell exceeds the server's context: refused unmeasured.
    assert (workdir / CELL).exists()
    assert not (cells / "prefix_cache" / "decode" / "ctx40000_c1.parquet").exists()
    assert not list(cells.glob("broken/**/*.parquet"))
    logs = [(workdir / f"results/logs/cells/broken/decode/ctx{c}_c1.log").read_text() for c in (256, 40000)]
    for log in logs:  # whichever cell ran first started the server; the other did not retry
        assert "exited during start-up" in log
        assert "unrecognized arguments: --no-such-flag" in log  # the server log's tail
        assert "results/servers/broken/logs/" in log
    assert sum("failed earlier in this run, not retried" in log for log in logs) == 1
    seconds = max(float(m[1]) for log in logs if (m := re.search(r"after ([\d.]+) s\)", log)))
    assert seconds < 60  # vLLM parses its arguments after importing torch: about 10 s here
    too_long_log = (workdir / "results/logs/cells/prefix_cache/decode/ctx40000_c1.log").read_text()
    assert re.search(
        r"workloads\.decode\.contexts: at context 40000 a request holds about 40016 tokens, more than "
        r"the 32768 the running server accepts",
        too_long_log,
    )
    # The run's last lines (the Snakefile's onerror): each configuration with cells left, and why.
    closing = result.stdout + result.stderr
    assert "broken: 2 of 2 cells not measured; its server failed to start: the server for configuration" in closing
    assert re.search(
        r"prefix_cache: 1 of 2 cells not measured; cell prefix_cache/decode/ctx40000_c1: workloads\.decode\.contexts: "
        r"at context 40000",
        closing,
    )
    assert half_written(workdir) == []
    assert wait_no_survivors(workdir, 30) == []
    matrix.record("server-fails-to-start", seconds, "vLLM's own exit")
    refused_s = log_seconds(too_long_log, " ERROR ")
    matrix.record("context-over-server-limit", refused_s, "in the cell job's log; no request")
    # The next run with the broken configuration fixed and the context shortened completes the grid.
    raw["configurations"]["broken"]["args"] = []
    raw["workloads"]["decode"]["contexts"] = [256]
    write_yaml(workdir / "fault.yaml", raw)
    rerun_completes(workdir, [CELL, "results/cells/broken/decode/ctx256_c1.parquet"])
