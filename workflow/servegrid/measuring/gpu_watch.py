"""The GPUs a cell's server runs on, as NVML sees them while the cell measures (issue 42, item 10): which cards (UUID,
name), their SM clock against its maximum, why their clocks were held back (power cap, thermal or hardware
slowdown), and whether another program's process was on them. A reader then sees when GPU 0 and GPU 1 were not
alike, and a cell that shared its GPU with someone else is invalid. The energy the GPUs drew while watched comes from
NVML's total-energy counter (millijoules since the driver loaded; Volta and later), read at each start and stop, so it
covers the stages and not the pauses between them (issue 43).

NVML comes from ``nvidia-ml-py`` (module ``pynvml``); without an NVIDIA driver (the CPU build, a laptop) every
figure is "not measured" and says why. Indices are nvidia-smi's (PCI bus order), as ``configurations.*.gpus`` and
the preflight's GPU checks read them.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from servegrid.periodic import Periodic

# NVML's clock event reasons (pynvml's nvmlClocksEventReason* bits) that mean the GPU ran slower than it could; the
# others (idle, application or display clock settings, sync boost) are not a slowdown of the work.
HELD_BACK = {
    "sw_power_cap": "nvmlClocksEventReasonSwPowerCap",
    "hw_slowdown": "nvmlClocksEventReasonHwSlowdown",
    "sw_thermal_slowdown": "nvmlClocksEventReasonSwThermalSlowdown",
    "hw_thermal_slowdown": "nvmlClocksEventReasonHwThermalSlowdown",
    "hw_power_brake_slowdown": "nvmlClocksEventReasonHwPowerBrakeSlowdown",
}


def _nvml() -> tuple[Any, str | None]:
    """pynvml, initialised, or (None, why not)."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML: {exc}"
    return pynvml, None


@dataclass
class GpuWatch:
    """Samples ``gpus`` every ``interval_s`` while started; ``ours``: the server's processes (theirs on a GPU are
    expected, any other process of this host is someone else's)."""

    gpus: Sequence[int]
    ours: set[int]
    interval_s: float = 1.0
    _nvml: Any = None
    why_not: str | None = None
    devices: list[dict[str, Any]] = field(default_factory=list)
    _samples: list[dict[str, Any]] = field(default_factory=list)
    _every: Periodic | None = None
    # Millijoules drawn by all the GPUs while started; None, with the reason, where the counter cannot be read.
    energy_mj: int | None = None
    energy_why_not: str | None = None
    _energy_at_start: int | None = None

    def __post_init__(self) -> None:
        if not self.gpus:
            self.why_not = "the server has no GPU"
            return
        self._nvml, self.why_not = _nvml()
        if self._nvml is None:
            return
        nvml = self._nvml
        try:
            for index in self.gpus:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                self.devices.append(
                    {
                        "index": index,
                        "uuid": str(nvml.nvmlDeviceGetUUID(handle)),
                        "name": str(nvml.nvmlDeviceGetName(handle)),
                        "sm_clock_max_mhz": int(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)),
                    }
                )
        except nvml.NVMLError as exc:
            self._nvml, self.why_not, self.devices = None, f"NVML: GPU {index}: {exc}", []
            return
        self.energy_mj = 0

    def _energy_now(self) -> int | None:
        """The GPUs' energy counters, summed (mJ); None, and the watch's energy no longer counted, where one fails."""
        nvml = self._nvml
        if nvml is None or self.energy_mj is None:
            return None
        try:
            return sum(
                int(nvml.nvmlDeviceGetTotalEnergyConsumption(nvml.nvmlDeviceGetHandleByIndex(d["index"])))
                for d in self.devices
            )
        except nvml.NVMLError as exc:  # "Not Supported" before Volta
            self.energy_mj, self.energy_why_not = None, f"NVML's energy counter: {exc}"
            return None

    def sample(self) -> None:
        """One reading of every GPU: SM clock, the reasons its clocks are held back, the processes on it."""
        nvml = self._nvml
        if nvml is None:
            return
        reading: dict[str, Any] = {"t": time.monotonic(), "gpus": []}
        try:
            for device in self.devices:
                handle = nvml.nvmlDeviceGetHandleByIndex(device["index"])
                reasons = int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
                reading["gpus"].append(
                    {
                        "sm_clock_mhz": int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
                        "held_back": [name for name, bit in HELD_BACK.items() if reasons & int(getattr(nvml, bit))],
                        "pids": sorted(int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)),
                    }
                )
        except nvml.NVMLError:
            return  # a reading missed: the others still say how the cell went
        self._samples.append(reading)

    async def _tick(self) -> None:
        self.sample()

    def start(self) -> None:
        if self._nvml is not None:
            self._every = self._every or Periodic(self._tick, self.interval_s)
            self._every.start()
            self._energy_at_start = self._energy_now()

    async def stop(self) -> None:
        if self._every:
            await self._every.stop()
        start, self._energy_at_start = self._energy_at_start, None
        end = self._energy_now() if start is not None else None
        if start is not None and end is not None and self.energy_mj is not None:
            if end < start:  # the counter restarted (a driver reload): this interval cannot be told
                self.energy_mj, self.energy_why_not = None, "NVML's energy counter went back during the cell"
            else:
                self.energy_mj += end - start

    def summary(self) -> dict[str, Any]:
        """What the cell's GPUs did while it measured (``measured`` False, and why, without NVML)."""
        if self._nvml is None:
            return {"measured": False, "why": self.why_not}
        clocks = [g["sm_clock_mhz"] for s in self._samples for g in s["gpus"]]
        seen_pids = {pid for s in self._samples for g in s["gpus"] for pid in g["pids"]}
        return {
            "measured": True,
            "devices": self.devices,
            "samples": len(self._samples),
            "sm_clock_mhz_min": min(clocks) if clocks else None,
            "sm_clock_mhz_mean": statistics.fmean(clocks) if clocks else None,
            "held_back": sorted({r for s in self._samples for g in s["gpus"] for r in g["held_back"]}),
            "foreign_pids": foreign(seen_pids, self.ours),
            "energy_j": self.energy_mj / 1000 if self.energy_mj is not None else None,
            "energy_why_not": self.energy_why_not,
        }


def foreign(pids: Iterable[int], ours: set[int]) -> list[int]:
    """The processes of ``pids`` that are someone else's: alive in this host's process table (a pid NVML reports from
    outside this container's namespace cannot be told apart, and is not counted), neither the server's nor this
    process's."""
    return sorted(p for p in pids if p not in ours and p != os.getpid() and psutil.pid_exists(p))


def server_pids(roots: Iterable[psutil.Process]) -> set[int]:
    """The server's processes and all their descendants (vLLM's engine core and workers hold the GPUs)."""
    out: set[int] = set()
    for root in roots:
        with contextlib.suppress(psutil.Error):
            out.add(root.pid)
            out.update(child.pid for child in root.children(recursive=True))
    return out
