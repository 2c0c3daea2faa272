#!/usr/bin/env python3
"""A real one-node Slurm cluster on localhost, with accounting, for servegrid's tests and for trying the Slurm path.

    eval "$(python3 tools/slurm_localhost.py up --dir /tmp/sg-slurm)"   # export SLURM_CONF=...; export PATH=...
    python3 tools/slurm_localhost.py status --dir /tmp/sg-slurm
    python3 tools/slurm_localhost.py down --dir /tmp/sg-slurm

`up` installs the Debian packages if a binary is missing (slurm-wlm, slurmctld, slurmd, slurmdbd, munge,
mariadb-server), then starts, each as a daemon recorded by pid and process start time in DIR/pids.json:
munged, mariadbd, slurmdbd, slurmctld and slurmd. It returns once the node is idle in `sinfo`, the cluster is
registered in the accounting database and a `sbatch --wrap true` job shows COMPLETED in `sacct` (the Snakemake
Slurm executor plugin reads job states from `sacct`, so accounting is part of "works", not an extra).

Everything — slurm.conf, cgroup.conf, slurmdbd.conf, the munge key and socket, MariaDB's data directory and
socket, Slurm's state, spool, pid and log files — lives under DIR, and nothing is written to /etc: the machine
may be shared (or already run a Slurm or MariaDB of its own), several clusters can exist side by side on other
ports, and `rm -rf DIR` after `down` leaves the system as the package install left it. The binaries find the
config through the SLURM_CONF environment variable (slurmdbd.conf and cgroup.conf are read from the same
directory), and the munge socket is named in slurm.conf (AuthInfo, AccountingStoragePass), so no munge variable
is needed. DIR/bin holds wrappers of the client commands (srun, sbatch, sacct, ...) that pin SLURM_CONF, for
callers that drop it from the environment: Snakemake's slurm-jobstep plugin does, before the `srun` inside a
job. So a client needs SLURM_CONF=DIR/slurm.conf and DIR/bin first on PATH (what `up` prints and returns).

Daemons run as root (slurmd must, to start jobs as the submitting user). A non-root caller with passwordless
`sudo -n` gets the same by this script re-running itself under sudo. Plain Python 3.11 standard library only,
so it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

PACKAGES = ("slurm-wlm", "slurmctld", "slurmd", "slurmdbd", "munge", "mariadb-server")
# binary -> the package that ships it (for the error message when it cannot be installed)
BINARIES = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "slurmdbd": "slurmdbd",
    "sinfo": "slurm-client",
    "sbatch": "slurm-client",
    "sacct": "slurm-client",
    "sacctmgr": "slurm-client",
    "scancel": "slurm-client",
    "squeue": "slurm-client",
    "munged": "munge",
    "munge": "munge",
    "unmunge": "munge",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "mariadb": "mariadb-client",
    "setsid": "util-linux",
}
# the daemons in start order; `down` stops them in reverse
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
# sbin is not on a normal user's PATH, but the daemons live there
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
# client commands that get a wrapper in DIR/bin which pins SLURM_CONF (see _write_wrappers)
CLIENTS = ("sbatch", "srun", "salloc", "sacct", "sacctmgr", "squeue", "scancel", "sinfo", "scontrol", "sstat")
DB_NAME = "slurm_acct_db"
DB_USER = "slurm"

T = TypeVar("T")


class ClusterError(RuntimeError):
    """The cluster could not be set up, checked or stopped; the message says what and where to look."""


@dataclass
class Settings:
    """What a cluster directory was set up with (DIR/cluster.json), so status/down/up again agree with it."""

    cluster: str = "servegrid"
    partition: str = "servegrid"
    ctld_port: int = 6817
    slurmd_port: int = 6818
    dbd_port: int = 6819
    # MariaDB listens on 127.0.0.1 only (slurmdbd connects over TCP: it has no socket option of its own)
    mysql_port: int = 6820
    proctrack: str = ""  # chosen by `up`: proctrack/cgroup if it works here, else proctrack/linuxproc


# --------------------------------------------------------------------------------------------- small helpers


def _say(message: str) -> None:
    # progress goes to stderr so that stdout is only the `export` line: eval "$(slurm_localhost.py up --dir D)"
    print(f"slurm_localhost: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _step(name: str, timings: dict[str, float]) -> Iterator[None]:
    started = time.monotonic()
    yield
    timings[name] = time.monotonic() - started
    _say(f"{name}: {timings[name]:.1f} s")


def _which(binary: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return shutil.which(binary, path=path)


def _binary(binary: str) -> str:
    found = _which(binary)
    if found is None:
        raise ClusterError(f"{binary} not found (package {BINARIES.get(binary, '?')})")
    return found


def _run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 60, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
    )
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done


def _wait(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.2) -> T:
    """Poll probe() until it returns something other than None (it may raise to say why not yet)."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            value = probe()
            if value is not None:
                return value
        except (ClusterError, OSError, subprocess.SubprocessError, ValueError) as error:
            last = str(error)
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}" + (f": {last}" if last else ""))
        time.sleep(interval)


