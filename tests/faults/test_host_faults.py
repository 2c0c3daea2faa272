"""The host's faults, provoked for real through Snakemake on a calibration grid (see helpers.faults).

Covered: a port of ``port_range`` taken by another program, two pipelines on one host with the same
``port_range``, server records left from before a reboot whose pids are now a stranger's, a full disk while a
cell file is written (``RLIMIT_FSIZE``), a damaged cell file, and Ctrl-C during ``aggregate`` and during the
report. Each test makes the four checks of the fault matrix: (1) the time to a clear error that names what
went wrong, (2) nothing on disk that looks complete and is not, (3) no process left running, (4) the next run
(the same Snakemake command, the fault removed) completes the grid. The ``aggregate`` target (the Parquet
tables) stands in for the whole pipeline wherever the report is not the subject: it costs seconds, the report
many.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import pyarrow.parquet as pq
import pytest

from helpers import copy_workflow, write_yaml
from helpers.faults import calibration_config, half_written, kill_survivors, wait_for, wait_no_survivors
from servegrid import paths
from servegrid.config import Experiment
from servegrid.records import cell_file
from servegrid.serving import procs, state

pytestmark = pytest.mark.pipeline

CONFIG = "x.yaml"
TABLES = [
    paths.REQUESTS_TABLE,
    paths.SUMMARY_TABLE,
    paths.SERVERS_TABLE,
    paths.COMPARISONS_TABLE,
    paths.VERDICT_TABLE,
    paths.CROSSOVERS_TABLE,
]


# ---- running Snakemake ------------------------------------------------------------------------------


def snakemake_argv(target: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--cores", "1", target, "--configfile", CONFIG]


def run_snakemake(workdir: Path, target: str = "aggregate", **popen: Any) -> tuple[subprocess.CompletedProcess, float]:
    """Snakemake to ``target`` in ``workdir``; the finished process and its wall time."""
    started = time.monotonic()
    result = subprocess.run(snakemake_argv(target), cwd=workdir, capture_output=True, text=True, timeout=600, **popen)
    return result, time.monotonic() - started


def said(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def tail(text: str, chars: int = 4000) -> str:
    return text[-chars:]


def new_pipeline(path: Path, **operations: Any) -> Path:
    """A fresh copy of the workflow with the calibration grid in ``x.yaml``."""
    workdir = copy_workflow(path)
    config = calibration_config()
    config["operations"].update(operations)
    write_yaml(workdir / CONFIG, config)
    return workdir


def config_of(workdir: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load((workdir / CONFIG).read_text())


def grid_cells(workdir: Path) -> list[Path]:
    return [workdir / cell.path for cell in Experiment.from_file(workdir / CONFIG).cells()]


def report_files(workdir: Path) -> list[Path]:
    return [
        workdir / paths.REPORT_PATTERN.format(lang=lang, ext=ext)
        for lang in Experiment.from_file(workdir / CONFIG).languages
        for ext in ("html", "pdf")
    ]


def sessions_of(workdir: Path) -> set[str]:
    """The server sessions this pipeline launched: one log each."""
    logs = workdir / paths.server_log_dir("only")
    return {p.name.removesuffix(".log") for p in logs.glob("*.log") if not p.name.endswith(".supervisor.log")}


def records_of(workdir: Path) -> dict[str, Any]:
    """The server record the pipeline's last server left (its supervisor writes it)."""
    return json.loads((state.host_directory(workdir / paths.STATE_DIR) / "only.json").read_text())


def cell_server(cell: Path) -> dict[str, Any]:
    return cell_file.read_cell(cell)[1].server


def assert_grid_complete(workdir: Path, report: bool = False) -> None:
    """Every cell and table exists and reads back (and the report, if asked)."""
    for cell in grid_cells(workdir):
        cell_file.read_cell(cell)  # checksums verified
    for table in TABLES:
        pq.read_table(workdir / table)
    if report:
        for path in report_files(workdir):
            assert path.stat().st_size > 1000, path


def assert_clean(workdir: Path) -> None:
    """Checks (2) and (3): no half-written file, no process left."""
    assert half_written(workdir) == []
    assert wait_no_survivors(workdir, 30) == []


def assert_rerun_completes(workdir: Path, target: str = "aggregate") -> subprocess.CompletedProcess:
    """Check (4): the same command, the fault removed, exits 0 and completes the grid."""
    result, _ = run_snakemake(workdir, target)
    assert result.returncode == 0, tail(said(result))
    assert_grid_complete(workdir, report=target == "report")
    assert_clean(workdir)
    return result


