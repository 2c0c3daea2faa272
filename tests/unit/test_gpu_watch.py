"""The server's GPUs watched during a cell (issue 42, item 10): which cards, their SM clock, why their clocks were
held back, and another program's process on them (the cell is then invalid). NVML is stood in for by a module of
pynvml's names (no GPU on this machine); what is checked is servegrid's reading of it, and that without NVML every
figure says it was not measured. Which NVML calls exist was checked against nvidia-ml-py 13.615.71."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types
from collections.abc import Iterator

import pandas as pd
import pytest

from helpers import synthetic_cell_of, with_changes
from servegrid.analysis import aggregation
from servegrid.config import Experiment
from servegrid.measuring import gpu_watch
from servegrid.paths import RunTables

POWER_CAP, THERMAL, IDLE = 0x4, 0x40, 0x1


class FakeNvmlError(Exception):
    pass


def fake_nvml(
    processes: dict[int, list[int]], reasons: int, clocks: Iterator[int], energy_mj: Iterator[int] | None = None
) -> types.ModuleType:
    """pynvml's names for two H100s: ``processes`` by GPU index, the clock reasons' bits, SM clocks in turn, and the
    energy counters' readings in turn (millijoules; None: "Not Supported", as before Volta)."""
    nvml = types.ModuleType("pynvml")

    def energy(handle: int) -> int:
        if energy_mj is None:
            raise FakeNvmlError("Not Supported")
        return next(energy_mj)

    nvml.nvmlDeviceGetTotalEnergyConsumption = energy  # type: ignore[attr-defined]
    nvml.NVMLError = FakeNvmlError  # type: ignore[attr-defined]
    nvml.NVML_CLOCK_SM = 1  # type: ignore[attr-defined]
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUUID = lambda h: f"GPU-{h:04d}"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: next(clocks)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda h: reasons  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        types.SimpleNamespace(pid=p, usedGpuMemory=1) for p in processes.get(h, [])
    ]
    for name, bit in (
        ("SwPowerCap", POWER_CAP),
        ("HwSlowdown", 0x8),
        ("SwThermalSlowdown", 0x20),
        ("HwThermalSlowdown", THERMAL),
        ("HwPowerBrakeSlowdown", 0x80),
        ("GpuIdle", IDLE),
    ):
        setattr(nvml, f"nvmlClocksEventReason{name}", bit)
    return nvml