def _root_prefix() -> list[str] | None:
    """[] as root, ["sudo", "-n"] with passwordless sudo, None when neither (nothing can be installed/started)."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and _run(["sudo", "-n", "true"], check=False, timeout=10).returncode == 0:
        return ["sudo", "-n"]
    return None


def can_run() -> bool:
    """True when this user can install packages and start the daemons (root, or passwordless sudo)."""
    return _root_prefix() is not None


def _port_free(port: int) -> bool:
    # slurmctld and slurmd bind the wildcard address, so probe that (SO_REUSEADDR: TIME_WAIT is no obstacle)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in text[-lines:])


# ------------------------------------------------------------------------------------ processes, by pid + start


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces and parentheses
    if fields[0] in ("Z", "X"):  # exited, not yet reaped: as good as gone, and it must not be signalled again
        return None
    return int(fields[19])


def alive(entry: dict[str, Any]) -> bool:
    """Whether the process recorded in a pids.json entry is still that process and running."""
    # a pid is only "ours" if the process also started when we recorded: pids are reused
    return _proc_start(int(entry["pid"])) == int(entry["start"])


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # a non-root caller stopping root daemons started through sudo
        _run(["sudo", "-n", "kill", f"-{sig.name.removeprefix('SIG')}", str(pid)], check=False)


class Dirs:
    """The layout of a cluster directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.slurm_conf = root / "slurm.conf"
        self.cgroup_conf = root / "cgroup.conf"
        self.slurmdbd_conf = root / "slurmdbd.conf"
        self.settings = root / "cluster.json"
        self.pids = root / "pids.json"
        self.lock = root / ".lock"
        self.munge = root / "munge"
        self.munge_key = self.munge / "munge.key"
        self.munge_socket = self.munge / "munge.socket.2"
        self.mysql = root / "mysql"
        self.mysql_data = self.mysql / "data"
        self.mysql_socket = self.mysql / "mysqld.sock"
        self.db_password = self.mysql / "slurm-password"
        self.state = root / "state"
        self.spool = root / "spool"
        self.run = root / "run"
        self.log = root / "log"
        self.bin = root / "bin"
        self.task_prolog = root / "task_prolog.sh"
        # Present: each job gets a /tmp of its own (TMPDIR, set by the task prolog), as clusters with
        # job_container/tmpfs give it; absent: jobs on the node share /tmp. Switched by a test, no restart.
        self.per_job_tmp = root / "per-job-tmp"

    def pidfile(self, daemon: str) -> Path:
        return self.run / f"{daemon}.pid"

    def logfile(self, daemon: str) -> Path:
        return self.log / f"{daemon}.log"

    def env(self) -> dict[str, str]:
        """What a Slurm client needs: SLURM_CONF, and PATH with DIR/bin (this cluster's client wrappers) first.
        No munge variable: libmunge reads none; slurm.conf's AuthInfo and AccountingStoragePass name the socket."""
        path = os.environ.get("PATH", os.defpath)
        return {"SLURM_CONF": str(self.slurm_conf), "PATH": os.pathsep.join([str(self.bin), path])}

    def client_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env())
        env["PATH"] = os.pathsep.join([env["PATH"], *SBIN])
        return env


def _read_pids(dirs: Dirs) -> dict[str, dict[str, Any]]:
    try:
        return dict(json.loads(dirs.pids.read_text()))
    except (OSError, ValueError):
        return {}


def _write_pids(dirs: Dirs, pids: dict[str, dict[str, Any]]) -> None:
    tmp = dirs.pids.with_suffix(".tmp")
    tmp.write_text(json.dumps(pids, indent=2) + "\n")
    tmp.replace(dirs.pids)


def _read_settings(dirs: Dirs) -> Settings | None:
    try:
        return Settings(**json.loads(dirs.settings.read_text()))
    except (OSError, ValueError, TypeError):
        return None


@contextlib.contextmanager
def _locked(dirs: Dirs) -> Iterator[None]:
    # two `up`s on one directory (two pytest sessions, a user and a test) must not start daemons twice
    dirs.root.mkdir(parents=True, exist_ok=True)
    with dirs.lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# ------------------------------------------------------------------------------------------------ installing


