"""Process management with a stand-in server process (tests/helpers/fake_server.py).

The same guarantees are checked against real vLLM in tests/integration.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest

from helpers import fake_spec
from servegrid.errors import ServerError
from servegrid.serving import procs, server, state

pytestmark = pytest.mark.exclusive  # process lifecycles with deadlines


def _group_alive(pgid: int) -> list[int]:
    return [p.pid for p in procs.group_members(pgid)]


def _record(runtime: server.Runtime, name: str) -> dict:
    return server.status(runtime)[[r["configuration"] for r in server.status(runtime)].index(name)]


def test_start_reuse_and_stop_take_the_whole_tree(sandbox):
    facts = server.ensure(fake_spec(), sandbox, owner=None)
    assert facts.kv_cache_tokens == 12345
    assert facts.max_concurrency == pytest.approx(3.01)
    assert facts.engine_version == "fake-0"
    assert facts.argv[-2:] != ["--host"] and "--served-model-name" in facts.argv
    assert Path(facts.log_path).is_file() and str(facts.log_path).startswith("results/servers/fake/logs/")
    pgid = _record(sandbox, "fake")["pgid"]
    assert len(_group_alive(pgid)) == 2  # the server and its "engine" child

    again = server.ensure(fake_spec(), sandbox, owner=None)
    assert again.session == facts.session  # reused, not restarted

    outcome = server.stop("fake", sandbox)
    assert outcome[0]["was_running"] and outcome[0]["left_running"] == []
    assert _group_alive(pgid) == []


def test_changed_spec_replaces_the_server(sandbox):
    first = server.ensure(fake_spec("fake"), sandbox, owner=None)
    second = server.ensure(fake_spec("fake", "--startup-delay", "0.1"), sandbox, owner=None)
    assert second.session != first.session
    assert procs.ProcessRef.from_dict(_record(sandbox, "fake")["server"]) is not None


def test_a_server_that_exits_at_start_fails_within_seconds_with_its_log(sandbox):
    started = time.monotonic()
    with pytest.raises(ServerError) as error:
        server.ensure(fake_spec("fake", "--exit-at-start"), sandbox, owner=None)
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert "exited during start-up (exit code 2" in message
    assert "invalid choice (fake server exiting)" in message  # the log tail
    assert "results/servers/fake/logs/" in message


def test_the_same_failure_is_not_retried_within_one_owner(sandbox):
    owner = procs.ProcessRef.of(os.getpid())
    with pytest.raises(ServerError):
        server.ensure(fake_spec("fake", "--exit-at-start"), sandbox, owner=owner)
    started = time.monotonic()
    with pytest.raises(ServerError, match="failed earlier in this run"):
        server.ensure(fake_spec("fake", "--exit-at-start"), sandbox, owner=owner)
    assert time.monotonic() - started < 1


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped(sandbox, caplog, monkeypatch):
    from servegrid import progress

    monkeypatch.setattr(progress, "INTERVAL_S", 0.5)  # every 10 s in a real run
    # 8 s: the stand-in prints its first lines 0.1 s after its start, but a clean-clone run of 2026-12-07 (the machine
    # slow: a 30 s fixture took 73 s) found its log still empty after 3 s.
    sandbox.startup_timeout_s = 8
    with caplog.at_level("INFO"), pytest.raises(ServerError, match=r"did not become healthy within 8 s") as error:
        server.ensure(fake_spec("fake", "--never-healthy"), sandbox, owner=None)
    assert "CPU KV cache size" in str(error.value)
    pgid = _record(sandbox, "fake")["pgid"]
    assert _group_alive(pgid) == []
    # Meanwhile it said, every so often, how long it had waited and what the server's log last said.
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("server fake starting: ")]
    assert len(waits) >= 3 and all(" of at most 8 s; its log says: " in w for w in waits)
    assert any("CPU KV cache size" in w for w in waits)


def test_an_unexecutable_command_fails_fast(sandbox):
    spec = fake_spec()
    spec["command"] = ["/nonexistent/vllm", "{model}"]
    with pytest.raises(ServerError, match="exited during start-up"):
        server.ensure(spec, sandbox, owner=None)


def test_no_free_port_is_reported(sandbox):
    import socket

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        sandbox.port_range = (port, port)
        with pytest.raises(ServerError, match=f"no free port in operations.port_range {port}-{port}: each is in use"):
            server.ensure(fake_spec(), sandbox, owner=None)


def test_sigterm_resistant_servers_are_killed(sandbox):
    server.ensure(fake_spec("fake", "--ignore-sigterm"), sandbox, owner=None)
    pgid = _record(sandbox, "fake")["pgid"]
    started = time.monotonic()
    server.stop("fake", sandbox)
    assert _group_alive(pgid) == []
    assert time.monotonic() - started < sandbox.shutdown_timeout_s + 10


def test_servers_die_with_their_owner_even_on_sigkill(sandbox):
    owner_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        owner = procs.ProcessRef.of(owner_proc.pid)
        server.ensure(fake_spec(), sandbox, owner=owner)
        record = _record(sandbox, "fake")
        owner_proc.send_signal(signal.SIGKILL)
        owner_proc.wait()
        deadline = time.monotonic() + 15
        while _record(sandbox, "fake")["status"] != "stopped" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group_alive(record["pgid"]) == []
        assert _record(sandbox, "fake")["status"] == "stopped"
        assert "owner process" in _record(sandbox, "fake")["end_reason"]
    finally:
        owner_proc.kill()


def test_supervisor_gone_the_server_is_still_stopped(sandbox):
    # A server that ignores the SIGTERM its supervisor's death sends it (see the test below) stays orphaned.
    server.ensure(fake_spec("fake", "--ignore-sigterm"), sandbox, owner=None)
    record = _record(sandbox, "fake")
    supervisor = psutil.Process(record["supervisor"]["pid"])
    os.kill(supervisor.pid, signal.SIGKILL)
    supervisor.wait(10)  # gone: had it taken the server with it, that would have been on its way out
    assert _group_alive(record["pgid"])  # orphaned, still serving
    server.stop_all(sandbox)
    assert _group_alive(record["pgid"]) == []


def test_cpu_servers_take_turns(sandbox):
    server.ensure(fake_spec("one"), sandbox, owner=None)
    first_pgid = _record(sandbox, "one")["pgid"]
    server.ensure(fake_spec("two"), sandbox, owner=None)
    assert _group_alive(first_pgid) == []
    assert _record(sandbox, "two")["alive"]


def test_gpu_servers_on_disjoint_devices_coexist(sandbox):
    sandbox.gpus = [0]
    server.ensure(fake_spec("one"), sandbox, owner=None)
    sandbox.gpus = [1]
    server.ensure(fake_spec("two"), sandbox, owner=None)
    assert _record(sandbox, "one")["alive"] and _record(sandbox, "two")["alive"]
    sandbox.gpus = [1, 2]
    server.ensure(fake_spec("three"), sandbox, owner=None)
    assert _record(sandbox, "one")["alive"]
    assert not _record(sandbox, "two")["alive"]


def test_placement_and_secrets_in_the_launch_command(monkeypatch):
    spec, runtime = fake_spec(), server.Runtime()
    assert "CUDA_VISIBLE_DEVICES" not in server.launch_command(spec, runtime, 8000)[1]
    runtime.gpus = [2, 3]
    argv, env = server.launch_command(spec, runtime, 8000)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert argv[argv.index("--port") + 1] == "8000" and argv[argv.index("--served-model-name") + 1] == "fake"
    spec["api_key_env"] = "SERVEGRID_TEST_KEY"
    with pytest.raises(ServerError, match="SERVEGRID_TEST_KEY"):
        server.launch_command(spec, runtime, 8000)
    monkeypatch.setenv("SERVEGRID_TEST_KEY", "s3cret")
    argv, env = server.launch_command(spec, runtime, 8000)
    assert "s3cret" not in json.dumps([argv, env]) and "***" in env.values()
    assert server.auth_headers(spec) == {"Authorization": "Bearer s3cret"}


def test_the_api_key_reaches_the_server_alone(sandbox, monkeypatch):
    monkeypatch.setenv("SERVEGRID_TEST_KEY", "s3cret")
    spec = fake_spec()
    spec["api_key_env"] = "SERVEGRID_TEST_KEY"
    facts = server.ensure(spec, sandbox, owner=None)
    server_pid = _record(sandbox, "fake")["server"]["pid"]
    assert psutil.Process(server_pid).environ()["VLLM_API_KEY"] == "s3cret"  # the server has it...
    launch_file = state.launch_path(sandbox, "fake")
    assert launch_file.stat().st_mode & 0o777 == 0o600
    for path in state.directory(sandbox).iterdir():  # ...and no file does: it came through the environment
        assert "s3cret" not in path.read_text(), path
    assert "s3cret" not in json.dumps(asdict(facts)) and "***" in facts.env.values()


def test_supervisor_and_server_live_in_their_own_sessions(sandbox):
    server.ensure(fake_spec(), sandbox, owner=None)
    record = _record(sandbox, "fake")
    assert os.getsid(record["supervisor"]["pid"]) != os.getsid(0)
    assert os.getpgid(record["server"]["pid"]) == record["server"]["pid"]
    assert psutil.Process(record["server"]["pid"]).ppid() == record["supervisor"]["pid"]


def test_a_leased_server_is_not_stopped_under_its_cell(sandbox):
    import threading

    server.ensure(fake_spec("one"), sandbox, owner=None)
    first_pgid = _record(sandbox, "one")["pgid"]
    released = threading.Event()

    holding = threading.Event()

    def measuring_cell() -> None:
        with server.lease("one", sandbox):
            holding.set()
            time.sleep(2.0)  # the cell measures for 2 s: how long the rival must wait, not a wait for an event
            assert _group_alive(first_pgid), "stopped while a cell was using it"
        released.set()

    worker = threading.Thread(target=measuring_cell)
    worker.start()
    assert holding.wait(10), "the cell never took its lease"
    started = time.monotonic()
    server.ensure(fake_spec("two"), sandbox, owner=None)  # a CPU server: competes with "one"
    waited = time.monotonic() - started
    worker.join()
    assert released.is_set() and waited >= 1.5
    assert _group_alive(first_pgid) == []


def test_stop_waits_for_the_cell_that_holds_the_lease(sandbox):
    import threading

    server.ensure(fake_spec("one"), sandbox, owner=None)
    pgid = _record(sandbox, "one")["pgid"]
    alive_at_release = []

    holding = threading.Event()

    def measuring_cell() -> None:
        with server.lease("one", sandbox):
            holding.set()
            time.sleep(1.0)  # the cell measures for 1 s: the stop must wait that long
            alive_at_release.append(bool(_group_alive(pgid)))

    worker = threading.Thread(target=measuring_cell)
    worker.start()
    assert holding.wait(10), "the cell never took its lease"
    server.stop("one", sandbox)
    worker.join()
    assert alive_at_release == [True]
    assert _group_alive(pgid) == []


def test_a_stale_record_never_signals_a_process_that_is_not_the_servers(sandbox):
    """After a reboot (or long after the server exited) a recorded pid and group can be someone else's:
    `server down` must leave them alone, since they do not carry the server's session."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record = {
            "session": "20261201T000000-dead00",
            "configuration": "gone",
            "spec_hash": "x",
            "url": "http://127.0.0.1:1",
            "port": 1,
            "gpus": [],
            "argv": ["vllm"],
            "log_path": "x.log",
            "owner": None,
            # Its pid, another process's start: one record as servegrid writes them, one as an older one did.
            "supervisor": {"pid": stranger.pid, "start_ticks": 1, "boot": procs.boot_id()},
            "server": {"pid": stranger.pid, "create_time": 1.0},
            "pgid": stranger.pid,
            "status": "running",
        }
        state.record_path(sandbox, "gone").write_text(json.dumps(record))
        outcomes = server.stop_all(sandbox, reason="test")
        assert [o["left_running"] for o in outcomes] == [[]]
        time.sleep(0.5)
        assert stranger.poll() is None, "a process that never carried the session was signalled"
    finally:
        stranger.kill()
        stranger.wait()


