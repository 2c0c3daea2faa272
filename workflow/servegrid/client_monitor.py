"""The client watching over its own timing while a cell measures.

:class:`CollectorPause` keeps Python's cyclic garbage collector from holding the
event loop while streams are timed; :class:`ClientMonitor` measures how late
the loop ran and how busy the client was, so that a cell whose client was the
bottleneck is flagged rather than trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import psutil

from servegrid import stats


class CollectorPause:
    """Python's cyclic garbage collector off while streams are timed.

    A full collection over a cell's records held the loop for up to 78 ms
    (servegrid's client against 256 calibration streams), and every read that arrived
    meanwhile was stamped that late. Reference counting still frees nearly
    everything at once; what is left in cycles is collected when timing stops.
    """

    def __init__(self) -> None:
        self._was_enabled = False

    def start(self) -> None:
        self._was_enabled = self._was_enabled or gc.isenabled()
        gc.disable()

    def stop(self) -> None:
        if self._was_enabled:
            gc.enable()
            gc.collect()
        self._was_enabled = False


class ClientMonitor:
    """Watches the client itself while a cell measures: event-loop lag and CPU.

    Every ``interval_s`` a task asks to sleep and records how late it woke up;
    a loop that is busy parsing (or blocked) wakes late, and then chunk
    timestamps are late by about as much. CPU is this process's user + system
    time over the wall time of the measured phases, as a fraction of one core.
    It can be started and stopped again (once per repeat); figures accumulate.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None
        self._cpu_start = self._wall_start = 0.0
        self._cpu_total = self._wall_total = 0.0

    async def _watch(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, time.monotonic() - started - self.interval_s))

    @staticmethod
    def _cpu() -> float:
        times = psutil.Process().cpu_times()
        return times.user + times.system

    def start(self) -> None:
        self._cpu_start, self._wall_start = self._cpu(), time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self._cpu_total += self._cpu() - self._cpu_start
        self._wall_total += time.monotonic() - self._wall_start

    def summary(self) -> dict[str, float | int | None]:
        lags = stats.percentiles(self.lags, (50, 99))
        return {
            "loop_lag_samples": len(self.lags),
            "loop_lag_p50_s": lags["p50"],
            "loop_lag_p99_s": lags["p99"],
            "loop_lag_max_s": max(self.lags) if self.lags else None,
            "cpu_fraction": self._cpu_total / self._wall_total if self._wall_total > 0 else None,
        }
