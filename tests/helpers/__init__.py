"""Helpers shared by the tests (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FAKE_SERVER = REPO / "tests" / "helpers" / "fake_server.py"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# Every vLLM server the tests start runs eager: on this machine kind (2 cores) torch.compile's warm-up takes
# about 60 s of a start, and vLLM 0.32's compile cache fails to load here ("'function' object has no attribute
# 'finalize_loading'"), so every start paid it again. Measured 2026-12-02: healthy after 85 s compiled, 52 s
# eager. The tests check servegrid's handling of a real engine, not the compiled engine's speed; the demo
# keeps vLLM's default.
TEST_ENGINE_ARGS = ("--enforce-eager",)
# The model runner in the engine core's own process instead of a third one (vLLM's worker process): measured
# 2026-12-03 (docs/testing.md), healthy after 23-25 s instead of 33-38 s. The tree keeps the API server and
# its engine core (the process the engine-hang fault stops), which is what the lifecycle tests take down.
TEST_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# The other user of a shared host, in the tests of what servegrid's servers answer them: ``nobody``, switched to as
# root (the CI runs as root).
ANOTHER_USER = 65534


def as_another_user(argv: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` as :data:`ANOTHER_USER`, with none of this user's groups and none of its environment."""
    return subprocess.Popen(
        argv, user=ANOTHER_USER, group=ANOTHER_USER, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"}, **popen
    )


def worker_cores() -> tuple[int, int]:
    """(the server's core, the client's core) for the tests of this process. make test runs the tests with real
    servers two at a time (pytest-xdist workers gw0 and gw1): each worker's servers take a core of their own and its
    clients the other, so that two servers never share one. Outside xdist: core 0 and core 1, as the demo."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    server_core = int(worker.removeprefix("gw")) % 2
    return server_core, 1 - server_core


def engine_for_tests(engine: dict[str, Any], *, bind_threads: bool = True) -> dict[str, Any]:
    """A config's engine section as the tests run it: eager, the worker in the engine core, and vLLM's OpenMP
    threads on this worker's server core (bind_threads; the demo binds them to core 0)."""
    env = {**engine.get("env", {}), **TEST_ENGINE_ENV}
    if bind_threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(worker_cores()[0])
    return {**engine, "args": [*engine.get("args", []), *TEST_ENGINE_ARGS], "env": env}