def ensure_installed() -> bool:
    """Install the Debian packages when any binary is missing; True if it installed something."""
    missing = [binary for binary in BINARIES if _which(binary) is None]
    if not missing:
        return False
    prefix = _root_prefix()
    packages = " ".join(PACKAGES)
    if prefix is None:
        raise ClusterError(
            f"missing {', '.join(missing)}; installing them needs root or passwordless sudo: "
            f"apt-get install -y {packages}"
        )
    if _which("apt-get") is None:
        raise ClusterError(f"missing {', '.join(missing)} and no apt-get here: install {packages} yourself")
    _say(f"missing {', '.join(missing)}: apt-get install {packages}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Without a policy-rc.d the packages' maintainer scripts start system-wide munge, MariaDB and Slurm
    # daemons (on /run/munge, port 3306, /etc/slurm); this cluster wants none of them. Docker images ship one
    # that says "don't"; elsewhere put one in place for the duration of the install only.
    policy = Path("/usr/sbin/policy-rc.d")
    temporary_policy = not policy.exists()
    if temporary_policy:
        _run([*prefix, "sh", "-c", f"printf '#!/bin/sh\\nexit 101\\n' > {policy} && chmod 755 {policy}"])
    try:
        _run([*prefix, "apt-get", "update"], env=env, timeout=600)
        _run([*prefix, "apt-get", "install", "-y", *PACKAGES], env=env, timeout=1200)
    finally:
        if temporary_policy:
            _run([*prefix, "rm", "-f", str(policy)], check=False)
    still = [binary for binary in BINARIES if _which(binary) is None]
    if still:
        raise ClusterError(f"still missing after apt-get install: {', '.join(still)}")
    return True


# --------------------------------------------------------------------------------------------- configuration


def _real_memory_mb() -> int:
    # RealMemory above what slurmd finds drains the node ("Low RealMemory"): stay at 80% of MemTotal
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return max(256, int(int(line.split()[1]) / 1024 * 0.8))
    raise ClusterError("no MemTotal in /proc/meminfo")


def cgroup_usable() -> tuple[bool, str]:
    """Whether proctrack/cgroup can work here: a writable cgroup v1 freezer hierarchy or a cgroup v2 root."""
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():  # unified (v2) hierarchy mounted at the root
        return os.access(root, os.W_OK), "cgroup v2"
    freezer = root / "freezer"
    if freezer.is_dir():  # cgroup v1: proctrack/cgroup tracks a job's processes in the freezer controller
        return os.access(freezer, os.W_OK), "cgroup v1 (freezer)"
    return False, "no cgroup v2 root and no cgroup v1 freezer under /sys/fs/cgroup"


def _hostname() -> str:
    # NodeName must be what slurmd finds for itself (the short host name), or slurmd will not start
    return socket.gethostname().split(".")[0]


DECLARED_CPUS = 4  # the node's CPUs at least (see slurm.conf's SlurmdParameters below)


def write_configs(dirs: Dirs, settings: Settings, password: str) -> None:
    host = _hostname()
    cpus = os.cpu_count() or 1
    memory = _real_memory_mb()
    auth = f"AuthInfo=socket={dirs.munge_socket}"
    slurm_conf = f"""\
# Written by tools/slurm_localhost.py: a one-node cluster on localhost. Every path is under {dirs.root}.
ClusterName={settings.cluster}
SlurmctldHost=localhost
SlurmctldPort={settings.ctld_port}
SlurmdPort={settings.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# this cluster's own munged: daemons and clients alike read the socket from here
{auth}
StateSaveLocation={dirs.state}
SlurmdSpoolDir={dirs.spool}/slurmd
SlurmctldPidFile={dirs.pidfile("slurmctld")}
SlurmdPidFile={dirs.pidfile("slurmd")}
SlurmctldLogFile={dirs.logfile("slurmctld")}
SlurmdLogFile={dirs.logfile("slurmd")}
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
# no mail transport here; the default /usr/bin/mail is missing and slurmctld would log an error
MailProg=/bin/true
# cgroup: a job's stray background processes die with it (a safety net for servers a job forgot to stop)
ProctrackType={settings.proctrack}
# task/affinity and task/cgroup would bind and confine; a test cluster on a shared box should not
TaskPlugin=task/none
# sbatch jobs may otherwise wait up to 3 s (batch_sched_delay) for the scheduler: tests submit one after another
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# without a default, a job that names no memory is given the whole node's, and jobs would run one at a time
DefMemPerCPU={max(1, memory // cpus)}
# a node that was down (slurmd restarted) comes back by itself
ReturnToService=2
# finished jobs stay in squeue for 300 s (Slurm's default; sacct keeps them for good): profiles/slurm reads job
# states with squeue, and the executor plugin's status checks drift up to 180 s apart
MinJobAge=300
# scancel: SIGTERM, then SIGKILL after 5 s (tests cancel and should not wait 30 s)
KillWait=5
InactiveLimit=0
Waittime=0
SlurmdTimeout=60
JobCompType=jobcomp/none
# per-job /tmp on demand ({dirs.per_job_tmp} present): the prolog's "export TMPDIR=..." reaches the job's tasks
TaskProlog={dirs.task_prolog}
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
# accounting: the Snakemake Slurm plugin reads job states with sacct
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={settings.dbd_port}
# not a password with slurmdbd: the munge socket for connections to it (sacct, sacctmgr, slurmctld); AuthInfo
# alone does not cover those, and they would look for /run/munge/munge.socket.2
AccountingStoragePass={dirs.munge_socket}
# at least 4 CPUs declared, whatever the machine has (config_overrides: slurmd reports these, not the hardware's):
# two configurations' jobs of 2 CPUs each run at once on a 2-core test machine (tests/slurm/test_two_jobs_one_node.py);
# task/none binds nothing, so the declared CPUs only decide what fits
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={max(cpus, DECLARED_CPUS)} RealMemory={memory} State=UNKNOWN
PartitionName={settings.partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
    # read from slurm.conf's directory; autodetect picks v1 or v2 as mounted
    cgroup_conf = "CgroupPlugin=autodetect\nCgroupMountpoint=/sys/fs/cgroup\n"
    slurmdbd_conf = f"""\
# Written by tools/slurm_localhost.py. Mode 600: it holds the database password (slurmdbd refuses otherwise).
AuthType=auth/munge
{auth}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={settings.dbd_port}
SlurmUser=root
PidFile={dirs.pidfile("slurmdbd")}
LogFile={dirs.logfile("slurmdbd")}
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={settings.mysql_port}
StorageUser={DB_USER}
StoragePass={password}
StorageLoc={DB_NAME}
"""
    dirs.slurm_conf.write_text(slurm_conf)
    dirs.slurm_conf.chmod(0o644)  # clients of any user read it
    dirs.task_prolog.write_text(
        "#!/bin/sh\n"
        f'if [ -e "{dirs.per_job_tmp}" ]; then\n'
        '  tmp="/tmp/servegrid-slurm-job-$SLURM_JOB_ID"\n'
        '  mkdir -p -m 700 "$tmp" && echo "export TMPDIR=$tmp"\n'
        "fi\n"
    )
    dirs.task_prolog.chmod(0o755)
    dirs.cgroup_conf.write_text(cgroup_conf)
    dirs.cgroup_conf.chmod(0o644)
    fd = os.open(dirs.slurmdbd_conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(slurmdbd_conf)
    dirs.slurmdbd_conf.chmod(0o600)
    dirs.settings.write_text(json.dumps(asdict(settings), indent=2) + "\n")


def _write_wrappers(dirs: Dirs) -> None:
    """DIR/bin/srun etc.: the real client with SLURM_CONF pinned to this cluster.

    SLURM_CONF is not always passed on: snakemake-executor-plugin-slurm-jobstep (0.6.1) removes every SLURM_*
    variable but the job's identity before its inner `srun`, which then falls back to /etc/slurm/slurm.conf and
    DNS and fails ("Could not establish a configuration source"). PATH does survive (sbatch --export=ALL), so a
    wrapper found first on PATH keeps the job on this cluster without a file in /etc.
    """
    dirs.bin.mkdir(exist_ok=True)
    dirs.bin.chmod(0o755)
    for client in CLIENTS:
        real = _which(client)
        if real is None:
            continue
        wrapper = dirs.bin / client
        wrapper.write_text(
            "#!/bin/sh\n# tools/slurm_localhost.py: this cluster's " + client + ", whatever SLURM_CONF the caller has\n"
            f'SLURM_CONF={shlex.quote(str(dirs.slurm_conf))}\nexport SLURM_CONF\nexec {shlex.quote(real)} "$@"\n'
        )
        wrapper.chmod(0o755)


def _prepare_dirs(dirs: Dirs) -> str:
    """Create the directories and the munge key; return the database password (kept across `up`s)."""
    # 755 all the way: clients of other users read slurm.conf and reach the munge socket through these
    dirs.root.chmod(0o755)
    for path in (dirs.munge, dirs.mysql, dirs.state, dirs.spool, dirs.spool / "slurmd", dirs.run, dirs.log):
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o755)
    for path in (dirs.munge_socket, dirs.mysql_socket):
        if len(str(path)) > 100:  # sun_path holds 108 bytes
            raise ClusterError(f"{path} is too long for a unix socket: use a shorter --dir")
    # munged refuses a socket that not every user can reach ("execute permissions for all required"), as clients
    # of any user must; pytest's basetemp (/tmp/pytest-of-USER) is 0700, so it cannot hold a cluster directory
    for parent in dirs.root.parents:
        if not parent.stat().st_mode & 0o001:
            raise ClusterError(f"{parent} is not world-executable (o+x), which munged requires: put --dir elsewhere")
    if not dirs.munge_key.exists():
        # munged wants a key of at least 32 bytes, readable by its user alone; generate one rather than reuse
        # the package's /etc/munge/munge.key, so this cluster trusts nothing but itself
        fd = os.open(dirs.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(1024))
    if not dirs.db_password.exists():
        fd = os.open(dirs.db_password, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(16))
    return dirs.db_password.read_text().strip()


# ----------------------------------------------------------------------------------------------- the daemons


def _record(dirs: Dirs, name: str, pid: int) -> None:
    start = _proc_start(pid)
    if start is None:
        raise ClusterError(f"{name} (pid {pid}) exited right after starting:\n{_tail(dirs.logfile(name))}")
    pids = _read_pids(dirs)
    pids[name] = {"pid": pid, "start": start, "binary": _binary(name)}
    _write_pids(dirs, pids)


def _pid_from(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _start_daemon(dirs: Dirs, name: str, cmd: list[str], env: dict[str, str], timeout: float = 30) -> int:
    """Run a self-daemonizing command, then read the daemon's pid from its pid file and record it."""
    pidfile = dirs.pidfile(name)
    pidfile.unlink(missing_ok=True)  # a stale one from a killed run would name someone else's pid
    done = _run(cmd, env=env, check=False, timeout=timeout)
    if done.returncode != 0:
        raise ClusterError(
            f"{name} did not start (exit {done.returncode}): {(done.stderr or done.stdout).strip()}\n"
            f"{_tail(dirs.logfile(name))}"
        )

    def probe() -> int | None:
        pid = _pid_from(pidfile)
        return pid if pid is not None and _proc_start(pid) is not None else None

    try:
        pid = _wait(f"{name}'s pid file {pidfile}", probe, timeout)
    except ClusterError as error:
        raise ClusterError(f"{error}\n{_tail(dirs.logfile(name))}") from None
    _record(dirs, name, pid)
    return pid


def _start_munged(dirs: Dirs, env: dict[str, str]) -> None:
    # its own key, socket, seed and log under DIR: a system munged (or none) on /run/munge does not matter
    cmd = [
        _binary("munged"),
        f"--socket={dirs.munge_socket}",
        f"--key-file={dirs.munge_key}",
        f"--pid-file={dirs.pidfile('munged')}",
        f"--log-file={dirs.logfile('munged')}",
        f"--seed-file={dirs.munge / 'munged.seed'}",
    ]
    _start_daemon(dirs, "munged", cmd, env)
    socket_arg = f"--socket={dirs.munge_socket}"

    def probe() -> bool | None:
        cred = _run([_binary("munge"), socket_arg, "-n"], env=env, check=True, timeout=10).stdout
        done = subprocess.run(
            [_binary("unmunge"), socket_arg], input=cred, capture_output=True, text=True, timeout=10, check=False
        )
        return True if done.returncode == 0 else None

    _wait("a munge credential round trip", probe, 15)


def _mariadb(dirs: Dirs, sql: str, env: dict[str, str]) -> str:
    # as OS root over the socket: mariadb-install-db gives root@localhost unix_socket authentication
    cmd = [_binary("mariadb"), "--no-defaults", f"--socket={dirs.mysql_socket}", "-u", "root", "-N", "-e", sql]
    return _run(cmd, env=env, timeout=30).stdout


def _start_mariadbd(dirs: Dirs, settings: Settings, password: str, env: dict[str, str]) -> None:
    # --no-defaults first: the Debian /etc/mysql/my.cnf would point at /var/lib/mysql and /run/mysqld
    common = ["--no-defaults", "--user=root", f"--datadir={dirs.mysql_data}"]
    if not (dirs.mysql_data / "mysql").is_dir():
        shutil.rmtree(dirs.mysql_data, ignore_errors=True)  # a half-initialised data dir from a killed run
        _run(
            [
                _binary("mariadb-install-db"),
                *common,
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ],
            env=env,
            timeout=120,
        )
    dirs.mysql_socket.unlink(missing_ok=True)
    mariadbd = [
        _binary("mariadbd"),
        *common,
        f"--socket={dirs.mysql_socket}",
        f"--pid-file={dirs.pidfile('mariadbd')}",
        f"--log-error={dirs.logfile('mariadbd')}",
        f"--port={settings.mysql_port}",
        "--bind-address=127.0.0.1",
        "--skip-name-resolve",
        # what slurmdbd recommends; its buffer-pool wish grows with RAM and only earns a log line if unmet
        "--innodb-log-file-size=96M",
        "--innodb-lock-wait-timeout=900",
    ]
    # mariadbd does not daemonize itself; setsid -f detaches it, so it is nobody's child (no zombie
    # in a long-lived caller such as pytest) and survives this script's exit
    _start_daemon(dirs, "mariadbd", [_binary("setsid"), "-f", *mariadbd], env, timeout=60)
    _wait("MariaDB to answer on its socket", lambda: _mariadb(dirs, "SELECT 1", env) or None, 60)
    quoted = password.replace("'", "''")
    users = ", ".join(f"'{DB_USER}'@'{host}'" for host in ("127.0.0.1", "localhost"))
    sql = f"CREATE DATABASE IF NOT EXISTS {DB_NAME};"
    for host in ("127.0.0.1", "localhost"):
        sql += f" CREATE USER IF NOT EXISTS '{DB_USER}'@'{host}' IDENTIFIED BY '{quoted}';"
        sql += f" ALTER USER '{DB_USER}'@'{host}' IDENTIFIED BY '{quoted}';"
    sql += f" GRANT ALL PRIVILEGES ON {DB_NAME}.* TO {users}; FLUSH PRIVILEGES;"
    _mariadb(dirs, sql, env)


def _node_state(env: dict[str, str]) -> str:
    return _run([_binary("sinfo"), "-h", "-N", "-o", "%t"], env=env, timeout=15).stdout.strip()


def _cluster_registered(settings: Settings, env: dict[str, str]) -> bool:
    done = _run([_binary("sacctmgr"), "-n", "-P", "show", "cluster", "format=cluster"], env=env, timeout=15)
    return settings.cluster in done.stdout.split()


def _probe_job(dirs: Dirs, env: dict[str, str], timeout: float) -> str:
    """Submit `sbatch --wrap true` and wait until sacct says COMPLETED; return its job id."""
    cmd = [_binary("sbatch"), "--parsable", "-J", "slurm-localhost-probe", "-o", "/dev/null", "-D", str(dirs.root)]
    submitted = _run([*cmd, "--wrap", "true"], env=env, timeout=30)
    job = submitted.stdout.strip().split(";")[0]

    def probe() -> str | None:
        done = _run([_binary("sacct"), "-n", "-P", "-X", "-j", job, "-o", "State"], env=env, timeout=15)
        state = done.stdout.strip()
        if state.startswith(("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")):
            raise ClusterError(f"probe job {job} ended {state}")
        return state if state == "COMPLETED" else None

    _wait(f"probe job {job} to show COMPLETED in sacct", probe, timeout)
    return job


def _check_ready(dirs: Dirs, settings: Settings, env: dict[str, str], timings: dict[str, float]) -> None:
    ok_states = ("idle", "mix", "mixed", "alloc", "allocated")  # a cluster found running may be busy
    with _step("node idle in sinfo", timings):

        def node_ready() -> str | None:
            state = _node_state(env)
            return state if state in ok_states else None

        _wait("the node to be idle in sinfo", node_ready, 60)
    with _step("cluster registered in slurmdbd", timings):
        deadline = time.monotonic() + 10
        while not _cluster_registered(settings, env):
            if time.monotonic() > deadline:
                # slurmctld registers its cluster when it first reaches slurmdbd; do it if it did not
                _say("slurmctld did not register the cluster: sacctmgr -i add cluster")
                _run([_binary("sacctmgr"), "-i", "add", "cluster", settings.cluster], env=env)
                _wait("the cluster in sacctmgr", lambda: _cluster_registered(settings, env) or None, 30)
                break
            time.sleep(0.2)
    with _step("sbatch --wrap true COMPLETED in sacct", timings):
        _probe_job(dirs, env, 60)


def _start_slurm(dirs: Dirs, settings: Settings, env: dict[str, str], timings: dict[str, float]) -> None:
    with _step("slurmctld", timings):
        # -i: start even if the saved state is stale or unreadable (a test cluster owes its old jobs nothing)
        _start_daemon(dirs, "slurmctld", [_binary("slurmctld"), "-i"], env)
    with _step("slurmd", timings):
        _start_daemon(dirs, "slurmd", [_binary("slurmd"), "-N", _hostname()], env)


def _stop_one(pids: dict[str, dict[str, Any]], name: str, grace: float) -> bool:
    """SIGTERM, wait up to grace seconds, SIGKILL; True when the process is gone (or was never ours)."""
    entry = pids.get(name)
    if entry is None or not alive(entry):
        return True
    pid = int(entry["pid"])
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not alive(entry):
            return True
        time.sleep(0.1)
    _say(f"{name} (pid {pid}) still alive after SIGTERM and {grace:.0f} s: SIGKILL")
    if alive(entry):  # checked again right before signalling: the start time guards against a reused pid
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not alive(entry):
            return True
        time.sleep(0.1)
    return not alive(entry)


def _cancel_jobs(dirs: Dirs, env: dict[str, str]) -> None:
    """scancel whatever is still queued or running, and wait for it to leave (before slurmd goes)."""
    pids = _read_pids(dirs)
    if not all(name in pids and alive(pids[name]) for name in ("munged", "slurmctld")):
        return
    try:
        done = _run([_binary("squeue"), "-h", "-o", "%A"], env=env, timeout=15, check=False)
        jobs = done.stdout.split()
        if not jobs:
            return
        _say(f"scancel {' '.join(jobs)}")
        _run([_binary("scancel"), *jobs], env=env, timeout=30, check=False)
        # KillWait=5: jobs should be gone in well under 15 s; then slurmd can go without orphaning job steps

        def drained() -> bool | None:
            left = _run([_binary("squeue"), "-h", "-o", "%A"], env=env, timeout=15).stdout.split()
            return True if not left else None

        _wait("cancelled jobs to leave squeue", drained, 20)
    except (ClusterError, subprocess.SubprocessError) as error:
        _say(f"cancelling jobs: {error} (stopping the daemons anyway)")


def _stop_all(dirs: Dirs) -> list[str]:
    """Stop every daemon recorded in pids.json, newest first; return the names of those still alive."""
    pids = _read_pids(dirs)
    left = []
    for name in reversed(DAEMONS):
        # mariadbd flushes InnoDB on SIGTERM, and slurmdbd/slurmctld save state: give them time before SIGKILL
        grace = 30 if name in ("mariadbd", "slurmctld", "slurmdbd") else 10
        if not _stop_one(pids, name, grace):
            left.append(name)
    return left


# ------------------------------------------------------------------------------------------------ public API


def _as_root(command: str, directory: Path, settings: Settings | None) -> subprocess.CompletedProcess[str]:
    """Re-run this script as root through sudo -n (the caller is not root but may use sudo)."""
    prefix = _root_prefix()
    if prefix is None:
        raise ClusterError("starting and stopping the Slurm daemons needs root or passwordless sudo")
    cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), command, "--dir", str(directory)]
    if settings is not None:
        cmd += ["--ctld-port", str(settings.ctld_port), "--slurmd-port", str(settings.slurmd_port)]
        cmd += ["--dbd-port", str(settings.dbd_port), "--mysql-port", str(settings.mysql_port)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} exited {done.returncode}")
    return done


