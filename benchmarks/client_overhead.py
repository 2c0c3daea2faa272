"""What the servegrid client adds to every latency it measures, and how much it can take.

The calibration server (servegrid.testing.calibration, loopback, pinned to CPU 0)
streams on a fixed schedule and stamps every SSE event with the monotonic time
it wrote it. servegrid's own client path (servegrid.measuring.client.Streamer, the code
every cell uses), pinned to CPU 1, stamps each socket read in the connection's
data_received. Per event, client-added latency = arrival stamp − write stamp;
both come from CLOCK_MONOTONIC, which is system-wide on Linux.

    .venv/bin/python benchmarks/client_overhead.py [--streams 1 16 64 256 512] [--out benchmarks/out]

Each level runs three times, side by side: servegrid's path, then the usual
one, which stamps a read where the consuming task gets it from httpx, over
aiohttp's transport and over httpx's default one (httpcore). Prints a table and
writes client_overhead.json. Targets (issue 6): at 256 streams, added latency p99
<= 2 ms and >= 20,000 SSE events/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from httpx_aiohttp import HttpxAiohttpClient

from servegrid import engines
from servegrid.measuring.client import Streamer, decode_stream, streaming_session
from servegrid.measuring.client_monitor import ClientMonitor, CollectorPause
from servegrid.measuring.measured_phase import run_loop
from servegrid.records.request import RequestRecord
from servegrid.serving import hostinfo

REPO = Path(__file__).resolve().parents[1]
# The calibration server speaks vLLM's dialect by default, so the requests are a vLLM cell's, byte for byte.
ENGINE = engines.get("vllm")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, ttft: float, interval: float, cpu: int | None) -> subprocess.Popen:
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "servegrid.testing.calibration",
            "--port",
            str(port),
            "--ttft",
            str(ttft),
            "--interval",
            str(interval),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        preexec_fn=preexec,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ENGINE.health_path}", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the calibration server did not start")


async def consumer_stamped(client: httpx.AsyncClient, url: str, payload: dict, record: RequestRecord) -> None:
    """The usual way, for comparison: stamp each read where the consuming task gets it from httpx."""
    parts: list[bytes] = []
    reads: list[tuple[int, int]] = []
    received = 0
    record.sent_ns = time.monotonic_ns()
    async with client.stream("POST", url + ENGINE.completions_path, json=payload) as response:
        async for raw in response.aiter_raw():
            if raw:
                received += len(raw)
                reads.append((time.monotonic_ns(), received))
                parts.append(raw)
    record.end_ns = time.monotonic_ns()
    decode_stream(b"".join(parts), reads, record)


@dataclass
class ClientPath:
    """One way of sending a request and timing its stream, with what it does around the measured phase."""

    send: Callable[[dict, RequestRecord], Awaitable[None]]
    open_connections: Callable[[int], Awaitable[None]]
    after_measurement: Callable[[], None]


@contextlib.asynccontextmanager
async def servegrid_path(url: str, streams: int) -> AsyncIterator[ClientPath]:
    """The path every cell uses: reads stamped in data_received, connections opened first, decoding after."""
    async with streaming_session(streams + 4, 120) as session:
        streamer = Streamer(session, url)
        send = functools.partial(streamer.stream, ENGINE.completions_path, decode=False)
        open_connections = functools.partial(streamer.open_connections, path=ENGINE.health_path)
        yield ClientPath(send, open_connections, streamer.decode_pending)


@contextlib.asynccontextmanager
async def consumer_stamped_path(
    client_class: type[httpx.AsyncClient], url: str, streams: int
) -> AsyncIterator[ClientPath]:
    """The usual way: connections opened on demand, each stream stamped and decoded by its consuming task."""
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with client_class(limits=limits, timeout=120) as client:

        async def no_warm_up(_: int) -> None:
            return None

        yield ClientPath(functools.partial(consumer_stamped, client, url), no_warm_up, lambda: None)


# servegrid's path, then the usual one (stamped where the consumer gets the bytes) over each httpx transport.
PATHS: dict[str, Callable[[str, int], contextlib.AbstractAsyncContextManager[ClientPath]]] = {
    "servegrid": servegrid_path,
    "httpx+aiohttp": functools.partial(consumer_stamped_path, HttpxAiohttpClient),
    "httpx": functools.partial(consumer_stamped_path, httpx.AsyncClient),
}


async def run_level(url: str, streams: int, requests_per_stream: int, tokens: int, path: str) -> dict:
    monitor, pause = ClientMonitor(), CollectorPause()
    records: list[RequestRecord] = []
    async with PATHS[path](url, streams) as client_path:

        async def stream_loop(s: int, start_ns: int) -> None:
            intended = start_ns  # closed loop, as cells run: the next request is due when the last one ends
            for r in range(requests_per_stream):
                record = RequestRecord(f"s{s}r{r}", s, r, "measured", 1, 8, tokens)
                record.intended_send_ns = intended
                records.append(record)
                payload = ENGINE.completion_payload("calibration", [1, 2, 3, 4, 5, 6, 7, 8], tokens, 0.0)
                await client_path.send(payload, record)
                intended = record.end_ns or time.monotonic_ns()

        await client_path.open_connections(streams)
        wall0 = time.monotonic()
        pause.start()
        monitor.start()
        start_ns = time.monotonic_ns()
        await asyncio.gather(*(stream_loop(s, start_ns) for s in range(streams)))
        await monitor.stop()
        pause.stop()
        wall = time.monotonic() - wall0
        client_path.after_measurement()
    client_summary = monitor.summary()
    server_stats = httpx.get(f"{url}/servegrid/stats").json()
    failed = [r for r in records if r.error]
    added = np.array([(rx - tx) / 1e6 for r in records for rx, tx in zip(r.chunk_ns, r.chunk_server_ns, strict=True)])
    first = np.array([(r.chunk_ns[0] - r.chunk_server_ns[0]) / 1e6 for r in records if r.chunk_ns])
    send_delay = np.array([(r.sent_ns - r.intended_send_ns) / 1e6 for r in records])
    events = int(sum(len(r.chunk_ns) for r in records))
    return {
        "streams": streams,
        "requests": len(records),
        "failed": len(failed),
        "events": events,
        "wall_s": wall,
        "events_per_s": events / wall,
        "tokens_per_s": sum(sum(r.chunk_tokens) for r in records) / wall,
        "added_ttft_ms_p50": float(np.percentile(first, 50)),
        "added_ttft_ms_p99": float(np.percentile(first, 99)),
        "added_per_token_ms_p50": float(np.percentile(added, 50)),
        "added_per_token_ms_p99": float(np.percentile(added, 99)),
        "added_per_token_ms_max": float(added.max()),
        "send_delay_ms_p50": float(np.percentile(send_delay, 50)),
        "send_delay_ms_p99": float(np.percentile(send_delay, 99)),
        "client_cpu_fraction": client_summary["cpu_fraction"],
        "client_loop_lag_p99_ms": (client_summary["loop_lag_p99_s"] or 0) * 1e3,
        "server_late_p99_ms": server_stats["late_p99_ms"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    parser.add_argument("--tokens", type=int, default=100, help="tokens (one per SSE event) per request")
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.01, help="server pacing per event, s")
    parser.add_argument("--ttft", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    args = parser.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    port = free_port()
    server = start_server(port, args.ttft, args.interval, server_cpu)
    try:
        if client_cpu is not None:
            os.sched_setaffinity(0, {client_cpu})
        rows = []
        for streams in args.streams:
            for path in PATHS:
                url = f"http://127.0.0.1:{port}"
                row = run_loop(run_level(url, streams, args.requests_per_stream, args.tokens, path))
                row["path"] = path
                rows.append(row)
                print(
                    f"{path:<13} {streams:>4} streams  {row['events_per_s']:>7,.0f} events/s  "
                    f"added TTFT p50/p99 {row['added_ttft_ms_p50']:6.2f}/{row['added_ttft_ms_p99']:6.2f} ms  "
                    f"per token p50/p99 {row['added_per_token_ms_p50']:6.2f}/{row['added_per_token_ms_p99']:6.2f} ms  "
                    f"send delay p99 {row['send_delay_ms_p99']:6.2f} ms  "
                    f"client CPU {row['client_cpu_fraction']:4.0%}  "
                    f"loop lag p99 {row['client_loop_lag_p99_ms']:6.2f} ms  "
                    f"server late p99 {row['server_late_p99_ms'] or 0:6.2f} ms  failed {row['failed']}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(10)
    result = {
        "machine": {
            "cpus": len(cpus),
            "server_cpu": server_cpu,
            "client_cpu": client_cpu,
            "cpu_model": hostinfo.cpu_model(),
        },
        "script": {
            "interval_s": args.interval,
            "ttft_s": args.ttft,
            "tokens": args.tokens,
            "requests_per_stream": args.requests_per_stream,
        },
        "levels": rows,
    }
    at_256 = next((r for r in rows if r["streams"] == 256 and r["path"] == "servegrid"), None)
    if at_256:
        result["targets_at_256"] = {
            "added_p99_ms": at_256["added_per_token_ms_p99"],
            "added_p99_within_2ms": at_256["added_per_token_ms_p99"] <= 2.0,
            "events_per_s": at_256["events_per_s"],
            "events_per_s_at_least_20000": at_256["events_per_s"] >= 20_000,
        }
        print(f"targets at 256 streams: {json.dumps(result['targets_at_256'])}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client_overhead.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'client_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
