"""The client watching over its own timing while a cell measures.

:class:`CollectorPause` keeps Python's cyclic garbage collector from holding the
event loop while streams are timed; :class:`ClientMonitor` measures how late
the loop ran and how busy the client was, so that a cell whose client was the
bottleneck is flagged rather than trusted; :class:`StallGuard` ends a measured
phase whose server stopped making progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from typing import TYPE_CHECKING

import psutil

from servegrid.records.request import RequestRecord
from servegrid.stats import intervals

if TYPE_CHECKING:
    from servegrid.measuring.client import Streamer


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
        return float(times.user + times.system)

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
        lags = intervals.percentiles(self.lags, (50, 99), enough_only=False)  # a warning sign, even from few
        return {
            "loop_lag_samples": len(self.lags),
            "loop_lag_p50_s": lags["p50"],
            "loop_lag_p99_s": lags["p99"],
            "loop_lag_max_s": max(self.lags) if self.lags else None,
            "cpu_fraction": self._cpu_total / self._wall_total if self._wall_total > 0 else None,
        }


class StallGuard:
    """Ends a measured phase that makes no progress: nothing sent and no byte read on any stream for
    ``limit_s`` while requests are in flight (an engine that hangs while its health check still says 200).

    It watches from the cell's first request on: through the warm-up with :func:`warmup_stall_limit_s`,
    then with the limit :func:`stall_limit_s` sets from the cell's own warm-up (:meth:`tighten`). The
    work task is cancelled, and :attr:`stalled_s` says for how long nothing had moved, :attr:`basis`
    where its limit came from.
    """

    def __init__(self, streamer: Streamer, interval_s: float = 0.5) -> None:
        self.streamer = streamer
        self.interval_s = interval_s
        self.limit_s = float("inf")
        self.basis = ""
        self.stalled_s: float | None = None
        self._task: asyncio.Task | None = None

    def start(self, work: asyncio.Future, limit_s: float, basis: str) -> None:
        self.limit_s, self.basis = limit_s, basis
        self._task = asyncio.get_running_loop().create_task(self._watch(work))

    def tighten(self, limit_s: float, basis: str) -> None:
        """The measured phase's limit, once the warm-up has shown how long one request takes."""
        self.limit_s, self.basis = limit_s, basis

    async def _watch(self, work: asyncio.Future) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            quiet_s = (time.monotonic_ns() - self.streamer.last_progress_ns()) / 1e9
            if self.streamer.in_flight and quiet_s > self.limit_s:
                self.stalled_s = quiet_s
                work.cancel()
                return

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


STALL_FACTOR = 10


def warmup_stall_limit_s(floor_s: float, request_timeout_s: float) -> float:
    """How long a cell's warm-up may go without progress, before any request of its shape has been
    timed: 10 × ``floor_s``, at most the request timeout (a hung engine found in minutes, not hours)."""
    return min(request_timeout_s, STALL_FACTOR * floor_s)


def stall_limit_s(
    warmups: list[RequestRecord], concurrency: int, floor_s: float, fallback_s: float, ceiling_s: float = math.inf
) -> float:
    """How long a cell may go without progress: 10 × its slowest warm-up request (a request of the same
    shape, on the same server, just before) × its sessions (a request may wait behind the others'),
    at least ``floor_s``, at most ``ceiling_s`` (the cell's own budget: no token from any of its requests for
    as long as it may measure is a hung engine, whatever its size: 32 sessions after a 10 s warm-up would
    otherwise wait 53 min). Without a completed warm-up: ``fallback_s``."""
    done = [(r.end_ns - r.sent_ns) / 1e9 for r in warmups if r.end_ns and r.sent_ns and not r.error]
    if not done:
        return fallback_s
    return max(floor_s, min(STALL_FACTOR * max(done) * concurrency, ceiling_s))
