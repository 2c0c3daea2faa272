"""Faults of a server's start and reuse on a busy host: a port held by a server still loading, a port taken between the
probe and the server's bind, one configuration's slow start beside another's cells, and a step of the wall clock.

Each runs ``server.ensure`` as a cell job does (under the configuration's lease), with the stand-in server process
(tests/helpers/fake_server.py) under servegrid's real supervisor: what is checked is servegrid's own handling of
ports, records and locks, which no engine changes. The four checks of helpers.faults: the time to the outcome, no
half-written file, no process left once the servers are stopped, and the next start (the same call again) working.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from helpers import fake_spec
from helpers.faults import half_written, wait_for, wait_no_survivors
from servegrid.serving import launch, procs, server, state

pytestmark = pytest.mark.exclusive  # starts timed against each other


def port_of(url: str) -> int:
    return int(urlsplit(url).port or 0)


def held_like_a_loading_vllm(port: int) -> socket.socket:
    """A socket bound to ``port`` and not listening, with the options vLLM's API servers bind with before they load
    (SO_REUSEADDR, and SO_REUSEPORT with several API servers: vllm/entrypoints/launchers/launcher.py)."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(("127.0.0.1", port))
    return held


def all_stopped(sandbox: server.Runtime, tmp_path: Path) -> None:
    """Checks (2) and (3)."""
    server.stop_all(sandbox, reason="fault test")
    assert half_written(tmp_path) == []
    assert all(not row["alive"] for row in server.status(sandbox))
    assert wait_no_survivors(tmp_path, 10) == []


def test_a_port_a_loading_server_holds_is_never_shared(sandbox, tmp_path, matrix):
    """The range's first port is bound, not yet listening, as a vLLM that loads its weights holds it: a probe with
    SO_REUSEADDR could bind beside it (and the server after it). The server goes to the next port."""
    held_port = sandbox.port_range[0]
    with held_like_a_loading_vllm(held_port):
        assert not launch.port_bindable(sandbox, held_port)
        started = time.monotonic()
        with server.lease("fake", sandbox):
            facts = server.ensure(fake_spec(), sandbox, owner=None)
        took = time.monotonic() - started
        assert port_of(facts.url) != held_port
        matrix.record("port-held-while-loading", took, "the start, on the next port")
        all_stopped(sandbox, tmp_path)
    # (4) The port free again, the next start takes it.
    with server.lease("fake", sandbox):
        assert port_of(server.ensure(fake_spec(), sandbox, owner=None).url) == held_port
    all_stopped(sandbox, tmp_path)


