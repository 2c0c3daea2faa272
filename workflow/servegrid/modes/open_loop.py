"""The measured phase of an open-loop cell: requests go out when the arrival schedule says, whatever the server does.

A closed loop waits for a reply before its session sends again, so a server that stalls is sent less and its
stall hides (coordinated omission). Here every arrival is sent at its due time (servegrid.modes.arrivals) and
records that time as its intended send: a send the client could not make on time shows as send lag, a server
that fell behind as latency. Three spans of arrivals:

- the **ramp** (due in the first ``ramp_s`` seconds): sent, not measured, while the server's queue fills;
- the **measured** window: the next ``requests`` arrivals;
- the **drain**: arrivals go on after the measured ones until those have all finished, so the last measured
  requests meet the same load as the first; drain requests still in flight then are cancelled, never measured.

The client holds at most ``max_in_flight`` requests. A ramp or measured arrival due while that many are in flight
means the server takes less than the offered rate: the cell is **saturated**, which is a result, not an error. It
sends no further arrival, lets the measured requests in flight finish, and says how many measured arrivals it never
sent. The drain meeting the ceiling only ends the drain: every measured arrival went out on time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from servegrid import progress
from servegrid.modes import trace_source
from servegrid.modes.arrivals import Arrival, due_offsets_s
from servegrid.records.request import RequestRecord


class Sender(Protocol):
    """What this phase uses of the cell's context (servegrid.modes.runner.WorkloadContext, which imports this
    module: the runner chooses open or closed loop)."""

    records: list[RequestRecord]
    measuring_since_ns: int | None

    @property
    def label(self) -> str:
        """The cell's name, for its progress lines."""
        ...

    def new_record(
        self, session: int, seq: int, phase: str, prompt_tokens: int, turn: int = 1, label: str = ""
    ) -> RequestRecord: ...

    async def complete(self, record: RequestRecord, prompt: list[int]) -> None: ...


log = logging.getLogger(__name__)

RAMP, MEASURED, DRAIN = "ramp", "measured", "drain"
Content = TypeVar("Content")
CANCELLED_AT_DRAIN = "cancelled: the measured window was over (drain)"