def up(
    directory: str | os.PathLike[str],
    *,
    ctld_port: int = 6817,
    slurmd_port: int = 6818,
    dbd_port: int = 6819,
    mysql_port: int = 6820,
    keep_on_failure: bool = False,
) -> dict[str, str]:
    """Bring the cluster in `directory` up (or check the one already running there); return the environment
    variables a Slurm client needs ({"SLURM_CONF": ...}). Raises ClusterError, after stopping whatever it
    started unless keep_on_failure, when any step fails."""
    dirs = Dirs(Path(directory).resolve())
    wanted = Settings(ctld_port=ctld_port, slurmd_port=slurmd_port, dbd_port=dbd_port, mysql_port=mysql_port)
    if os.geteuid() != 0:
        _as_root("up", dirs.root, wanted)
        return dirs.env()
    timings: dict[str, float] = {}
    started = time.monotonic()
    with _locked(dirs):
        env = dirs.client_env()
        with _step("install check", timings):
            ensure_installed()
        pids = _read_pids(dirs)
        running = [name for name in DAEMONS if name in pids and alive(pids[name])]
        settings = _read_settings(dirs)
        if settings is not None and len(running) == len(DAEMONS):
            _say(f"already running in {dirs.root}: checking it")
            _write_wrappers(dirs)
            _check_ready(dirs, settings, env, timings)
            _say(f"up (checked) in {time.monotonic() - started:.1f} s")
            return dirs.env()
        if running:
            _say(f"only {', '.join(running)} of {', '.join(DAEMONS)} running: restarting all")
            _stop_all(dirs)
        dirs.pids.unlink(missing_ok=True)
        busy = _busy_ports(wanted)
        if busy:
            raise ClusterError(f"ports in use: {', '.join(busy)}; choose others")
        try:
            _start_cluster(dirs, wanted, env, timings)
        except BaseException:
            _after_failure(dirs, keep_on_failure)
            raise
    _say(f"{wanted.proctrack}; up in {time.monotonic() - started:.1f} s")
    return dirs.env()