def test_no_server_is_started_for_an_owner_that_is_gone(sandbox, monkeypatch):
    """Snakemake killed while the next cell job was starting: that job must not start an ownerless server."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setenv(server.OWNER_ENV, f"{gone.pid}:1:{procs.boot_id()}")
    gone_message = r"the Snakemake process \(SERVEGRID_OWNER=\d+:1:[0-9a-f-]+\) that runs this job is gone"
    with pytest.raises(ServerError, match=gone_message):
        server.owner_from_env()
    # Alive, but not the process that started the run: its pid was reused (the start time differs).
    me = procs.ProcessRef.of(os.getpid())
    monkeypatch.setenv(server.OWNER_ENV, f"{me.pid}:{me.start_ticks - 5}:{me.boot}")
    with pytest.raises(ServerError, match=r"that runs this job is gone"):
        server.owner_from_env()
    monkeypatch.setenv(server.OWNER_ENV, server.owner_token(me))
    assert server.owner_from_env() == me
    monkeypatch.setenv(server.OWNER_ENV, "1234")
    with pytest.raises(ServerError, match=r"SERVEGRID_OWNER='1234' is not 'pid:start-ticks:boot-id'"):
        server.owner_from_env()
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ref = procs.ProcessRef.of(owner.pid)
    owner.kill()
    owner.wait()
    with pytest.raises(ServerError, match=r"the process that owns this run \(pid \d+\) is gone: no server is started"):
        server.ensure(fake_spec(), sandbox, owner=ref)
    assert server.status(sandbox) == []


def test_the_server_goes_when_its_supervisor_is_sigkilled(sandbox):
    server.ensure(fake_spec(), sandbox, owner=None)
    record = _record(sandbox, "fake")
    members = procs.group_members(record["pgid"])
    assert len(members) == 2  # the "API server" and its "engine core"
    os.kill(record["supervisor"]["pid"], signal.SIGKILL)
    _, alive = psutil.wait_procs(members, timeout=10)
    assert alive == [], "the server outlived its SIGKILLed supervisor"


def test_a_watch_fires_once_when_its_process_goes():
    import threading

    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    fired = threading.Event()
    stop = procs.watch(procs.ProcessRef.of(target.pid), fired.set, interval_s=0.05)
    assert not fired.wait(0.3)
    target.kill()
    target.wait()
    assert fired.wait(5)
    stop.set()


def test_a_watch_with_a_grace_leaves_work_that_ends_on_its_own_alone():
    """A cell whose server died with its engine (and its supervisor with it) ends on its own and records the death; the
    supervisor's watch waits its grace before stopping the cell (a pytest worker was SIGTERMed without it)."""
    import threading

    fired = threading.Event()
    for ends_on_its_own in (True, False):
        fired.clear()
        target = subprocess.Popen([sys.executable, "-c", "pass"])
        stop = procs.watch(procs.ProcessRef.of(target.pid), fired.set, interval_s=0.05, grace_s=1.0)
        target.wait()
        time.sleep(0.3)  # gone and seen: the grace runs
        if ends_on_its_own:
            stop.set()
            assert not fired.wait(1.5)
        else:
            assert fired.wait(5)
            stop.set()