@dataclass(frozen=True)
class OpenLoop:
    """An open-loop cell's load: what its settings say (Experiment.cell_settings) and the seed of its schedule."""

    rate: float
    arrival: Arrival
    requests: int
    ramp_s: float
    max_in_flight: int
    seed: int
    think_mean_s: float = 0.0  # multi_turn: between a reply and the next turn
    think_pattern: str = "exponential"
    # A replayed trace's arrivals (s after the first, speedup applied): the schedule, instead of one drawn at the
    # rate. Its ramp is the window's arrivals due before ramp_s, the rest of the window is measured (``requests``),
    # and the arrivals after the window are the drain.
    replayed_offsets_s: tuple[float, ...] | None = None
    replayed_ramp: int = 0

    @classmethod
    def for_cell(cls, settings: Mapping[str, Any]) -> OpenLoop | None:
        """A cell's open-loop load from its settings: a replayed trace's, a rate's, or None (closed loop)."""
        if settings.get("speedup"):
            replay = trace_source.replayed(settings["workload"])
            window = settings["open_loop"]
            return cls.replay(replay.sent.due_offsets_s(float(settings["speedup"])), len(replay.window.conversations),
                              float(window["ramp_s"]), int(window["max_in_flight"]),
                              int(settings["workload"]["seed"]))  # fmt: skip
        return cls.from_settings(settings) if settings.get("rate") else None

    @classmethod
    def replay(cls, offsets_s: list[float], in_window: int, ramp_s: float, max_in_flight: int, seed: int) -> OpenLoop:
        """The load of a trace replayed on its own schedule: the first ``in_window`` arrivals are its window's (the
        ramp, then the measured ones), the rest its drain; ``rate``: the measured arrivals' mean rate."""
        ramp = min(sum(1 for t in offsets_s[:in_window] if t < ramp_s), in_window - 1)
        measured = offsets_s[ramp:in_window]
        span = measured[-1] - measured[0] if len(measured) > 1 else 0.0
        rate = (len(measured) - 1) / span if span > 0 else 1.0
        return cls(rate=rate, arrival=Arrival("constant"), requests=len(measured), ramp_s=ramp_s,
                   max_in_flight=max_in_flight, seed=seed, replayed_offsets_s=tuple(offsets_s),
                   replayed_ramp=ramp)  # fmt: skip

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> OpenLoop:
        window = settings["open_loop"]
        return cls(
            rate=float(settings["rate"]),
            arrival=Arrival(**settings["arrival"]),
            requests=int(window["requests"]),
            ramp_s=float(window["ramp_s"]),
            max_in_flight=int(window["max_in_flight"]),
            think_mean_s=float((window.get("think") or {}).get("mean_s", 0.0)),
            think_pattern=str((window.get("think") or {}).get("pattern", "exponential")),
            # Not the configuration: every configuration meets the same arrival times.
            seed=int(settings["workload"]["seed"]),
        )

    def schedule(self) -> tuple[list[float], int]:
        """Every arrival's due time (s after the start) and how many of them are the ramp's.

        Enough arrivals for the ramp, the measured window and a drain as long as ``max_in_flight`` arrivals
        (beyond that many the cell is saturated anyway)."""
        if self.replayed_offsets_s is not None:
            return list(self.replayed_offsets_s), self.replayed_ramp
        ramp_estimate = math.ceil(self.rate * self.ramp_s * 2) + 10
        while True:
            offsets = due_offsets_s(self.rate, ramp_estimate + self.requests + self.max_in_flight, self.arrival,
                                    self.seed)  # fmt: skip
            ramp = int((offsets < self.ramp_s).sum())
            if ramp < ramp_estimate:  # the schedule reaches past the ramp: the window and drain are whole
                return offsets[: ramp + self.requests + self.max_in_flight].tolist(), ramp
            ramp_estimate *= 2

    def think_times_s(self, index: int, count: int) -> list[float]:
        """The think times before each of ``count`` later turns of the conversation that arrives ``index``-th:
        seeded by the schedule's seed and the arrival, so every configuration meets the same ones."""
        if self.think_pattern == "constant" or self.think_mean_s == 0:
            return [self.think_mean_s] * count
        rng = np.random.default_rng([self.seed, index])
        return rng.exponential(self.think_mean_s, count).tolist()

    def expected_in_flight(self, latency_s: float) -> int:
        """Requests in flight at this rate if each takes ``latency_s`` (Little's law), at least 1, at most the
        ceiling: how many connections to open before the window starts."""
        return max(1, min(self.max_in_flight, math.ceil(self.rate * latency_s * 2)))


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