def _busy_ports(wanted: Settings) -> list[str]:
    """The wanted ports already in use, each with the option that sets it."""
    return [
        f"{port} ({option})"
        for port, option in (
            (wanted.ctld_port, "--ctld-port"),
            (wanted.slurmd_port, "--slurmd-port"),
            (wanted.dbd_port, "--dbd-port"),
            (wanted.mysql_port, "--mysql-port"),
        )
        if not _port_free(port)
    ]


def _start_cluster(dirs: Dirs, wanted: Settings, env: dict[str, str], timings: dict[str, float]) -> None:
    """Start every daemon in order: munged, mariadbd, slurmdbd, then slurmctld and slurmd with the first process
    tracking that works here (cgroup, else linuxproc)."""
    with _step("prepare directory", timings):
        password = _prepare_dirs(dirs)
    with _step("munged", timings):
        _start_munged(dirs, env)
    with _step("mariadbd", timings):
        _start_mariadbd(dirs, wanted, password, env)
    usable, why = cgroup_usable()
    candidates = ["proctrack/cgroup", "proctrack/linuxproc"] if usable else ["proctrack/linuxproc"]
    if not usable:
        _say(f"proctrack/cgroup cannot work here ({why}): using proctrack/linuxproc")
    wanted.proctrack = candidates[0]
    write_configs(dirs, wanted, password)
    _write_wrappers(dirs)
    with _step("slurmdbd", timings):
        _start_daemon(dirs, "slurmdbd", [_binary("slurmdbd")], env)
        # slurmctld registers the cluster on connect; slurmdbd must be listening by then
        _wait(
            "slurmdbd to answer sacctmgr",
            lambda: _run([_binary("sacctmgr"), "-n", "show", "cluster"], env=env, timeout=10) and True,
            30,
        )
    for proctrack in candidates:
        wanted.proctrack = proctrack
        write_configs(dirs, wanted, password)
        try:
            _start_slurm(dirs, wanted, env, timings)
            _check_ready(dirs, wanted, env, timings)
            break
        except ClusterError as error:
            if proctrack == candidates[-1]:
                raise
            _say(f"with {proctrack}: {error}\nfalling back to proctrack/linuxproc")
            pids = _read_pids(dirs)
            for name in ("slurmd", "slurmctld"):
                _stop_one(pids, name, 15)