def cells_run(result: subprocess.CompletedProcess) -> list[str]:
    """The cell files the jobs of a Snakemake run wrote, from its job listing."""
    return re.findall(r"rule cell:\n(?:\s+input: .*\n)?\s+output: (\S+)", said(result))


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def completed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One completed calibration grid, through the tables, for the tests that start from one."""
    workdir = new_pipeline(tmp_path_factory.mktemp("completed") / "wf")
    result, _ = run_snakemake(workdir)
    assert result.returncode == 0, tail(said(result))
    assert_grid_complete(workdir)
    assert wait_no_survivors(workdir, 30) == []
    yield workdir
    kill_survivors(workdir)


@pytest.fixture
def done(completed: Path, tmp_path: Path) -> Iterator[Path]:
    """A copy of the completed grid, the test's own (mtimes kept, so Snakemake sees it up to date)."""
    workdir = tmp_path / "wf"
    shutil.copytree(completed, workdir, symlinks=True)
    yield workdir
    kill_survivors(workdir)


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen]:
    """A process that is no servegrid's: its own process group, no server session in its environment."""
    env = {k: v for k, v in os.environ.items() if k != procs.SESSION_ENV}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True, env=env)
    yield proc
    proc.kill()
    proc.wait()


# ---- the tests -------------------------------------------------------------------------------------


def test_port_taken(workdir: Path, matrix):  # type: ignore[no-untyped-def]
    config = calibration_config()
    write_yaml(workdir / CONFIG, config)
    taken = config["operations"]["port_range"][0]
    with socket.socket() as squatter:  # a program that holds the port and is not a server at all
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        result, _ = run_snakemake(workdir)
        assert result.returncode == 0, tail(said(result))
        assert_grid_complete(workdir)
        ports = {urlparse(cell_server(cell)["url"]).port for cell in grid_cells(workdir)}
        assert taken not in ports
        low, high = config["operations"]["port_range"]
        assert all(low < port <= high for port in ports), ports
    assert_clean(workdir)
    rerun = assert_rerun_completes(workdir)
    assert "Nothing to be done" in said(rerun)
    matrix.record("port-taken", None, f"the server took port {min(ports)}, {taken} being taken")


