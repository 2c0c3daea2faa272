"""Runs inside vLLM's API server, not in servegrid: every route outside the OpenAI API answers the server's own user
only.

vLLM's API key guards ``/v1`` (``/v2``, ``/inference``, ``/cohere``) and nothing else. With ``VLLM_SERVER_DEV_MODE=1``,
which servegrid's cache reset needs, ``/reset_prefix_cache``, ``/sleep``, ``/collective_rpc`` and ``/server_info``
answer anyone who can reach the port (issue 42, reproduced on vLLM 0.32), and so do the RL routes dev mode mounts
(``/pause``, ``/update_weights``: vllm/entrypoints/rl/online/api_router.py). servegrid starts vLLM with
``--middleware servegrid_peer_guard.PeerGuard`` (vLLM adds a class named there as an ASGI middleware:
vllm/entrypoints/serve/middleware/register.py) and this folder on ``PYTHONPATH``: a request to any other path is
answered 403 unless the socket it came from belongs to the user the server runs as. On loopback TCP the kernel's
socket tables (``/proc/net/tcp``, ``/proc/net/tcp6``) name the owner of the connection's other end; a peer not found
there (another host, another network namespace) is refused.

Why not vLLM's ``--uds`` (a Unix socket in a 0700 folder): LiteLLM, the gateway route, reaches its upstream over TCP
only (LiteLLM 1.106's http_handler.py builds a ``TCPConnector``), so the gateway route would need a second answer;
this one guards both routes. ``/v1`` stays with vLLM's API key and the cell's foreign-traffic check: a table lookup
there would add to the latency of every measured request.

Standard library only: vLLM's Python imports this file, not servegrid's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# Read-only and answered to anyone, as a host's monitoring would expect.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
API_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's AuthenticationMiddleware.GUARDED_PREFIX
SOCKET_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
ESTABLISHED = "01"  # the state column of the socket tables (include/net/tcp_states.h)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _plain(address: Address) -> Address:
    """An IPv4 address written in IPv6 (``::ffff:127.0.0.1``, how a dual-stack listener sees an IPv4 peer) as IPv4."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _endpoint(column: str) -> tuple[Address, int]:
    """``0100007F:A1B2`` → (127.0.0.1, 41394): the tables write each 32-bit word of the address in the host's byte
    order and the port in hex."""
    address_hex, port_hex = column.rsplit(":", 1)
    raw = bytes.fromhex(address_hex)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _plain(ipaddress.ip_address(raw)), int(port_hex, 16)


def peer_uid(peer: tuple[str, int], listener: tuple[str, int], tables: tuple[str, ...] = SOCKET_TABLES) -> int | None:
    """The uid that owns the socket at ``peer``, connected to ``listener`` on this host; None where no socket of this
    host's network namespace is that end of the connection."""
    wanted = tuple((_plain(ipaddress.ip_address(host)), port) for host, port in (peer, listener))
    for table in tables:
        try:
            with open(table, encoding="ascii") as rows:
                lines = rows.readlines()[1:]
        except OSError:  # no IPv6 on this host, or no /proc
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and fields[3] == ESTABLISHED and (_endpoint(fields[1]), _endpoint(fields[2])) == wanted:
                return int(fields[7])
    return None


class PeerGuard:
    """The ASGI middleware: outside :data:`OPEN_PATHS` and the OpenAI API, the server's own user only."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.uid = os.getuid()

    @staticmethod
    def open_to_all(scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return path in OPEN_PATHS or path.startswith(API_PREFIXES)

    @staticmethod
    def peer_of(scope: Scope) -> int | None:
        """The uid at the request's other end (None: not found, or not an IP peer such as a Unix socket's)."""
        client, server = scope.get("client"), scope.get("server")
        try:
            return peer_uid(tuple(client), tuple(server)) if client and server else None
        except ValueError:
            return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.open_to_all(scope):  # lifespan; /v1, /health, /metrics
            await self.app(scope, receive, send)
            return
        # Off the server's event loop: the kernel builds the socket table on each read (about 5 ms here with 15
        # sockets, measured 2026-12-07), which would hold up every stream the server is sending meanwhile.
        uid = await asyncio.to_thread(self.peer_of, scope)
        if uid == self.uid:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        who = "an unknown user" if uid is None else f"uid {uid}"
        print(
            f"servegrid peer guard: refused {scope.get('method', 'WEBSOCKET')} {scope['path']} from "
            f"{client[0]}:{client[1]} ({who}): outside the OpenAI API this server answers uid {self.uid} only",
            file=sys.stderr,
            flush=True,
        )
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = json.dumps({"error": f"Forbidden: this server answers {scope['path']} to its own user only"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 403, "headers": headers})
        await send({"type": "http.response.body", "body": body})
