"""Closed-loop sessions in stages: each session sends its next unit when its last one ended.

The stages are the cell's :class:`~servegrid.load.stages.StagePlan` (its sampling rule). A stage's progress line
is written here, beside the loop that knows its requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from servegrid import progress
from servegrid.load.base import MEASURED, Driver, MeasureHook, Unit, Work

log = logging.getLogger(__name__)


async def measure_in_stages(driver: Driver, measure: MeasureHook, work: Work[Any], sessions: int) -> None:
    """The measured phase: ``sessions`` closed-loop sessions, in the stages ``driver.plan`` sets.

    Each ``(session, index)`` unit's content is built by ``work.prepare`` before its stage starts; ``work.send``
    runs one unit and returns when its session wants to send its next one. Sessions of a stage start at one
    instant; the next stage starts once all are done, after the streams are decoded, ``work.settle()`` has
    completed the records and the samples are judged.
    """
    done = 0

    def units(rounds: int) -> list[tuple[int, int]]:
        return [(s, i) for s in range(sessions) for i in range(done, done + rounds)]

    plan = driver.plan
    rounds = plan.next_rounds(driver.records, 0.0)
    contents = work.prepare(units(rounds))
    await measure()
    driver.measuring_since_ns = time.monotonic_ns()
    while rounds:
        by_session = [contents[s * rounds : (s + 1) * rounds] for s in range(sessions)]

        async def session(s: int, start_ns: int, first: int = done, stage: list[Sequence[Any]] = by_session) -> None:
            intended = start_ns
            for i, content in enumerate(stage[s]):
                if not driver.may_start():
                    break
                intended = await work.send(Unit(s, first + i, MEASURED), content, intended)

        plan.stage_started(driver.elapsed_s())
        planned = rounds * sessions * work.requests_per_unit  # requests, every turn counted
        ticker = asyncio.create_task(stage_ticker(driver, len(plan.stages), planned, len(driver.records)))
        try:
            await run_sessions(sessions, session)
        finally:
            ticker.cancel()
        plan.stage_ended(driver.elapsed_s())
        done += rounds
        await driver.pause_timing()
        driver.streamer.decode_pending()  # nothing is in flight: decoding delays no timestamp
        work.settle()
        rounds = plan.next_rounds(driver.records, driver.elapsed_s())
        if rounds and driver.may_start():
            contents = work.prepare(units(rounds))
            await driver.resume_timing()
        elif rounds:  # time is up while judging: the planned stage would send nothing
            plan.time_up()
            rounds = 0


async def stage_ticker(driver: Driver, stage: int, planned: int, first: int) -> None:
    """Every few seconds while a stage runs: its requests done of planned, time measured, and an ETA (the
    stage's pace, or the cell's time limit if that comes first)."""
    started = driver.elapsed_s()
    limit_s = driver.plan.time_limit_s
    while True:
        await asyncio.sleep(progress.INTERVAL_S)
        done = sum(1 for r in driver.records[first:] if r.phase == MEASURED and r.end_ns is not None)
        elapsed = driver.elapsed_s()
        eta = (elapsed - started) / done * (planned - done) if done else float("inf")
        if limit_s is not None:
            eta = min(eta, max(0.0, limit_s - elapsed))
        shown = "unknown" if eta == float("inf") else f"about {progress.duration(eta)}"
        log.info(
            "cell %s: stage %d: %d of %d requests done, %s measured; stage ETA %s",
            driver.plan.label,
            stage,
            done,
            planned,
            progress.duration(elapsed),
            shown,
        )


async def run_sessions(sessions: int, body: Callable[[int, int], Awaitable[None]]) -> None:
    """Run ``sessions`` closed-loop sessions that start at one instant.

    ``body(session, start_ns)`` sends that session's units back to back.
    """
    start_ns = time.monotonic_ns()
    await asyncio.gather(*(body(s, start_ns) for s in range(sessions)))