def placed(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with every configuration's server on this worker's server core and the client on the other."""
    server_core, client_core = worker_cores()
    for configuration in raw["configurations"].values():
        configuration["cpus"] = [server_core]
    raw.setdefault("operations", {})["client_cpus"] = [client_core]
    return raw


def free_port_range(width: int = 20) -> tuple[int, int]:
    """A range of ports free right now (best effort), below the kernel's ephemeral range. A port inside it may become
    the source port of any outgoing connection on the host at any moment: in the clean-clone run of 2026-12-07 a
    test server's port (an even one, as Linux's connect() prefers, next to the odd one bind(0) had given) was taken
    that way twice between servegrid's check and the server's bind."""
    import random

    from servegrid.planning.host_checks import ephemeral_ports

    low = (ephemeral_ports() or (32768, 60999))[0]
    chooser = random.Random(os.getpid() * 1_000_003 + int.from_bytes(os.urandom(4), "big"))
    for _ in range(200):
        base = chooser.randrange(10_000, low - width)
        if all(_bindable(port) for port in range(base, base + width + 1)):
            return base, base + width
    raise RuntimeError(f"no {width + 1} free ports in a row between 10000 and {low}")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def fake_spec(name: str = "fake", *flags: str) -> dict[str, Any]:
    return {
        "configuration": name,
        "engine": "vllm",  # the fake server answers where vLLM would
        "command": [sys.executable, str(FAKE_SERVER), "--model-path", "{model}"],
        "model": "fake-model",
        "served_name": "fake",
        "tiny_model": None,
        "args": list(flags),
        "env": {},
        "api_key_env": None,
        "prefix_caching": True,
        "speculative": None,
    }


def with_changes(raw: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of ``raw`` with dotted keys replaced: with_changes(raw, **{"a.b": 1})."""
    out = copy.deepcopy(raw)
    for dotted, value in changes.items():
        node = out
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def synthetic_cell(
    path: Path,
    configuration: str,
    mode: str,
    context: int,
    concurrency: int,
    *,
    ttft_s: float,
    interval_s: float,
    output_tokens: int = 32,
    tokens_per_chunk: int = 1,
    requests: int = 6,
    mismatched: int = 0,
    errors: int = 0,
    warmup_errors: int = 0,
    turns: int = 1,
    spread: float = 0.05,
    interval_spread: float = 0.0,
    hit_rate: float | None = None,
    preemptions: float = 0.0,
    kv_usage_max: float = 0.1,
    server: dict[str, Any] | None = None,
    gpus: dict[str, Any] | None = None,
    started_at: str = "2026-11-29T10:00:00+00:00",
    wall_s: float = 0.0,
    energy_j: float | None = None,
    top_up_round: int = 0,
) -> None:
    """Write a cell file with known timings, as servegrid.pipeline.cell_job would (for aggregation/report tests);
    ``server`` replaces facts of the server record (block_size, cache_mode, hit_blocks_dropped, ...); ``gpus`` is
    what the GPU watch said (servegrid.measuring.gpu_watch; None: not watched); ``energy_j``, what the GPUs drew in
    the one repeat (the server then counts every request's prompt and output tokens); ``top_up_round``: the file is
    that round's top-up of the cell (its requests in repeat ``top_up_round``, its settings saying so)."""
    import random as _random
    from datetime import datetime as _datetime
    from datetime import timedelta as _timedelta

    from servegrid.records import cell_file
    from servegrid.records.cell_record import CellRecord
    from servegrid.records.cell_spec import CellSpec, Sessions
    from servegrid.records.request import RequestRecord

    rng = _random.Random(f"{configuration}{mode}{context}{concurrency}" + (f"/{top_up_round}" if top_up_round else ""))
    recs = []
    t = 1_000_000_000
    for i in range(requests):
        for turn in range(1, turns + 1):
            r = RequestRecord(
                f"m{i}t{turn}",
                i % concurrency,
                i,
                "measured",
                turn,
                prompt_tokens_requested=context,
                output_tokens_requested=output_tokens,
            )
            r.t0_ns = 1_000_000_000
            r.intended_send_ns = t
            r.sent_ns = t + 100_000
            first = r.sent_ns + int(ttft_s * (1 + rng.uniform(-spread, spread)) * 1e9)
            # As vLLM streams: the first token alone (from prefill), then chunks of
            # tokens_per_chunk, each arriving one interval per token after the last.
            r.chunk_tokens = [1]
            left = output_tokens - 1
            while left > 0:
                r.chunk_tokens.append(min(tokens_per_chunk, left))
                left -= r.chunk_tokens[-1]
            r.chunk_ns = [first]
            interval = interval_s * (1 + rng.uniform(-interval_spread, interval_spread))
            for tokens in r.chunk_tokens[1:]:
                r.chunk_ns.append(r.chunk_ns[-1] + int(interval * tokens * 1e9))
            r.end_ns = r.chunk_ns[-1] + 1000
            r.prompt_tokens_reported = context + (1 if i < mismatched else 0)
            r.output_tokens_reported = output_tokens
            r.http_status = 200
            r.error = "HTTP 500: boom" if i >= requests - errors else None
            r.repeat = top_up_round
            recs.append(r)
            t = r.end_ns
    for i in range(warmup_errors):  # failed unmeasured requests, as a warm-up the server refused
        failed = RequestRecord(f"w{i}", 0, i, "warmup", 1, context, output_tokens, http_status=500, error="HTTP 500")
        failed.t0_ns = failed.sent_ns = failed.intended_send_ns = 1_000_000_000
        recs.append(failed)
    delta: dict[str, float] = {"num_preemptions": preemptions}
    if hit_rate is not None:  # the counters the hit rate comes from (a top-up's pooled cell derives it again)
        delta |= {"prefix_cache_queries": 1000.0, "prefix_cache_hits": 1000.0 * hit_rate}
    repeats = []
    if energy_j is not None:
        delta |= {"prompt_tokens": requests * turns * context, "generation_tokens": requests * turns * output_tokens}
        repeats = [{"repeat": top_up_round, "route": "direct", "gpu_energy_j": energy_j}]
    # Built as the cell job builds it (CellRecord.measured), so a synthetic cell is a cell file of today's format.
    record = CellRecord.measured(
        CellSpec(configuration, mode, context, Sessions(concurrency)),
        {
            "mode": mode,
            "context": context,
            "concurrency": concurrency,
            "workload": {"suffix_tokens": 64, "output_tokens": output_tokens, "warmup_requests": 1},
        }
        | ({"top_up": {"round": top_up_round, "first_repeat": top_up_round}} if top_up_round else {}),
        {
            "configuration": configuration,
            "engine": "vllm",
            "session": f"session-{configuration}",
            "spec_hash": f"hash-{configuration}",
            "url": "http://127.0.0.1:1",
            "argv": ["vllm", "serve", "m"],
            "env": {"A": "1"},
            "gpus": [],
            "log_path": "x.log",
            "engine_version": "0.32.0",
            "kv_cache_tokens": 262144,
            "max_concurrency": 32.0,
            "max_model_len": 8192,
            "startup_s": 61.5,
            "warmup_s": 0.5,
            "started_at": "2026-11-29T10:00:00+0000",
            "block_size": 16,
            "host": {"cpu": "Test CPU", "cpu_count": 2, "memory_gib": 23.5, "os": "Linux", "gpus": []},
            **(server or {}),
        },
        {
            "cache_state": "reset",
            "duration_s": (t - 1_000_000_000) / 1e9,
            "server_metrics": {
                "delta": delta,
                "derived": {
                    "prefix_cache_hit_rate": hit_rate,
                    "spec_acceptance_rate": None,
                    "spec_mean_acceptance_length": None,
                },
                "gauges": {"samples": 3, "scrape_errors": 0, "kv_cache_usage_perc_max": kv_usage_max},
            },
            "gpus": gpus,
            "repeats": repeats,
        },
        started_at=started_at,
        ended_at=(_datetime.fromisoformat(started_at) + _timedelta(seconds=wall_s)).isoformat(),
    )
    cell_file.write_cell(path, recs, record)


