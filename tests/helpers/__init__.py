"""Helpers shared by the tests (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import copy
import os
import socket
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
# 2026-12-03 (docs/architecture.md), healthy after 23-25 s instead of 33-38 s. The tree keeps the API server and
# its engine core (the process the engine-hang fault stops), which is what the lifecycle tests take down.
TEST_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


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
    """A range of ports that are free right now (best effort)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    base = min(base, 65000 - width)
    return base, base + width


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
) -> None:
    """Write a cell file with known timings, as servegrid.pipeline.cell_job would (for aggregation/report tests);
    ``server`` replaces facts of the server record (block_size, cache_mode, hit_blocks_dropped, ...)."""
    import random as _random

    from servegrid.records import cell_file
    from servegrid.records.request import RequestRecord

    rng = _random.Random(f"{configuration}{mode}{context}{concurrency}")
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
            recs.append(r)
            t = r.end_ns
    for i in range(warmup_errors):  # failed unmeasured requests, as a warm-up the server refused
        failed = RequestRecord(f"w{i}", 0, i, "warmup", 1, context, output_tokens, http_status=500, error="HTTP 500")
        failed.t0_ns = failed.sent_ns = failed.intended_send_ns = 1_000_000_000
        recs.append(failed)
    meta = {
        "cell": {
            "configuration": configuration,
            "mode": mode,
            "context": context,
            "concurrency": concurrency,
            "id": f"{configuration}/{mode}/ctx{context}_c{concurrency}",
        },
        "settings": {
            "mode": mode,
            "context": context,
            "concurrency": concurrency,
            "workload": {"suffix_tokens": 64, "output_tokens": output_tokens, "warmup_requests": 1},
        },
        "cache_state": "reset",
        "spec_hash": f"hash-{configuration}",
        "server": {
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
        "started_at": "2026-11-29T10:00:00+00:00",
        "duration_s": (t - 1_000_000_000) / 1e9,
        "server_metrics": {
            "delta": {"num_preemptions": preemptions},
            "derived": {
                "prefix_cache_hit_rate": hit_rate,
                "spec_acceptance_rate": None,
                "spec_mean_acceptance_length": None,
            },
            "gauges": {"samples": 3, "scrape_errors": 0, "kv_cache_usage_perc_max": kv_usage_max},
        },
    }
    cell_file.write_cell(path, recs, meta)


def copy_workflow(dest: Path) -> Path:
    """The repository's files (tracked and untracked-but-not-ignored) copied to ``dest``.

    The vLLM and LiteLLM environments are linked, not copied: configs name them by relative path.
    """
    import shutil
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    (dest / ".venv-vllm").symlink_to(REPO / ".venv-vllm")
    (dest / ".venv-litellm").symlink_to(REPO / ".venv-litellm")
    return dest


def snakemake(workdir: Path, *args: str, timeout: float = 1800):  # type: ignore[no-untyped-def]
    """Run Snakemake from the test's environment in ``workdir``; returns the CompletedProcess."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


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
