"""Shared fixtures: configs, a loopback calibration server, a sandboxed server state."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import REPO, free_port_range
from servegrid.serving import server
from servegrid.testing.calibration import RunningServer, Script

# The time budget every run prints at its end (time per folder, the slowest tests and what they spent it on), and the
# fault matrix the fault tests measure (both plugins, so that xdist's controller loads them too).
pytest_plugins = ["helpers.budget", "helpers.fault_matrix"]


# make test runs the suite in three sessions (Makefile):
# - the rest (unit tests without servers or Snakemake runs): on both cores, any test anywhere;
# - "heavy": real vLLM, LiteLLM or Slurm, Snakemake runs, process faults. Two at a time (pytest-xdist, --dist
#   loadgroup), each worker's servers on a core of their own (helpers.worker_cores); tests that share a module's or
#   the session's fixture (one vLLM server, one Slurm cluster, one working copy a chain of faults runs in) stay
#   together on one worker, the longest groups first, so that both workers end about together;
# - "exclusive": the tests that time the client or hold processes to tight deadlines keep the machine to themselves.
HEAVY_FOLDERS = ("faults", "integration", "slurm")
HEAVY_MARKERS = ("vllm", "pipeline", "slurm")
# Fixtures of a wider scope that are cheap, or one per process by design: they do not bind tests together.
UNBINDING_FIXTURES = {"host_claims", "matrix", "tmp_path_factory", "testrun_uid", "worker_id"}


# First: -m reads the heavy marker this adds, and xdist's loadgroup the groups.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heavy = []
    for item in items:
        folder = Path(str(item.path)).relative_to(REPO / "tests").parts[0]
        if item.get_closest_marker("exclusive"):
            continue
        if folder in HEAVY_FOLDERS or any(item.get_closest_marker(m) for m in HEAVY_MARKERS):
            item.add_marker(pytest.mark.heavy)
            heavy.append(item)
    group_of = _groups_sharing_fixtures(heavy)
    members = Counter(group_of.values())
    cost: dict[str, int] = defaultdict(int)
    for item in heavy:
        group = group_of[id(item)]
        cost[group] += _cost(item)
        if members[group] > 1:  # a test alone needs no group: loadgroup schedules it on its own
            item.add_marker(pytest.mark.xdist_group(group))
            _tag_for_loadgroup(config, item, group)
    # Longest groups first (xdist hands groups out in collection order with --no-loadscope-reorder); the order within
    # a group is kept, and only the heavy tests move: a stable sort of the whole list.
    items.sort(key=lambda item: -cost[group_of[id(item)]] if id(item) in group_of else 0)


def _tag_for_loadgroup(config: pytest.Config, item: pytest.Item, group: str) -> None:
    """What pytest-xdist 3.8 does for an xdist_group marker, done so that pytest 9.2 sees it. xdist appends "@<group>"
    to the test's ``_nodeid``, which pytest 9.2's structured node ids no longer read (pytest-dev/pytest-xdist#1386; the
    proposed fix, #1388, sets the structured id as here): without it every test is scheduled alone, and a module's
    fixture (a vLLM server, a Slurm cluster, a chain of faults) is set up on both workers, its tests split."""
    if not getattr(config.option, "loadgroup", False) or "@" in item.nodeid:
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before 9.2: xdist's own suffix works
        return
    item._id = NodeId.parse(f"{item.nodeid}@{group}")  # type: ignore[attr-defined]


def _cost(item: pytest.Item) -> int:
    """A rough weight (the budget table of docs/testing.md): Slurm jobs serving vLLM, then Snakemake runs on real
    vLLM (each its own server starts), outweigh tests that share the session's server or use stand-ins."""
    if item.get_closest_marker("slurm"):
        return 10
    return 3 if item.get_closest_marker("pipeline") and item.get_closest_marker("vllm") else 1


def _groups_sharing_fixtures(items: list[pytest.Item]) -> dict[int, str]:
    """id(item) → group: tests that use one instance of a module- or session-scoped fixture (directly or through
    another) share a group (union-find); any other test is a group of its own."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    for item in items:
        fixtures = item._fixtureinfo.name2fixturedefs  # type: ignore[attr-defined]
        for name in item.fixturenames:
            definitions = fixtures.get(name)
            if not definitions or name in UNBINDING_FIXTURES:
                continue
            scope = definitions[-1].scope
            if scope == "session":
                parent[find(item.nodeid)] = find(f"session:{name}")
            elif scope in ("module", "package"):
                parent[find(item.nodeid)] = find(f"{scope}:{Path(str(item.path)).relative_to(REPO)}:{name}")
    return {id(item): find(item.nodeid) for item in items}


@pytest.fixture(scope="session", autouse=True)
def host_claims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite's own directory of host-wide port and GPU claims (servegrid.serving.hostlocks): apart from any
    real pipeline on this machine; inherited by every Snakemake and server the tests start."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder every xdist worker's own lies in: the claims are host-wide, one for all workers
    path = root / "host-claims"
    path.mkdir(mode=0o700, exist_ok=True)  # servegrid uses only a claims directory that is this user's alone
    previous = os.environ.get("SERVEGRID_LOCK_DIR")
    os.environ["SERVEGRID_LOCK_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("SERVEGRID_LOCK_DIR", None)
    else:
        os.environ["SERVEGRID_LOCK_DIR"] = previous


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def demo_raw() -> dict[str, Any]:
    return yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())


@pytest.fixture
def seed_raw() -> dict[str, Any]:
    return yaml.safe_load((REPO / "config.yaml").read_text())


class CalibrationThread:
    """A calibration server on its own event loop in a background thread (vLLM's dialect unless told)."""

    def __init__(self, script: Script, **server_options: Any) -> None:
        self.running = RunningServer(script, **server_options)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> CalibrationThread:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self.running.start(), self.loop).result(10)
        return self

    @property
    def counters(self):  # type: ignore[no-untyped-def]
        return self.running.server.counters

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def calibration():  # type: ignore[no-untyped-def]
    """Factory: ``with calibration(Script(...), dialect=...) as srv: srv.url``."""
    return CalibrationThread


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[server.Runtime]:
    """Run in a temporary directory with its own server state; stop whatever a test left up."""
    monkeypatch.chdir(tmp_path)
    runtime = server.Runtime(
        port_range=free_port_range(),
        startup_timeout_s=20,
        shutdown_timeout_s=3,
        state_dir=str(tmp_path / "state"),
    )
    yield runtime
    server.stop_all(runtime, reason="test teardown")
