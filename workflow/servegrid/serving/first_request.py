"""A new server's first request (its warm-up): where an engine that cannot serve its configuration shows it.

Healthy, then dead at its first request of its own error (vLLM's CPU build with MTP and a hybrid model's prefix
caching): :class:`~servegrid.errors.EngineRefused`, the configuration's result. A death of the moment (out of memory,
a CUDA or NCCL error, an engine process killed) or a timeout is a start worth one more try
(:class:`~servegrid.errors.StartRaced`; a second failure is a failed start, never a refused cell); any other
failure of the warm-up is a failed start, with the server log's tail.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from servegrid.engines import Engine
from servegrid.engines.base import EngineDeath
from servegrid.errors import EngineRefused, ServerError, StartRaced
from servegrid.serving.launch import log_tail

log = logging.getLogger("servegrid.serving.server")  # the servers' lines keep their logger's name

DEATH_WAIT_S = 10.0  # how long a server whose first request failed has to show its engine's death in its log


def warm_up(
    engine: Engine,
    client: httpx.Client,
    url: str,
    served_name: str,
    configuration: str,
    log_path: Path,
    server: Callable[[], dict[str, Any]],
) -> tuple[float, dict[str, int] | None]:
    """The engine's warm-up: its first request, then the requests across its cache (:meth:`Engine.warm_up_cache`).
    Returns the first request's seconds (what a reused server's liveness check is measured against) and the cache
    warm-up's facts. ``server`` gives what is known of the server, for a refusal's record."""
    try:
        started = time.monotonic()
        engine.warm_up(client, url, served_name)
        first_s = time.monotonic() - started
        cache = engine.warm_up_cache(client, url, served_name)
        if cache:
            log.info(
                "server %s: warmed up across its cache: a %d-token prompt (%d-token blocks) sent twice, %d tokens hit",
                configuration,
                cache["prompt_tokens"],
                cache["block_tokens"],
                cache["hit_tokens"],
            )
        return first_s, cache
    except (httpx.HTTPError, ServerError) as exc:
        death = death_in_log(engine, log_path)
        if death is None or death.transient:
            # A first request that timed out just after health (the engine still settling, the host busy for a
            # moment), or an engine dead of a fault of the moment, is worth one more start; anything else is not.
            retried = isinstance(exc, httpx.TimeoutException) or death is not None
            failed = StartRaced if retried else ServerError
            what = f"its engine died of a fault of the moment: {death.cause}" if death else str(exc)
            raise failed(
                f"the server for configuration '{configuration}' failed its warm-up request: {what}\n"
                f"Server log: {log_path}\n--- last lines ---\n{log_tail(log_path)}"
            ) from exc
        raise EngineRefused(
            f"the engine of configuration '{configuration}' died at its first request: {death.cause}\n"
            f"Server log: {log_path}",
            death.cause,
            server(),
        ) from exc


def death_in_log(engine: Engine, log_path: Path) -> EngineDeath | None:
    """The engine's death, once its log shows it (its processes write the traceback while the failed answer is on
    its way: a bounded wait on the log, not a fixed sleep)."""
    deadline = time.monotonic() + DEATH_WAIT_S
    while True:
        death = engine.death(log_path.read_text(encoding="utf-8", errors="replace"))
        if death is not None or time.monotonic() > deadline:
            return death
        time.sleep(0.2)