def test_a_healthy_server_that_is_not_the_one_launched_is_never_used(sandbox):
    """Another process answering on the port (another pipeline's server) is refused, not measured."""
    refused = r"answers, but as \['someone-else'\], not as the server for configuration 'fake' that servegrid just "
    refused += r"launched \(servegrid-\d{8}T\d{6}-\w+\): another process holds that port"
    with pytest.raises(ServerError, match=refused):
        server.ensure(fake_spec("fake", "--answer-as", "someone-else"), sandbox, owner=None)
    assert _group_alive(_record(sandbox, "fake")["pgid"]) == []  # and what was launched is stopped


def test_a_hung_server_is_replaced_not_reused(sandbox, caplog):
    """Health 200 but the engine stuck: the next cell gets a fresh server within the liveness limit
    (10 × the start-up warm-up, at least operations.stall_floor_s)."""
    sandbox.liveness_floor_s = 1.0
    spec = fake_spec("fake", "--hang-after", "1")  # the warm-up is answered, nothing after it
    first = server.ensure(spec, sandbox, owner=None)
    started = time.monotonic()
    second = server.ensure(spec, sandbox, owner=None)
    assert second.session != first.session
    assert time.monotonic() - started < 10
    assert f"server session {first.session} of configuration 'fake' did not complete a tiny request" in caplog.text


