"""The measured phase of an open-loop cell: requests go out when the arrival schedule says, whatever the server does.

A closed loop waits for a reply before its session sends again, so a server that stalls is sent less and its
stall hides (coordinated omission). Here every arrival is sent at its due time (a rate's schedule,
servegrid.load.arrivals, or a replayed trace's) and records that time as its intended send: a send the client
could not make on time shows as send lag, a server that fell behind as latency. Three spans of arrivals:

- the **ramp** (due in the first ``ramp_s`` seconds): sent, not measured, while the server's queue fills;
- the **measured** window: the next ``requests`` arrivals;
- the **drain**: arrivals go on after the measured ones until those have all finished, so the last measured
  requests meet the same load as the first; drain requests still in flight then are cancelled, never measured.

The client holds at most ``max_in_flight`` requests. A ramp or measured arrival due while that many are in flight
means the server takes less than the offered rate: the cell is **saturated**, which is a result, not an error. It
sends no further arrival, lets the measured requests in flight finish, and says how many measured arrivals it never
sent. The drain meeting the ceiling only ends the drain: every measured arrival went out on time.

What is sent per arrival is the mode's (a :class:`~servegrid.load.base.Work`); which schedule, its strategy's
(:class:`~servegrid.load.strategies.RateStrategy`, :class:`~servegrid.load.strategies.ReplayStrategy`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from servegrid import progress
from servegrid.load.base import DRAIN, MEASURED, RAMP, Driver, MeasureHook, Unit, Work

log = logging.getLogger(__name__)

CANCELLED_AT_DRAIN = "cancelled: the measured window was over (drain)"


class Window(Protocol):
    """What an open-loop run needs of its load (servegrid.load.strategies: a rate's, a replayed trace's)."""

    @property
    def rate(self) -> float:
        """Arrivals a second: the measured arrivals' mean rate."""
        ...

    @property
    def requests(self) -> int:
        """The measured arrivals."""
        ...

    @property
    def max_in_flight(self) -> int:
        """The client's ceiling on requests in flight."""
        ...

    def schedule(self) -> tuple[list[float], int]:
        """Every arrival's due time (s after the start) and how many of them are the ramp's."""
        ...