def _after_failure(dirs: Dirs, keep_on_failure: bool) -> None:
    """Show each daemon's last log lines and, unless told to keep them, stop what was started."""
    for name in DAEMONS:
        tail = _tail(dirs.logfile(name), 8)
        if tail:
            _say(f"{dirs.logfile(name)}:\n{tail}")
    if not keep_on_failure:
        _say("stopping what was started")
        _stop_all(dirs)


def down(directory: str | os.PathLike[str]) -> list[str]:
    """Cancel remaining jobs, then stop every daemon this script started in `directory` (by recorded pid and
    start time, never anything else). Returns the names of daemons that would not die (empty when all gone,
    including when some were gone already)."""
    dirs = Dirs(Path(directory).resolve())
    if os.geteuid() != 0:
        if dirs.pids.exists():
            _as_root("down", dirs.root, None)
        return [name for name, entry in _read_pids(dirs).items() if alive(entry)]
    if not dirs.root.is_dir():
        return []
    with _locked(dirs):
        _cancel_jobs(dirs, dirs.client_env())
        left = _stop_all(dirs)
        if not left:
            dirs.pids.unlink(missing_ok=True)
    return left


def recorded(directory: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """DIR/pids.json: daemon name -> {"pid", "start" (clock ticks since boot), "binary"}; {} when none."""
    return _read_pids(Dirs(Path(directory).resolve()))


def status(directory: str | os.PathLike[str]) -> dict[str, bool]:
    """Which recorded daemons are alive."""
    pids = _read_pids(Dirs(Path(directory).resolve()))
    return {name: name in pids and alive(pids[name]) for name in DAEMONS}


# ------------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("up", "install if needed, start (or check) the cluster; prints the export line"),
        ("down", "cancel jobs and stop the daemons started in DIR"),
        ("status", "which daemons are alive, and sinfo"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--dir", required=True, type=Path, help="the cluster's directory (configs, data, logs)")
        if name == "up":
            defaults = Settings()
            sub.add_argument("--ctld-port", type=int, default=defaults.ctld_port, help="SlurmctldPort")
            sub.add_argument("--slurmd-port", type=int, default=defaults.slurmd_port, help="SlurmdPort")
            sub.add_argument("--dbd-port", type=int, default=defaults.dbd_port, help="DbdPort (slurmdbd)")
            sub.add_argument("--mysql-port", type=int, default=defaults.mysql_port, help="MariaDB, on 127.0.0.1")
            sub.add_argument("--keep-on-failure", action="store_true", help="leave daemons running to debug")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            env = up(
                args.dir,
                ctld_port=args.ctld_port,
                slurmd_port=args.slurmd_port,
                dbd_port=args.dbd_port,
                mysql_port=args.mysql_port,
                keep_on_failure=args.keep_on_failure,
            )
            dirs = Dirs(args.dir.resolve())
            print(f"export SLURM_CONF={shlex.quote(env['SLURM_CONF'])}")
            print(f'export PATH={shlex.quote(str(dirs.bin))}:"$PATH"')
            return 0
        if args.command == "down":
            left = down(args.dir)
            if left:
                _say(f"still alive: {', '.join(left)}")
                return 1
            _say("down: no daemon started here is alive")
            return 0
        alive = status(args.dir)
        for name, is_alive in alive.items():
            print(f"{name:10} {'alive' if is_alive else 'not running'}")
        dirs = Dirs(args.dir.resolve())
        if alive["slurmctld"] and alive["munged"]:
            done = _run([_binary("sinfo")], env=dirs.client_env(), check=False, timeout=15)
            print(done.stdout.rstrip() or done.stderr.rstrip())
        return 0 if all(alive.values()) else 3
    except ClusterError as error:
        _say(f"error: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