def other_pipeline(sandbox, tmp_path, **changes):  # type: ignore[no-untyped-def]
    """The runtime of a second pipeline on this host: its own state directory, the same host."""
    import dataclasses

    return dataclasses.replace(sandbox, state_dir=str(tmp_path / "other-state"), **changes)


def test_two_pipelines_never_share_a_port(sandbox, tmp_path):
    single = (sandbox.port_range[0], sandbox.port_range[0])
    mine = other_pipeline(sandbox, tmp_path / "a", port_range=single)
    theirs = other_pipeline(sandbox, tmp_path / "b", port_range=single)
    try:
        first = server.ensure(fake_spec(), mine, owner=None)
        with pytest.raises(ServerError, match=r"no free port in operations.port_range .*claimed by another servegrid"):
            server.ensure(fake_spec(), theirs, owner=None)
        assert server.ensure(fake_spec(), mine, owner=None).session == first.session  # still there, still reused
    finally:
        server.stop_all(mine)
        server.stop_all(theirs)


def test_two_pipelines_never_share_a_gpu(sandbox, tmp_path):
    mine = other_pipeline(sandbox, tmp_path / "a", gpus=[0])
    theirs = other_pipeline(sandbox, tmp_path / "b", gpus=[0])
    try:
        server.ensure(fake_spec(), mine, owner=None)
        with pytest.raises(
            ServerError,
            match=r"GPU 0 is in use by another servegrid pipeline's server \(servegrid "
            r"session \d{8}T\d{6}-\w+ of ",
        ):
            server.ensure(fake_spec(), theirs, owner=None)
        server.stop_all(mine)  # its supervisor ends: the kernel releases the claim
        server.ensure(fake_spec(), theirs, owner=None)
    finally:
        server.stop_all(mine)
        server.stop_all(theirs)