def left_in_time_wait(port: int) -> None:
    """Leave connections on local ``port`` in TIME_WAIT, as a server that closed its clients' connections first
    leaves them when it ends (the kernel keeps them a minute)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its end of the connection waits out TIME_WAIT
            client.recv(1)


def test_a_port_in_time_wait_is_used_at_once(sandbox, tmp_path, matrix):
    """Issue 42: the previous server's connections in TIME_WAIT failed the strict probe for a minute, and with a
    one-port range (docs/gateway.md advises one for an existing gateway) the next configuration could not start."""
    port = sandbox.port_range[0]
    one_port = dataclasses.replace(sandbox, port_range=(port, port))
    left_in_time_wait(port)
    with socket.socket() as strict, pytest.raises(OSError):  # what the strict probe alone met
        strict.bind(("127.0.0.1", port))
    started = time.monotonic()
    with server.lease("fake", one_port):
        facts = server.ensure(fake_spec(), one_port, owner=None)
    took = time.monotonic() - started
    assert port_of(facts.url) == port
    matrix.record("port-in-time-wait", took, "the start, on that port")
    all_stopped(one_port, tmp_path)
    with server.lease("fake", one_port):  # (4)
        assert port_of(server.ensure(fake_spec(), one_port, owner=None).url) == port
    all_stopped(one_port, tmp_path)


def test_a_port_taken_between_the_probe_and_the_bind_is_retried_once_on_another(sandbox, tmp_path, matrix, caplog):
    """Another process binds the server's port while the server starts (here: as soon as its record names the
    port, during the stand-in's 2 s before it binds). The server exits with 'Address already in use'; servegrid
    says so and starts it once more, on another port."""
    caplog.set_level(logging.WARNING, logger="servegrid.serving.server")
    record_path = state.record_path(sandbox, "fake")
    taken: list[socket.socket] = []

    def take_its_port() -> None:
        assert wait_for(lambda: (state.read(record_path) or {}).get("port") is not None, 20)
        thief = socket.socket()
        thief.bind(("127.0.0.1", state.read(record_path)["port"]))
        thief.listen()
        taken.append(thief)

    thief = threading.Thread(target=take_its_port)
    thief.start()
    started = time.monotonic()
    try:
        with server.lease("fake", sandbox):
            facts = server.ensure(fake_spec("fake", "--startup-delay", "2"), sandbox, owner=None)
        took = time.monotonic() - started
        thief.join(5)
        assert taken and port_of(facts.url) != taken[0].getsockname()[1]
        assert "server fake: start-up failed for a passing reason, starting it once more" in caplog.text
        assert "its port was taken by another process in between" in caplog.text
        matrix.record("port-raced", took, "two starts of the stand-in, 2 s each")
        all_stopped(sandbox, tmp_path)
        # (4)
        with server.lease("fake", sandbox):
            server.ensure(fake_spec(), sandbox, owner=None)
        all_stopped(sandbox, tmp_path)
    finally:
        for sock in taken:
            sock.close()


def test_a_slow_start_blocks_no_other_configuration(sandbox, tmp_path, matrix):
    """Configuration 'slow' (GPU 0) cannot turn healthy until the test lets it; meanwhile 'quick' (GPU 1) starts, is
    reused by its next cell and stops: the host's state lock is not held through another configuration's start.
    (A gate, not a delay: on a loaded machine quick's own start may take longer than any fixed delay of slow's.)"""
    slow = dataclasses.replace(sandbox, gpus=[0], startup_timeout_s=120)
    quick = dataclasses.replace(sandbox, gpus=[1])
    gate = tmp_path / "let-slow-start"
    done: dict[str, server.ServerFacts] = {}

    def start_slow() -> None:
        with server.lease("slow", slow):
            done["slow"] = server.ensure(fake_spec("slow", "--start-when", str(gate)), slow, owner=None)

    starting = threading.Thread(target=start_slow)
    starting.start()
    try:
        assert wait_for(lambda: (state.read(state.record_path(sandbox, "slow")) or {}).get("status") == "running", 20)
        started = time.monotonic()
        with server.lease("quick", quick):
            first = server.ensure(fake_spec("quick"), quick, owner=None)
        with server.lease("quick", quick):
            again = server.ensure(fake_spec("quick"), quick, owner=None)
        server.stop("quick", quick)
        took = time.monotonic() - started
        # slow cannot be healthy before the gate opens, so quick finished without waiting for slow's start
        # exactly when slow is still starting now
        slow_still_starting = starting.is_alive() and "slow" not in done
    finally:
        gate.touch()
        starting.join(60)
    assert slow_still_starting, f"'quick' waited for 'slow' to finish its start ({took:.1f} s)"
    assert again.session == first.session
    assert done["slow"].configuration == "slow"
    matrix.record(
        "slow-start-beside-others", took, "another configuration's start, reuse and stop, beside a start held open"
    )
    all_stopped(sandbox, tmp_path)
    # (4)
    with server.lease("quick", quick):
        server.ensure(fake_spec("quick"), quick, owner=None)
    all_stopped(sandbox, tmp_path)


def test_a_wall_clock_step_stops_no_server(sandbox, tmp_path, matrix, monkeypatch):
    """A server up under its supervisor, its owner this process; then the wall clock steps by 1 s, as psutil sees it
    (its boot time, which it adds to every start time, moves: an NTP step, a VM's resume, ``date``). The next cell's
    ensure must find the same server, under the same supervisor, its owner alive: nothing stops, nothing restarts.
    """
    import psutil

    owner = procs.ProcessRef.of(os.getpid())
    with server.lease("fake", sandbox):
        first = server.ensure(fake_spec(), sandbox, owner=owner)
    record = state.read(state.record_path(sandbox, "fake"))
    created = psutil.Process(record["server"]["pid"]).create_time()
    stepped = psutil.boot_time() + 1.0
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
    assert psutil.Process(record["server"]["pid"]).create_time() == pytest.approx(created + 1.0)  # the step is seen
    started = time.monotonic()
    monkeypatch.setenv(server.OWNER_ENV, server.owner_token(owner))
    assert server.owner_from_env() == owner  # a job started after the step still knows its Snakemake
    with server.lease("fake", sandbox):
        again = server.ensure(fake_spec(), sandbox, owner=owner)
    took = time.monotonic() - started
    assert again.session == first.session and state.supervised(state.read(state.record_path(sandbox, "fake")))
    matrix.record("clock-step", took, "the next cell's reuse of the server, after a 1 s step")
    all_stopped(sandbox, tmp_path)
    # (4)
    with server.lease("fake", sandbox):
        server.ensure(fake_spec(), sandbox, owner=owner)
    all_stopped(sandbox, tmp_path)
