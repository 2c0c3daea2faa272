"""The suite's time budget, printed at the end of every run: the time of each test folder, and the ten slowest
tests with what each spent its time on (server starts in the test's own process, Snakemake runs it started,
sleeps of its main thread).

Counting happens where the test runs (an xdist worker, or the one process) and travels to the process that
prints, on the test's report (``user_properties``). ``make test`` runs the suite in three sessions
(tests/conftest.py: the unit tests on both cores, the heavy tests two at a time, then the tests that keep the
machine to themselves): the first writes its rows to ``results/test-budget.json`` (``--budget-out``), the next ones
read them (``--budget-in``; the middle one writes them back with its own added) and the last prints one table for
all.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest


@dataclass
class Spent:
    """What one test spent its time on, as far as its own process can see."""

    starts: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    snakemake: list[float] = field(default_factory=list)
    sleep_s: float = 0.0
    starting: bool = False

    def describe(self) -> str:
        parts = [f"{len(s)} {kind} start(s) {sum(s):.0f} s" for kind, s in sorted(self.starts.items())]
        if self.snakemake:
            parts.append(f"{len(self.snakemake)} Snakemake run(s) {sum(self.snakemake):.0f} s")
        if self.sleep_s >= 0.5:
            parts.append(f"sleeps {self.sleep_s:.0f} s")
        return "; ".join(parts) or "-"

    def as_json(self) -> dict[str, Any]:
        return {"starts": dict(self.starts), "snakemake": self.snakemake, "sleep_s": self.sleep_s}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Spent:
        spent = cls(snakemake=list(raw["snakemake"]), sleep_s=float(raw["sleep_s"]))
        for kind, seconds in raw["starts"].items():
            spent.starts[kind] = list(seconds)
        return spent


CURRENT = Spent()


def _instrument() -> None:
    """Wrap, once per process, what the budget counts: server starts (servegrid's wait for health), Snakemake
    subprocesses (from their start to the end of their wait) and the main thread's sleeps."""
    from servegrid.serving import launch, server

    original_wait = launch.wait_healthy

    def timed_wait(waited_for: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        CURRENT.starting = True  # its polls are the start's time, not sleeps of the test's
        try:
            return original_wait(waited_for, *args, **kwargs)
        finally:
            CURRENT.starting = False
            log_path = kwargs.get("log_path", args[4] if len(args) > 4 else None)
            CURRENT.starts[_server_kind(Path(log_path)) if log_path else "server"].append(time.monotonic() - started)

    launch.wait_healthy = timed_wait
    server.wait_healthy = timed_wait  # server.py holds its own name for it

    original_init, original_wait_proc = subprocess.Popen.__init__, subprocess.Popen.wait

    def init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:  # type: ignore[type-arg]
        argv = args[0] if args else kwargs.get("args", ())
        words = [argv] if isinstance(argv, str | bytes) else list(argv)
        self._budget_started = time.monotonic() if any("snakemake" in str(w) for w in words) else None
        original_init(self, *args, **kwargs)

    def wait(self: subprocess.Popen, *args: Any, **kwargs: Any) -> int:  # type: ignore[type-arg]
        code = original_wait_proc(self, *args, **kwargs)
        started = getattr(self, "_budget_started", None)
        if started is not None:
            CURRENT.snakemake.append(time.monotonic() - started)
            self._budget_started = None
        return code

    subprocess.Popen.__init__ = init  # type: ignore[method-assign]
    subprocess.Popen.wait = wait  # type: ignore[method-assign]

    original_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread() and not CURRENT.starting:
            CURRENT.sleep_s += seconds
        original_sleep(seconds)

    time.sleep = sleep


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("budget")
    group.addoption("--budget-out", default=None, help="write this session's budget rows to FILE (JSON)")
    group.addoption("--budget-in", default=None, help="add the budget rows an earlier session wrote to FILE")


def pytest_configure(config: pytest.Config) -> None:
    _instrument()
    config.pluginmanager.register(Budget(config), "servegrid-budget")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    global CURRENT
    CURRENT = Spent()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]):  # type: ignore[no-untyped-def]
    outcome = yield
    if call.when == "teardown":
        outcome.get_result().user_properties.append(("budget", json.dumps(CURRENT.as_json())))