def test_a_claim_whose_holder_is_ending_is_waited_for_and_one_held_on_is_refused():
    """Measured on a 2-core VM: a claim was refused right after its supervisor was gone from every process's open
    files, and granted 1 ms later. The claim must not be refused on such a moment, nor wait on a live holder."""
    from servegrid.serving import hostlocks

    ending = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(float(sys.argv[2]))"
    )
    claim = hostlocks.lock_dir() / f"{hostlocks.gpu_claim(7)}.lock"
    for lasts_s, granted in ((0.3, True), (hostlocks.EXITING_HOLDER_GRACE_S + 3, False)):
        holder = subprocess.Popen([sys.executable, "-c", ending, str(claim), str(lasts_s)], stdout=subprocess.PIPE)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            asked = time.monotonic()
            if granted:
                with hostlocks.claims([7], [1], lambda port: True, "this pipeline") as (port, fds):
                    assert port == 1 and len(fds) == 2
            else:
                refused = pytest.raises(ServerError, match="GPU 7 is in use")
                with refused, hostlocks.claims([7], [1], lambda port: True, "this pipeline"):
                    pass
                assert time.monotonic() - asked >= hostlocks.EXITING_HOLDER_GRACE_S
        finally:
            holder.kill()
            holder.wait()


def test_a_claims_directory_that_is_not_the_users_alone_is_refused(tmp_path, monkeypatch):
    from servegrid.serving import hostlocks

    shared = tmp_path / "claims"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as another user's, or a careless one, in a shared /tmp
    monkeypatch.setenv("SERVEGRID_LOCK_DIR", str(shared))
    with pytest.raises(
        ServerError, match=r"host-wide claims: .*claims is not a directory of this user's with mode 0700"
    ):
        hostlocks.lock_dir()
    link = tmp_path / "link"
    link.symlink_to(shared)
    monkeypatch.setenv("SERVEGRID_LOCK_DIR", str(link))
    with pytest.raises(ServerError, match="host-wide claims"):
        hostlocks.lock_dir()


