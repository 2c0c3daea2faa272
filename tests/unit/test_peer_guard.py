"""Issue 42, item 11: outside the OpenAI API, a vLLM server servegrid starts answers its own user only
(servegrid/engines/in_vllm/servegrid_peer_guard.py, run inside vLLM as an ASGI middleware).

Real loopback connections, one from another user (``nobody``, which the tests switch to as root); the guard in real
vLLM, during a cell, is tested in tests/integration/test_hybrid_on_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from helpers import ANOTHER_USER, as_another_user

guard = importlib.import_module("servegrid.engines.in_vllm.servegrid_peer_guard")

DEV_ROUTES = ("/reset_prefix_cache", "/sleep", "/collective_rpc", "/server_info", "/pause", "/tokenize")


@contextlib.contextmanager
def connection(family: int = socket.AF_INET, host: str = "127.0.0.1", user: int | None = None) -> Iterator[Any]:
    """(peer, listener) of an open loopback connection, its client end in this process or in another user's."""
    with socket.socket(family) as listener:
        listener.bind((host, 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        client = None
        if user is None:
            client = socket.create_connection((host, port))
        else:
            code = f"import socket,sys; s=socket.create_connection(({host!r},{port})); sys.stdin.read()"
            client = as_another_user(["python3", "-c", code], stdin=subprocess.PIPE)
        accepted, peer = listener.accept()
        try:
            yield peer[:2], listener.getsockname()[:2]
        finally:
            accepted.close()
            if isinstance(client, socket.socket):
                client.close()
            else:
                client.communicate(b"", timeout=10)


def call(scope_path: str, peer: tuple[str, int], listener: tuple[str, int]) -> tuple[bool, list[dict[str, Any]]]:
    """Run the guard on one request: (whether the app behind it was called, what the guard itself sent)."""
    reached, sent = [], []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "POST", "path": scope_path, "client": list(peer), "server": list(listener)}
    asyncio.run(guard.PeerGuard(app)(scope, receive, send))
    return bool(reached), sent


def test_the_socket_tables_name_the_user_at_the_other_end():
    with connection() as (peer, listener):
        assert guard.peer_uid(peer, listener) == os.getuid()
        assert guard.peer_uid(listener, peer) == os.getuid()  # the server's own end: the same user
        assert guard.peer_uid((peer[0], peer[1] ^ 1), listener) is None  # no such connection


def test_an_ipv6_loopback_peer_is_found_too():
    try:
        ipv6 = socket.socket(socket.AF_INET6)
        ipv6.bind(("::1", 0))
        ipv6.close()
    except OSError as missing:
        pytest.skip(f"this host has no IPv6 loopback: {missing}")
    with connection(socket.AF_INET6, "::1") as (peer, listener):
        assert guard.peer_uid(peer, listener) == os.getuid()


@pytest.mark.skipif(os.getuid() != 0, reason="connecting as another user needs root")
def test_another_users_connection_is_named_as_theirs():
    with connection(user=ANOTHER_USER) as (peer, listener):
        assert guard.peer_uid(peer, listener) == ANOTHER_USER


@pytest.mark.skipif(os.getuid() != 0, reason="connecting as another user needs root")
@pytest.mark.parametrize("path", DEV_ROUTES)
def test_another_user_is_refused_every_route_outside_the_openai_api(path):
    with connection(user=ANOTHER_USER) as (peer, listener):
        reached, sent = call(path, peer, listener)
        assert not reached and sent[0]["status"] == 403, sent
        assert b"its own user only" in sent[1]["body"]
        # The health checks, the metrics and the API (behind vLLM's key) stay open to monitoring and clients.
        for open_path in ("/health", "/metrics", "/v1/completions", "/v1/chat/completions"):
            assert call(open_path, peer, listener) == (True, []), open_path
    with connection() as (peer, listener):
        assert call(path, peer, listener) == (True, [])


def test_a_peer_the_tables_do_not_hold_is_refused():
    """Another host, another network namespace, a Unix socket's peer: nobody vouches for it."""
    with connection() as (peer, listener):
        assert call("/sleep", ("10.9.8.7", peer[1]), listener)[0] is False
        assert call("/sleep", ("unix-socket", 0), listener)[0] is False
        assert call("/sleep", peer, listener)[0] is True


def test_every_vllm_server_is_started_with_the_guard_first_on_its_path(monkeypatch):
    from servegrid.engines.vllm import PEER_GUARD, PEER_GUARD_DIR, VLLMEngine

    engine = VLLMEngine()
    argv = engine.argv(["vllm", "serve", "{model}"], "m", ["m"], "127.0.0.1", 8000, ["--middleware", "mine.Mw"])
    # vLLM's flag appends: the guard and a configuration's own middleware both apply.
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--middleware"] == [PEER_GUARD, "mine.Mw"]
    assert (PEER_GUARD_DIR / (PEER_GUARD.split(".")[0] + ".py")).is_file()
    monkeypatch.setenv("PYTHONPATH", "/host/site")
    assert engine.server_env({}, [], None)["PYTHONPATH"] == f"{PEER_GUARD_DIR}{os.pathsep}/host/site"
    configured = engine.server_env({"PYTHONPATH": "/config/site"}, [], None)  # the configuration's own wins
    assert configured["PYTHONPATH"] == f"{PEER_GUARD_DIR}{os.pathsep}/config/site"
    monkeypatch.delenv("PYTHONPATH")
    assert engine.server_env({}, [], None)["PYTHONPATH"] == str(PEER_GUARD_DIR)
