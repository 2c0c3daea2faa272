"""The HTTP client of every control call (health, warm-up, metrics, tokenize, the gateway's check): httpx,
never through a proxy.

Every server and gateway servegrid calls is one it launched on this host. httpx honours ``http_proxy`` and
``all_proxy`` unless told not to: on a cluster that sets them for downloads, a healthy vLLM on 127.0.0.1 would be
asked through the proxy, and start-up would wait out ``startup_timeout_s`` ("did not become healthy within
1800 s"). The measured streams (aiohttp) never read proxy variables either.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx


def control_client(timeout: float, headers: Mapping[str, str] | None = None) -> httpx.Client:
    """An httpx client that ignores the environment's proxy variables (``trust_env=False``)."""
    return httpx.Client(timeout=timeout, headers=dict(headers or {}), trust_env=False)


def async_control_client(timeout: float | httpx.Timeout, headers: Mapping[str, str] | None = None) -> httpx.AsyncClient:
    """The same, for control calls made beside the measured streams (the metrics scrape): on aiohttp's transport,
    one event loop and one HTTP stack for both (``trust_env=False`` as well). Imported here: the servers'
    and the jobs' start-up never load aiohttp (tests/unit/test_architecture.py)."""
    from httpx_aiohttp import HttpxAiohttpClient

    return HttpxAiohttpClient(timeout=timeout, headers=dict(headers or {}), trust_env=False)