@dataclass
class OpenLoopOutcome:
    """What the phase summary says of an open-loop run (measured_phase: the repeat's summary and duration)."""

    ramp_s: float = 0.0  # from the first arrival to the first measured one
    window_s: float = 0.0  # the measured arrivals' span, one mean gap included: what rates are per second of
    drain_s: float = 0.0  # from the last measured arrival until every measured request had finished
    ramp_requests: int = 0
    drain_requests: int = 0
    not_sent: int = 0  # measured arrivals never sent (saturated)
    saturated: bool = False
    peak_in_flight: int = 0

    def summary(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def measure(driver: Driver, measure_hook: MeasureHook, work: Work[Any], load: Window) -> OpenLoopOutcome:
    """Send the schedule's arrivals at their due times: each arrival is one unit of ``work``, built by its
    ``prepare`` (a prompt; a conversation) and run by its ``send`` as ``Unit(0, index, phase)`` due then."""
    offsets, ramp = load.schedule()
    # Before anything is in flight: a prompt may ask the server's tokenizer (a trace's prompts are built lazily,
    # per arrival, from blocks whose tokenizer calls are done by then).
    units = work.prepare([(0, i) for i in range(len(offsets))])
    run = _Arrivals(driver, load, offsets, ramp)
    await measure_hook()
    run.start_ns = run.last_measured_due_ns = driver.measuring_since_ns = time.monotonic_ns()
    ticker = asyncio.create_task(progress_ticker(driver, run.start_ns, offsets[ramp : run.window_end], run.tally))
    try:
        for index, offset in enumerate(offsets):
            phase = run.phase_of(index)
            due_ns = run.start_ns + int(offset * 1e9)
            if not await run.may_send(index, phase, due_ns):
                break
            run.sent(phase, due_ns, asyncio.ensure_future(work.send(Unit(0, index, phase), units[index], due_ns)))
        if run.measured_left > 0:
            await run.measured_done.wait()
    finally:
        ticker.cancel()
    await run.drain()
    return run.outcome


class _Arrivals:
    """One open-loop run's bookkeeping: the arrivals in flight (each with its phase), the measured ones left, the
    outcome so far."""

    def __init__(self, ctx: Driver, load: Window, offsets: list[float], ramp: int) -> None:
        self.ctx, self.load, self.offsets, self.ramp = ctx, load, offsets, ramp
        self.window_end = ramp + load.requests
        self.outcome = OpenLoopOutcome(ramp_requests=ramp)
        self.measured_left = load.requests
        self.measured_done = asyncio.Event()
        self.in_flight: dict[asyncio.Future[Any], str] = {}  # each arrival's task and its phase
        self.sent_measured = 0
        self.start_ns = self.last_measured_due_ns = 0

    def phase_of(self, index: int) -> str:
        return RAMP if index < self.ramp else MEASURED if index < self.window_end else DRAIN

    def tally(self) -> tuple[int, int, int]:
        """Measured arrivals sent, measured arrivals finished, arrivals in flight."""
        finished = self.load.requests - self.outcome.not_sent - self.measured_left
        return self.sent_measured, finished, len(self.in_flight)

    async def may_send(self, index: int, phase: str, due_ns: int) -> bool:
        """Wait until the arrival is due; False: send no more (the drain is over, or the cell is saturated)."""
        if phase == DRAIN and self.measured_done.is_set():
            return False
        wait_s = (due_ns - time.monotonic_ns()) / 1e9
        if wait_s <= 0:  # behind the schedule: let the requests already due start before adding another
            await asyncio.sleep(0)
        elif phase != DRAIN:
            await asyncio.sleep(wait_s)
        elif await self._measured_done_within(wait_s):
            return False  # the drain ends when the window's last request does, not at the next arrival
        if len(self.in_flight) < self.load.max_in_flight:
            return True
        if phase != DRAIN:  # a drain at the ceiling: every measured arrival went out, no more load
            self._saturated(index)
        return False

    async def _measured_done_within(self, wait_s: float) -> bool:
        try:
            await asyncio.wait_for(self.measured_done.wait(), wait_s)
        except TimeoutError:
            return False
        return True

    def _saturated(self, index: int) -> None:
        self.outcome.saturated = True
        self.outcome.not_sent = max(0, self.window_end - index)
        if self.outcome.not_sent:
            self.measured_left -= self.outcome.not_sent
            if self.measured_left <= 0:
                self.measured_done.set()

    def sent(self, phase: str, due_ns: int, task: asyncio.Future[Any]) -> None:
        if phase == MEASURED:
            self.last_measured_due_ns = due_ns
            self.sent_measured += 1
        self.in_flight[task] = phase
        task.add_done_callback(self._finished)
        self.outcome.peak_in_flight = max(self.outcome.peak_in_flight, len(self.in_flight))
        self.outcome.drain_requests += phase == DRAIN

    def _finished(self, task: asyncio.Future[Any]) -> None:
        if self.in_flight.pop(task) == MEASURED:
            self.measured_left -= 1
            if self.measured_left == 0:
                self.measured_done.set()

    async def drain(self) -> None:
        """Cancel the ramp or drain arrivals still in flight (never measured), and close the outcome's spans."""
        drained_ns = time.monotonic_ns()
        for task in list(self.in_flight):
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)
        for record in self.ctx.records:  # a stream cancelled before it ended
            if record.phase in (RAMP, DRAIN) and record.end_ns is None:
                record.error = record.error or CANCELLED_AT_DRAIN
                record.end_ns = drained_ns
        outcome, start_ns = self.outcome, self.start_ns
        first_measured_s = self.offsets[self.ramp] if self.ramp < len(self.offsets) else 0.0
        outcome.ramp_s = first_measured_s
        outcome.window_s = (self.last_measured_due_ns - start_ns) / 1e9 - first_measured_s + 1.0 / self.load.rate
        if outcome.saturated:  # what the server delivered: from the first measured arrival to the last measured answer
            ends = [r.end_ns for r in self.ctx.records if r.phase == MEASURED and r.end_ns]
            if ends:
                outcome.window_s = max(outcome.window_s, (max(ends) - start_ns) / 1e9 - first_measured_s)
        outcome.drain_s = max(0.0, (drained_ns - self.last_measured_due_ns) / 1e9)


async def progress_ticker(
    ctx: Driver, start_ns: int, measured_offsets_s: Sequence[float], tally: Callable[[], tuple[int, int, int]]
) -> None:
    """Every few seconds while an open-loop cell runs: its measured arrivals sent and finished (an arrival: a
    request, or a conversation with its turns), what is in flight, the send lag so far (the client keeping its
    schedule), and when the last measured arrival is due. A closed-loop stage's line is the runner's
    (servegrid.load.sessions.stage_ticker)."""
    planned = len(measured_offsets_s)
    last_due_s = measured_offsets_s[-1] if measured_offsets_s else 0.0
    while True:
        await asyncio.sleep(progress.INTERVAL_S)
        sent, finished, in_flight = tally()
        lags_ms = [(r.sent_ns - r.intended_send_ns) / 1e6 for r in ctx.records if r.phase == MEASURED and r.sent_ns]
        lag = f"send lag p99 {np.percentile(lags_ms, 99):.0f} ms" if lags_ms else "nothing measured sent yet"
        elapsed_s = (time.monotonic_ns() - start_ns) / 1e9
        due_in_s = last_due_s - elapsed_s
        schedule = (
            f"last measured arrival due in {progress.duration(due_in_s)}"
            if due_in_s > 0
            else "every measured arrival due; waiting for their answers"
        )
        log.info(
            "cell %s: open loop, %s: %d of %d measured arrivals sent, %d finished; %d in flight; %s; %s",
            ctx.label,
            progress.duration(elapsed_s),
            sent,
            planned,
            finished,
            in_flight,
            lag,
            schedule,
        )