class Budget:
    """Collects every test's phases and what they spent, where the terminal summary is printed."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.rows: dict[str, dict[str, Any]] = {}  # nodeid → seconds, spent
        self.sessions: list[float] = []  # wall seconds of earlier sessions (--budget-in)
        self.earlier_starts: dict[str, int] = {}  # server starts of earlier sessions (--budget-in)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid.split("@")[0]  # xdist's loadgroup adds "@<group>" to every grouped test's id
        row = self.rows.setdefault(nodeid, {"seconds": 0.0, "spent": Spent()})
        row["seconds"] += report.duration
        for name, value in report.user_properties:
            if name == "budget":
                row["spent"] = Spent.from_json(json.loads(value))

    def _all_rows(self) -> dict[str, dict[str, Any]]:
        rows = dict(self.rows)
        path = self.config.getoption("--budget-in")
        if path and Path(path).exists():
            earlier = json.loads(Path(path).read_text(encoding="utf-8"))
            self.sessions = list(earlier["sessions"])
            self.earlier_starts = dict(earlier.get("starts", {}))
            for nodeid, row in earlier["rows"].items():
                rows.setdefault(nodeid, {"seconds": row["seconds"], "spent": Spent.from_json(row["spent"])})
        return rows

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(self.config, "workerinput"):  # an xdist worker: its controller prints
            return
        wall = time.monotonic() - self.started
        rows = self._all_rows()
        starts = defaultdict(int, self.earlier_starts)
        for kind, count in _server_starts(self.config).items():
            starts[kind] += count
        out = self.config.getoption("--budget-out")
        if out:  # may be --budget-in's file: make test's middle session adds its rows to the first one's
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            serial = {k: {"seconds": r["seconds"], "spent": r["spent"].as_json()} for k, r in rows.items()}
            written = {"sessions": [*self.sessions, wall], "rows": serial, "starts": dict(starts)}
            Path(out).write_text(json.dumps(written), encoding="utf-8")
        if not rows:
            return
        folders: dict[str, list[float]] = defaultdict(list)
        for nodeid, row in rows.items():
            parts = nodeid.split("::")[0].split("/")
            folders[parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]].append(row["seconds"])
        write = terminalreporter.write_line
        terminalreporter.write_sep("=", "time budget (tests/helpers/budget.py)")
        write(f"{'folder':<14}{'tests':>7}{'test time':>12}")
        for folder, seconds in sorted(folders.items(), key=lambda item: -sum(item[1])):
            write(f"{folder:<14}{len(seconds):>7}{_minutes(sum(seconds)):>12}")
        sessions = [*self.sessions, wall]
        write(
            f"{'wall clock':<14}{'':>7}{_minutes(sum(sessions)):>12}   "
            f"({' + '.join(_minutes(s) for s in sessions)}; test time adds up both cores' work)"
        )
        if starts:
            write(
                "server starts, by the logs they left: "
                + ", ".join(f"{kind} {n}" for kind, n in sorted(starts.items()))
            )
        write("ten slowest tests (setup + call + teardown), and what they spent it on:")
        for nodeid, row in sorted(rows.items(), key=lambda item: -item[1]["seconds"])[:10]:
            write(f"  {row['seconds']:6.1f} s  {nodeid}")
            write(f"            {row['spent'].describe()}")


def _server_starts(config: pytest.Config) -> dict[str, int]:
    """Every server or gateway start of the session, in the test's process or in a Snakemake it ran: each leaves a
    log under results/servers/<name>/logs/ in its test's temporary folder (servegrid.paths.server_log_dir)."""
    try:
        root = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return {}
    # Under xdist the controller's basetemp is the folder its workers' own lie in (popen-gw0, popen-gw1): counted too.
    counts: dict[str, int] = defaultdict(int)
    for log in root.rglob("servers/*/logs/*.log"):
        if log.name.endswith(".supervisor.log"):
            continue
        counts[_server_kind(log)] += 1
    return dict(counts)


def _server_kind(log: Path) -> str:
    """What a server log is of: vLLM's API server names its own module in its first lines (the calibration server and
    the tests' stand-ins may speak vLLM's dialect, but never run it)."""
    try:
        with log.open("rb") as head:
            text = head.read(20_000).decode(errors="replace").lower()
    except OSError:
        return "server"
    if "litellm" in text:
        return "LiteLLM"
    return "vLLM" if "vllm/entrypoints" in text or "vllm.entrypoints" in text else "calibration or stand-in"


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