def test_two_pipelines(tmp_path: Path, matrix):  # type: ignore[no-untyped-def]
    first = new_pipeline(tmp_path / "a")
    second = copy_workflow(tmp_path / "b")
    write_yaml(second / CONFIG, {**calibration_config(), "operations": config_of(first)["operations"]})
    assert config_of(second)["operations"]["port_range"] == config_of(first)["operations"]["port_range"]
    try:
        running = []
        for workdir in (first, second):  # both claims come from the suite's SERVEGRID_LOCK_DIR
            with open(workdir.parent / f"{workdir.name}.out", "wb") as out:
                proc = subprocess.Popen(snakemake_argv("aggregate"), cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
            running.append(proc)
        for proc, workdir in zip(running, (first, second), strict=True):
            assert proc.wait(600) == 0, tail((workdir.parent / f"{workdir.name}.out").read_text())
    finally:
        for workdir in (first, second):
            kill_survivors(workdir)
    served = {}
    for workdir in (first, second):
        assert_grid_complete(workdir)
        own = sessions_of(workdir)
        servers = [cell_server(cell) for cell in grid_cells(workdir)]
        # Each cell was measured on a server its own pipeline launched, never on the other's.
        assert {s["session"] for s in servers} <= own, (servers, own)
        served[workdir] = (own, {urlparse(s["url"]).port for s in servers})
        assert_clean(workdir)
    (sessions_a, ports_a), (sessions_b, ports_b) = served.values()
    assert not sessions_a & sessions_b
    assert not ports_a & ports_b, "both pipelines' servers on one port"
    # The two servers were up at the same time: otherwise one port for both would be no fault at all.
    lives = [records_of(w) for w in (first, second)]
    assert lives[0]["launched_at"] < lives[1]["ended_at"] and lives[1]["launched_at"] < lives[0]["ended_at"], lives
    for workdir in (first, second):
        assert "Nothing to be done" in said(assert_rerun_completes(workdir))
    matrix.record("two-pipelines", None, f"both servers up at once, on ports {min(ports_a)} and {min(ports_b)}")


def test_proxy_variables_do_not_reach_control_calls(workdir: Path, matrix):  # type: ignore[no-untyped-def]
    """A cluster that sets http_proxy for downloads and no no_proxy: through the proxy, a healthy server on
    127.0.0.1 would never answer its health check, and start-up would wait out startup_timeout_s."""
    config = calibration_config()
    config["operations"]["startup_timeout_s"] = 20  # the calibration server is healthy in about a second
    write_yaml(workdir / CONFIG, config)
    with socket.socket() as dead:  # a port nothing listens on: a proxy that refuses every connection
        dead.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env |= {
        name: proxy for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
    }
    result, took = run_snakemake(workdir, env=env)
    assert result.returncode == 0, tail(said(result))
    assert "did not become healthy" not in said(result)
    assert_grid_complete(workdir)
    assert_clean(workdir)
    rerun = assert_rerun_completes(workdir)
    assert "Nothing to be done" in said(rerun)
    matrix.record("proxy-variables", None, f"the grid measured in {took:.1f} s, the proxy never asked")


def test_stale_records(done: Path, stranger: subprocess.Popen, matrix):  # type: ignore[no-untyped-def]
    workdir = done
    record_path = state.host_directory(workdir / paths.STATE_DIR) / "only.json"
    stale = json.loads(record_path.read_text())  # the record the completed run left (server stopped)
    assert stale["status"] == "stopped"
    # After a reboot the recorded pids are someone else's: here, a live stranger (same pid, same start time).
    them = procs.ProcessRef.of(stranger.pid).to_dict()
    stale.update(pgid=stranger.pid, server=them, supervisor=them, status="running", returncode=None)
    stale.update(ended_at=None, end_reason=None)
    record_path.write_text(json.dumps(stale, indent=2))
    started = time.monotonic()
    down = subprocess.run(
        [sys.executable, "-m", "servegrid.pipeline.cli", "--config", CONFIG, "server", "down", "--all"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert down.returncode == 0, down.stdout + down.stderr
    assert stranger.poll() is None, f"`servegrid server down --all` killed a process that is not servegrid's:\n{down}"
    outcomes = json.loads(down.stdout)
    assert [o["session"] for o in outcomes] == [stale["session"]]  # it says which record it handled...
    assert not outcomes[0]["was_running"], outcomes  # ...and does not claim a server of that session ran
    assert outcomes[0]["left_running"] == []
    # The next run must start a server despite the stale record: one of its cells is missing (and the tables
    # made from it, or the aggregate target would not ask for the cell again).
    grid_cells(workdir)[-1].unlink()
    for table in TABLES:
        (workdir / table).unlink()
    rerun = assert_rerun_completes(workdir)
    assert cells_run(rerun) == [str(grid_cells(workdir)[-1].relative_to(workdir))]
    assert len(sessions_of(workdir)) == 2  # a new server, beside the stopped one's log
    assert stranger.poll() is None, "the next run killed a process that is not servegrid's"
    matrix.record("stale-records", None, f"`down --all` {took:.1f} s, the stranger left running")


def test_disk_full(workdir: Path, matrix):  # type: ignore[no-untyped-def]
    write_yaml(workdir / CONFIG, calibration_config())
    # A cell file of this grid is about 18 kB; every log, spec, record and Snakemake's own files stay
    # under 14 kB (the calibration server's log, under the same limit, stays empty). Snakemake copies each
    # rule file into its source cache at parse time, so a rule file above the limit fails the run before
    # any cell (common.smk passing 10 kB did, in the CI of 2026-12-07).
    limit = 14_000
    sources = [workdir / "Snakefile", *(workdir / "workflow" / "rules").glob("*.smk")]
    too_large = [f"{p.name}: {p.stat().st_size} B" for p in sources if p.stat().st_size >= limit]
    assert not too_large, f"rule files at or above this test's file-size limit of {limit} B: {too_large}"
    result, took = run_snakemake(workdir, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    output = said(result)
    assert result.returncode != 0, tail(output)
    assert "Error in rule cell" in output, tail(output)
    failed = re.search(r"Error in rule cell:.*?output: (\S+)\n\s+log: (\S+)", output, re.DOTALL)
    assert failed, tail(output)
    cell, log = failed.groups()
    assert not (workdir / cell).exists()
    assert not list((workdir / "results").rglob("*.parquet"))
    assert_clean(workdir)
    text = (workdir / log).read_text()  # before the rerun writes it again
    assert_rerun_completes(workdir)
    # The cell's log, where Snakemake says to look, names the file and the error.
    assert "File too large" in text and cell in text, (text, tail(output))
    matrix.record("disk-full", took, "whole run: server start, one cell measured, its write refused")


def flip_in_a_data_page(cell: Path) -> None:
    """Damage the file where only a page checksum can tell: 16 bytes of the largest column chunk's last page."""
    meta = pq.ParquetFile(cell).metadata.row_group(0)
    chunk = max((meta.column(i) for i in range(meta.num_columns)), key=lambda c: c.total_compressed_size)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    end = start + chunk.total_compressed_size
    assert end - chunk.data_page_offset > 64  # the last page's payload is long enough to hit
    data = bytearray(cell.read_bytes())
    size = len(data)
    for i in range(end - 20, end - 4):
        data[i] ^= 0xFF
    cell.write_bytes(data)
    assert cell.stat().st_size == size


def test_corrupt_cell(done: Path, matrix):  # type: ignore[no-untyped-def]
    workdir = done
    damaged, intact = grid_cells(workdir)
    intact_mtime = intact.stat().st_mtime_ns
    sessions_before = sessions_of(workdir)
    flip_in_a_data_page(damaged)
    for table in TABLES:
        (workdir / table).unlink()
    result, took = run_snakemake(workdir)
    output = said(result)
    assert result.returncode != 0, tail(output)
    # Failing at once means at aggregation, before any work: no cell measured, no server started. (A wall-clock
    # limit here measured CI's load instead: 32 s on two loaded cores, stop 49's CI.)
    assert cells_run(result) == [], tail(output)
    assert sessions_of(workdir) == sessions_before, tail(output)
    name = str(damaged.relative_to(workdir))
    log = (workdir / "results" / "logs" / "aggregate.log").read_text()
    for text in (output, log):
        assert name in text and "checksum" in text, tail(text)
    kept = list(damaged.parent.glob(f"{damaged.name}.damaged-*"))
    assert len(kept) == 1 and not damaged.exists(), kept
    assert f"kept as {kept[0].relative_to(workdir)}" in log
    assert not [t for t in TABLES if (workdir / t).exists()]
    assert_clean(workdir)
    rerun = assert_rerun_completes(workdir)
    assert cells_run(rerun) == [name]  # that cell, and only that one, measured again
    assert intact.stat().st_mtime_ns == intact_mtime
    matrix.record("corrupt-cell", took, "`snakemake aggregate`, start to failure")


def job_running(proc: subprocess.Popen, script: str) -> bool:
    """Whether a process of Snakemake's runs the job's script (Snakemake copies it to .snakemake/scripts)."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return False
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            if any(arg.endswith(f".{script}") for arg in child.cmdline()):
                return True
    return False


def interrupt(workdir: Path, target: str, job: str, script: str, out: Path) -> tuple[int, float, str]:
    """Start Snakemake to ``target`` as from a terminal; Ctrl-C it once the job ``job`` has started and its
    process runs ``script``. Its exit code, the seconds from the signal to its exit, and its output.

    Not at the job's announcement alone: a Ctrl-C between Snakemake's ``rule …:`` line and the start of the
    job's process reaches no job, and Snakemake then lets the job run to its end before it exits."""
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            snakemake_argv(target),
            cwd=workdir,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # As in a terminal: a test runner started in the background inherits SIGINT ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        started = wait_for(
            lambda: f"rule {job}:" in out.read_text(errors="replace") and job_running(proc, script), 300, step_s=0.02
        )
        assert started, tail(out.read_text(errors="replace"))
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
        signalled = time.monotonic()
        returncode = proc.wait(60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return returncode, took, out.read_text(errors="replace")


def test_ctrl_c_aggregate(done: Path, tmp_path: Path, matrix):  # type: ignore[no-untyped-def]
    workdir = done
    for table in TABLES:
        (workdir / table).unlink()
    returncode, took, output = interrupt(workdir, "aggregate", "aggregate", "aggregate.py", tmp_path / "out")
    assert returncode != 0, tail(output)
    assert took < 30, took
    assert_clean(workdir)  # everything stopped first: a job that ran on would write its tables
    # The job was hit: had it finished before the signal (or run on after it), its tables would exist.
    assert not [t for t in TABLES if (workdir / t).exists()], tail(output)
    assert_rerun_completes(workdir)
    matrix.record("ctrl-c-aggregate", took, "Ctrl-C to Snakemake's exit")


def test_ctrl_c_report(done: Path, tmp_path: Path, matrix):  # type: ignore[no-untyped-def]
    workdir = done
    returncode, took, output = interrupt(workdir, "report", "report_pdf", "render_report.py", tmp_path / "out")
    assert returncode != 0, tail(output)
    assert took < 30, took
    assert_clean(workdir)  # everything stopped first: a job that ran on would write its report
    # The job was hit: had it finished before the signal (or run on after it), every PDF would exist (the HTML
    # pages, jobs of their own, may have been built before it).
    assert not all(p.exists() for p in report_files(workdir) if p.suffix == ".pdf"), tail(output)
    assert_rerun_completes(workdir, "report")
    matrix.record("ctrl-c-report", took, "Ctrl-C to Snakemake's exit")
