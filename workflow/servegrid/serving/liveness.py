"""Whether a recorded server may be reused: it answers its health check as itself, and completes one tiny request
within a limit drawn from its own start-up. A server that fails either is replaced (servegrid.serving.server)."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from servegrid.control_http import control_client
from servegrid.engines import Engine
from servegrid.errors import ServerError
from servegrid.serving.launch import identity
from servegrid.serving.state import Runtime

log = logging.getLogger("servegrid.serving.server")  # the servers' lines keep their logger's name

LIVENESS_FACTOR = 10


def answers(
    engine: Engine,
    record: dict[str, Any],
    facts: dict[str, Any],
    spec: dict[str, Any],
    runtime: Runtime,
    headers: dict[str, str],
) -> bool:
    """The recorded server completes one tiny request within 10 × the one it completed after start-up
    (``facts['warmup_s']``), and at least ``runtime.liveness_floor_s``."""
    timeout_s = max(runtime.liveness_floor_s, LIVENESS_FACTOR * float(facts.get("warmup_s") or 0.0))
    started = time.monotonic()
    try:
        with control_client(timeout_s, headers) as client:
            engine.warm_up(client, record["url"], spec["served_name"])
        return True
    except (httpx.HTTPError, ServerError) as exc:
        log.warning(
            "server session %s of configuration '%s' did not complete a tiny request (%s after %.1f s, limit "
            "%.0f s): replaced, not reused",
            record["session"],
            spec["configuration"],
            type(exc).__name__,
            time.monotonic() - started,
            timeout_s,
        )
        return False


def healthy(engine: Engine, record: dict[str, Any], headers: dict[str, str]) -> bool:
    """The recorded server answers its health check, and as itself (its launch's own name)."""
    url = record["url"]
    try:
        with control_client(5.0, headers) as client:
            if client.get(f"{url}{engine.health_path}").status_code != 200:
                return False
            return identity(record["session"]) in engine.served_names(client, url)
    except httpx.HTTPError:
        return False
