"""Shared fixtures: configs, a loopback calibration server, a sandboxed server state."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import REPO, free_port_range
from servegrid.serving import server
from servegrid.testing.calibration import RunningServer, Script

# The time budget every run prints at its end (time per folder, the slowest tests and what they spent it on).
pytest_plugins = ["helpers.budget"]


# Folders and markers whose tests keep the machine to themselves: a real server on core 0 and the client on core 1,
# Snakemake runs, process faults with deadlines. make test runs them apart, after the rest ran on both cores.
EXCLUSIVE_FOLDERS = ("faults", "integration", "slurm")
EXCLUSIVE_MARKERS = ("vllm", "pipeline", "slurm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.path)).relative_to(REPO / "tests").parts[0]
        if folder in EXCLUSIVE_FOLDERS or any(item.get_closest_marker(m) for m in EXCLUSIVE_MARKERS):
            item.add_marker(pytest.mark.exclusive)


@pytest.fixture(scope="session", autouse=True)
def host_claims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite's own directory of host-wide port and GPU claims (servegrid.serving.hostlocks): apart from any
    real pipeline on this machine; inherited by every Snakemake and server the tests start."""
    path = tmp_path_factory.mktemp("host-claims")
    path.chmod(0o700)  # servegrid uses only a claims directory that is this user's alone
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