@pytest.fixture
def one_cell(demo_raw, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """(experiment, its one decode cell, one H100 as NVML names it), working in tmp_path."""
    monkeypatch.chdir(tmp_path)
    raw = with_changes(demo_raw)
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    raw["workloads"] = {"decode": {**raw["workloads"]["decode"], "concurrency": [1]}}
    experiment = Experiment(raw)
    (cell,) = experiment.cells()
    return experiment, cell, {"index": 0, "uuid": "GPU-0000", "name": "NVIDIA H100 80GB HBM3", "sm_clock_max_mhz": 1980}


@pytest.fixture
def stranger() -> Iterator[int]:
    """Another program of this host (its pid is alive here)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process.pid
    process.kill()
    process.wait()


def test_a_cells_gpus_say_their_clocks_why_they_were_held_back_and_who_else_was_there(monkeypatch, stranger):
    server_pid, gone = 4_000_000, 4_000_001  # gone: a pid NVML reports from outside this host's process table
    processes = {0: [server_pid], 1: [server_pid, stranger, gone]}
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(processes, POWER_CAP | IDLE, iter([1980, 1410, 1755, 1980])))
    watch = gpu_watch.GpuWatch([0, 1], ours={server_pid}, interval_s=0.01)
    watch.sample()
    watch.sample()
    found = watch.summary()
    assert found["measured"] and found["samples"] == 2
    assert [d["uuid"] for d in found["devices"]] == ["GPU-0000", "GPU-0001"]
    assert found["sm_clock_mhz_min"] == 1410 and found["sm_clock_mhz_mean"] == pytest.approx(
        (1980 + 1410 + 1755 + 1980) / 4
    )
    assert found["held_back"] == ["sw_power_cap"]  # idle is not a slowdown of the work
    assert found["foreign_pids"] == [stranger]


def test_the_watch_samples_only_while_started(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({}, 0, iter(range(1000, 2000))))
    watch = gpu_watch.GpuWatch([0], ours=set(), interval_s=0.01)

    async def stages() -> None:
        watch.start()
        await asyncio.sleep(0.05)
        await watch.stop()
        count = watch.summary()["samples"]
        await asyncio.sleep(0.05)  # a pause between stages: no sample
        assert watch.summary()["samples"] == count > 0

    asyncio.run(stages())


def test_without_nvml_every_figure_says_it_was_not_measured(monkeypatch):
    failing = fake_nvml({}, 0, iter([]))

    def no_driver() -> None:
        raise FakeNvmlError("NVML Shared Library Not Found")

    failing.nvmlInit = no_driver  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", failing)
    assert gpu_watch.GpuWatch([0], set()).summary() == {"measured": False, "why": "NVML: NVML Shared Library Not Found"}
    assert gpu_watch.GpuWatch([], set()).summary() == {"measured": False, "why": "the server has no GPU"}


def test_another_process_on_the_gpus_invalidates_the_cell_and_the_clocks_are_reported(one_cell, tmp_path):
    experiment, cell, device = one_cell
    watched = {
        "measured": True,
        "devices": [device],
        "samples": 4,
        "sm_clock_mhz_min": 1410,
        "sm_clock_mhz_mean": 1800.0,
        "held_back": ["hw_thermal_slowdown", "sw_power_cap"],
        "foreign_pids": [],
    }
    rows = {}
    for name, gpus in (
        ("alone", watched),
        ("shared", {**watched, "foreign_pids": [1234]}),
        ("cpu", {"measured": False, "why": "the server has no GPU"}),
        ("older", None),
    ):
        synthetic_cell_of(tmp_path, cell, ttft_s=0.05, interval_s=0.005, requests=12, hit_rate=0.0, gpus=gpus)
        rows[name] = aggregation.aggregate(experiment, [cell.path], RunTables.under(tmp_path / name)).iloc[0]
    alone, shared = rows["alone"], rows["shared"]
    assert alone["valid"] and alone["gpu_foreign_processes"] == 0, alone["invalid_reasons"]
    assert alone["gpu_devices"] == "0: NVIDIA H100 80GB HBM3 (GPU-0000)"
    assert (alone["gpu_sm_clock_mhz_min"], alone["gpu_sm_clock_max_mhz"]) == (1410, 1980)
    assert alone["gpu_clock_held_back"] == "hw_thermal_slowdown, sw_power_cap"
    assert not shared["valid"] and "1 other process(es) ran on the server's GPUs" in shared["invalid_reasons"]
    for name in ("cpu", "older"):
        assert rows[name]["valid"] and pd.isna(rows[name]["gpu_foreign_processes"])
    assert rows["cpu"]["gpu_not_measured"] == "the server has no GPU"
    assert rows["older"]["gpu_not_measured"] == "a cell file from before GPUs were watched"


def test_the_energy_the_gpus_drew_is_counted_over_the_stages_only(monkeypatch):
    """Issue 43: NVML's total-energy counter (mJ since the driver loaded), read at each start and stop of the watch for
    each GPU; the pause between two stages draws nothing the cell is charged for."""
    # GPU 0, GPU 1 at each read: the first stage's start and stop, then the second's.
    readings = iter([5_000_000, 9_000_000, 5_600_000, 9_900_000, 7_000_000, 12_000_000, 7_250_000, 12_250_000])
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({}, 0, iter(range(1000, 2000)), readings))
    watch = gpu_watch.GpuWatch([0, 1], ours=set(), interval_s=60)

    async def two_stages() -> None:
        watch.start()  # GPU 0 at 5,000 J, GPU 1 at 9,000 J
        await watch.stop()  # +600 J and +900 J
        watch.start()  # meanwhile the counters went on (7,000 and 12,000): a pause, not charged
        await watch.stop()  # +250 J each

    asyncio.run(two_stages())
    assert watch.summary()["energy_j"] == pytest.approx(600 + 900 + 250 + 250)
    assert watch.summary()["energy_why_not"] is None


def test_a_gpu_without_an_energy_counter_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({}, 0, iter(range(1000, 2000)), None))
    watch = gpu_watch.GpuWatch([0], ours=set(), interval_s=60)

    async def stage() -> None:
        watch.start()
        await watch.stop()

    asyncio.run(stage())
    found = watch.summary()
    assert found["measured"] and found["energy_j"] is None
    assert found["energy_why_not"] == "NVML's energy counter: Not Supported"


def test_joules_per_token_are_the_routes_energy_over_the_tokens_the_server_counted(one_cell, tmp_path):
    experiment, cell, device = one_cell
    watched = {"measured": True, "devices": [device], "samples": 4, "held_back": [], "foreign_pids": []}
    rows = {}
    for name, gpus, energy in (
        ("drawn", {**watched, "energy_j": 30.0, "energy_why_not": None}, 30.0),
        ("no counter", {**watched, "energy_j": None, "energy_why_not": "NVML's energy counter: Not Supported"}, None),
        ("cpu", {"measured": False, "why": "the server has no GPU"}, None),
    ):
        synthetic_cell_of(tmp_path, cell, ttft_s=0.05, interval_s=0.005, requests=12, gpus=gpus, energy_j=energy)
        rows[name] = aggregation.aggregate(experiment, [cell.path], RunTables.under(tmp_path / name)).iloc[0]
    drawn = rows["drawn"]
    assert drawn["gpu_energy_j"] == 30.0 and pd.isna(drawn["gpu_energy_not_measured"])
    # The synthetic cell's server counted 12 requests of 32 output tokens after prompts of the cell's context.
    assert drawn["joules_per_output_token"] == pytest.approx(30.0 / (12 * 32))
    assert drawn["joules_per_token"] == pytest.approx(30.0 / (12 * 32 + 12 * cell.context))
    assert rows["no counter"]["gpu_energy_not_measured"] == "NVML's energy counter: Not Supported"
    assert pd.isna(rows["no counter"]["joules_per_token"]) and pd.isna(rows["cpu"]["gpu_energy_j"])
    assert rows["cpu"]["gpu_not_measured"] == "the server has no GPU"


def test_each_repeat_of_a_cell_says_what_its_stages_drew(sandbox, monkeypatch):
    """The cell job's watch, the calibration server standing in for a server on GPU 0 (NVML faked): every repeat's
    stages draw their own energy, and together what the watch counted."""
    import dataclasses
    import itertools
    import os

    from helpers.faults import calibration_config
    from servegrid.pipeline.cell_job import run_cell
    from servegrid.serving import procs

    counter = itertools.count(1_000_000, 500)  # each read 0.5 J past the last
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({}, 0, itertools.repeat(1980), counter))
    workload = {"contexts": [32], "concurrency": [1], "output_tokens": 8, "requests_per_session": 2, "repeats": 2}
    built = Experiment(calibration_config(decode=workload))
    (cell,) = built.cells("only")
    on_gpu = dataclasses.replace(sandbox, gpus=[0])
    record = run_cell(built, cell, cell.path, owner=procs.ProcessRef.of(os.getpid()), runtime=on_gpu)
    drawn = [r["gpu_energy_j"] for r in record.repeats]
    assert len(drawn) == 2 and all(j > 0 for j in drawn), record.repeats
    assert sum(drawn) == pytest.approx(record.gpus["energy_j"])