def test_a_server_that_exited_while_its_supervisor_winds_down_is_replaced(sandbox):
    """The server gone, its supervisor not yet: the next cell waits it out instead of failing on its claims."""
    first = server.ensure(fake_spec("fake"), sandbox, owner=None)
    record = _record(sandbox, "fake")
    engine = int(re.search(r"engine child pid (\d+)", Path(record["log_path"]).read_text())[1])
    os.kill(record["server"]["pid"], signal.SIGKILL)  # its engine child lives on: the supervisor must clean up
    second = server.ensure(fake_spec("fake"), sandbox, owner=None)
    assert second.session != first.session
    assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE


def test_an_engine_that_renamed_itself_is_stopped_when_its_server_is_killed(sandbox):
    """vLLM's engine core renames itself, which blanks the environment /proc shows (no session to read);
    orphaned by a SIGKILLed API server, it is still found, by the pid and start time its supervisor recorded."""
    import re

    from helpers.faults import wait_for

    server.ensure(fake_spec("fake"), sandbox, owner=None)
    record = _record(sandbox, "fake")
    engine = int(re.search(r"engine child pid (\d+)", Path(record["log_path"]).read_text())[1])
    assert not procs.in_session(psutil.Process(engine), record["session"])  # as with vLLM: unreadable
    assert wait_for(lambda: {"pid": engine} in [{"pid": m["pid"]} for m in _record(sandbox, "fake")["members"]], 10)
    os.kill(record["server"]["pid"], signal.SIGKILL)
    assert wait_for(lambda: not psutil.pid_exists(engine) or psutil.Process(engine).status() == "zombie", 15)
    assert wait_for(lambda: _record(sandbox, "fake")["status"] == "exited", 10)


def test_a_wall_clock_step_stops_nothing(monkeypatch):
    """A 1 s step of the wall clock (NTP, a VM's resume, `date`) moves the boot time psutil adds to every start
    time: an identity kept as an epoch time would call every live process another one, and stop every server.
    Identities are the kernel's start ticks and the boot's id, which no clock step touches."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ref = procs.ProcessRef.of(child.pid)
        before = psutil.Process(child.pid).create_time()
        stepped = psutil.boot_time() + 1.0
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)  # what a +1 s step does to psutil
        assert psutil.Process(child.pid).create_time() == pytest.approx(before + 1.0)  # the epoch time moved
        assert ref.alive() and procs.ProcessRef.from_dict(ref.to_dict()) == ref
        monkeypatch.setenv(server.OWNER_ENV, server.owner_token(ref))
        assert server.owner_from_env() == ref  # a job started after the step still knows its Snakemake
        assert ref in procs.tree(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not ref.alive()
    me = procs.ProcessRef.of(os.getpid())
    assert me.alive() and not procs.ProcessRef(me.pid, me.start_ticks, "another-boot").alive()  # after a reboot
