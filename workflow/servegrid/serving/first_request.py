"""A new server's first request (its warm-up): where an engine that cannot serve its configuration shows it.

Healthy, then dead at its first request of its own error (vLLM's CPU build with MTP and a hybrid model's prefix
caching): :class:`~servegrid.errors.EngineRefused`, the configuration's result. A timeout is a start worth one more try
(:class:`~servegrid.errors.StartRaced`); any other failure of the warm-up is a failed start, with the server log's tail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from servegrid.engines import Engine
from servegrid.errors import EngineRefused, ServerError, StartRaced
from servegrid.serving.launch import log_tail

DEATH_WAIT_S = 10.0  # how long a server whose first request failed has to show its engine's death in its log


def warm_up(
    engine: Engine,
    client: httpx.Client,
    url: str,
    served_name: str,
    configuration: str,
    log_path: Path,
    server: Callable[[], dict[str, Any]],
) -> None:
    """The engine's warm-up request; ``server`` gives what is known of the server, for a refusal's record."""
    try:
        engine.warm_up(client, url, served_name)
    except (httpx.HTTPError, ServerError) as exc:
        reason = engine_refusal(engine, log_path)
        if reason is None:
            # A first request that timed out just after health (the engine still settling, the host busy for a
            # moment) is worth one more start; anything else is not.
            failed = StartRaced if isinstance(exc, httpx.TimeoutException) else ServerError
            raise failed(
                f"the server for configuration '{configuration}' failed its warm-up request: {exc}\n"
                f"Server log: {log_path}\n--- last lines ---\n{log_tail(log_path)}"
            ) from exc
        raise EngineRefused(
            f"the engine of configuration '{configuration}' died at its first request: {reason}\n"
            f"Server log: {log_path}",
            reason,
            server(),
        ) from exc


def engine_refusal(engine: Engine, log_path: Path) -> str | None:
    """The engine's own reason for dying, once its log shows it (its processes write the traceback while the
    failed answer is on its way: a bounded wait on the log, not a fixed sleep)."""
    deadline = time.monotonic() + DEATH_WAIT_S
    while True:
        reason = engine.refusal(log_path.read_text(encoding="utf-8", errors="replace"))
        if reason is not None or time.monotonic() > deadline:
            return reason
        time.sleep(0.2)