async def measure(
    ctx: Sender,
    measure_hook: Callable[[], Awaitable[None]],
    prepare: Callable[[list[tuple[int, int]]], Sequence[Content]],
    load: OpenLoop,
    send: Callable[[int, str, Content, int], Awaitable[None]] | None = None,
) -> OpenLoopOutcome:
    """Send the schedule's arrivals at their due times: each arrival is one unit that ``prepare`` built (a
    prompt; a conversation) and ``send(index, phase, unit, due_ns)`` runs (default: one completion of the prompt)."""
    offsets, ramp = load.schedule()
    window_end = ramp + load.requests
    # Before anything is in flight: a prompt may ask the server's tokenizer (a trace's prompts are built lazily,
    # per arrival, from blocks whose tokenizer calls are done by then).
    units = prepare([(0, i) for i in range(len(offsets))])
    outcome = OpenLoopOutcome(ramp_requests=ramp)
    measured_left = load.requests
    measured_done = asyncio.Event()
    in_flight: dict[asyncio.Task[None], str] = {}  # each arrival's task and its phase

    async def complete(index: int, phase: str, prompt: Any, due_ns: int) -> None:
        record = ctx.new_record(0, index, phase, len(prompt))
        record.intended_send_ns = due_ns
        await ctx.complete(record, prompt)

    run_unit = send or complete

    def finished(task: asyncio.Task[None]) -> None:
        nonlocal measured_left
        if in_flight.pop(task) == MEASURED:
            measured_left -= 1
            if measured_left == 0:
                measured_done.set()

    await measure_hook()
    start_ns = ctx.measuring_since_ns = time.monotonic_ns()
    sent_measured = 0

    def tally() -> tuple[int, int, int]:  # measured arrivals sent, measured arrivals finished, arrivals in flight
        return sent_measured, load.requests - outcome.not_sent - measured_left, len(in_flight)

    ticker = asyncio.create_task(progress_ticker(ctx, start_ns, offsets[ramp:window_end], tally))
    try:
        last_measured_due_ns = start_ns
        for index, offset in enumerate(offsets):
            phase = RAMP if index < ramp else MEASURED if index < window_end else DRAIN
            due_ns = start_ns + int(offset * 1e9)
            if phase == DRAIN and measured_done.is_set():
                break
            wait_s = (due_ns - time.monotonic_ns()) / 1e9
            if wait_s > 0:
                if phase == DRAIN:  # the drain ends when the window's last request does, not at the next arrival
                    try:
                        await asyncio.wait_for(measured_done.wait(), wait_s)
                        break
                    except TimeoutError:
                        pass
                else:
                    await asyncio.sleep(wait_s)
            else:  # behind the schedule: let the requests already due start before adding another
                await asyncio.sleep(0)
            if len(in_flight) >= load.max_in_flight and phase == DRAIN:  # every measured arrival went out: no more load
                break
            if len(in_flight) >= load.max_in_flight:
                outcome.saturated = True
                outcome.not_sent = max(0, window_end - index)
                if outcome.not_sent:
                    measured_left -= outcome.not_sent
                    if measured_left <= 0:
                        measured_done.set()
                break
            if phase == MEASURED:
                last_measured_due_ns = due_ns
                sent_measured += 1
            task = asyncio.create_task(run_unit(index, phase, units[index], due_ns))
            in_flight[task] = phase
            task.add_done_callback(finished)
            outcome.peak_in_flight = max(outcome.peak_in_flight, len(in_flight))
            outcome.drain_requests += phase == DRAIN
        if measured_left > 0:
            await measured_done.wait()
    finally:
        ticker.cancel()
    drained_ns = time.monotonic_ns()
    for task in list(in_flight):  # ramp or drain arrivals: never measured
        task.cancel()
    await asyncio.gather(*in_flight, return_exceptions=True)
    for record in ctx.records:  # a stream cancelled before it ended
        if record.phase in (RAMP, DRAIN) and record.end_ns is None:
            record.error = record.error or CANCELLED_AT_DRAIN
            record.end_ns = drained_ns
    first_measured_s = offsets[ramp] if ramp < len(offsets) else 0.0
    outcome.ramp_s = first_measured_s
    outcome.window_s = (last_measured_due_ns - start_ns) / 1e9 - first_measured_s + 1.0 / load.rate
    if outcome.saturated:  # what the server delivered: from the first measured arrival to the last measured answer
        ends = [r.end_ns for r in ctx.records if r.phase == MEASURED and r.end_ns]
        if ends:
            outcome.window_s = max(outcome.window_s, (max(ends) - start_ns) / 1e9 - first_measured_s)
    outcome.drain_s = max(0.0, (drained_ns - last_measured_due_ns) / 1e9)
    return outcome


async def progress_ticker(
    ctx: Sender, start_ns: int, measured_offsets_s: Sequence[float], tally: Callable[[], tuple[int, int, int]]
) -> None:
    """Every few seconds while an open-loop cell runs: its measured arrivals sent and finished (an arrival: a
    request, or a conversation with its turns), what is in flight, the send lag so far (the client keeping its
    schedule), and when the last measured arrival is due. A closed-loop stage's line is the runner's
    (servegrid.modes.runner.stage_ticker)."""
    planned = len(measured_offsets_s)
    last_due_s = measured_offsets_s[-1] if measured_offsets_s else 0.0
    while True:
        await asyncio.sleep(progress.INTERVAL_S)
        sent, finished, in_flight = tally()
        lags_ms = [(r.sent_ns - r.intended_send_ns) / 1e6 for r in ctx.records if r.phase == MEASURED and r.sent_ns]
        lag = f"send lag p99 {np.percentile(lags_ms, 99):.0f} ms" if lags_ms else "nothing measured sent yet"
        elapsed_s = (time.monotonic_ns() - start_ns) / 1e9
        due_in_s = last_due_s - elapsed_s
        schedule = (f"last measured arrival due in {progress.duration(due_in_s)}" if due_in_s > 0
                    else "every measured arrival due; waiting for their answers")  # fmt: skip
        log.info(
            "cell %s: open loop, %s: %d of %d measured arrivals sent, %d finished; %d in flight; %s; %s",
            ctx.label, progress.duration(elapsed_s), sent, planned, finished, in_flight, lag, schedule,
        )  # fmt: skip