def synthetic_cell_of(root: Path, cell: Any, **timings: Any) -> None:
    """:func:`synthetic_cell` for a cell of an Experiment's grid (a CellSpec), at its path under ``root``."""
    synthetic_cell(root / cell.path, cell.configuration, cell.mode, cell.context, cell.sessions, **timings)


def synthetic_top_up_of(root: Path, cell: Any, round_: int, **timings: Any) -> None:
    """:func:`synthetic_cell` for round ``round_``'s top-up of a grid cell, at its top-up path under ``root``."""
    path = root / cell.top_up_path(round_)
    synthetic_cell(path, cell.configuration, cell.mode, cell.context, cell.sessions, **timings, top_up_round=round_)


def copy_workflow(dest: Path) -> Path:
    """The repository's files copied to ``dest``, the engines' environments linked (servegrid.testing.workflow_copy)."""
    from servegrid.testing.workflow_copy import copy_workflow as copy

    return copy(REPO, dest)


def snakemake(workdir: Path, *args: str, timeout: float = 1800):  # type: ignore[no-untyped-def]
    """Run Snakemake from the test's environment in ``workdir``; returns the CompletedProcess."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def leftovers(workdir: Path) -> list[int]:
    """Live processes of every server process group that this workflow copy recorded.

    vLLM renames its engine processes (VLLM::EngineCore), so they are found by
    process group, which they share with the API server, not by command line.
    """
    import json

    from servegrid.serving import procs

    alive = []
    for record_path in (workdir / "results" / ".servegrid").glob("*/*.json"):  # every host's folder
        record = json.loads(record_path.read_text())
        if "pgid" in record:
            alive += [p.pid for p in procs.group_members(record["pgid"])]
    return alive
