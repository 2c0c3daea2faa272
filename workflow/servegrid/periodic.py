"""Something done every few seconds while a cell's stages run (the server's gauges, the GPUs' watch): started and
stopped around each stage, so that the pauses between stages are not sampled."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable


class Periodic:
    """Awaits ``tick`` every ``interval_s`` on the running event loop, from :meth:`start` to :meth:`stop`."""

    def __init__(self, tick: Callable[[], Awaitable[None]], interval_s: float) -> None:
        self.tick, self.interval_s = tick, interval_s
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.tick()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
