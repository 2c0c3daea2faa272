"""Streaming OpenAI-compatible client with per-chunk timestamps.

Timing rules (all clocks are ``time.monotonic_ns``, system-wide on Linux):
- ``sent`` is taken immediately before the request is handed to httpx;
- every network read is stamped the moment the transport yields it, before any
  decoding or JSON parsing (orjson: 1.6 µs per vLLM chunk against the standard
  library's 6 µs); each SSE event inherits the stamp of the read that completed it;
- a chunk's token count is the increase of ``usage.completion_tokens``
  (``stream_options.continuous_usage_stats``), so a chunk that carries several
  speculative tokens is counted as such, not as one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import orjson
import psutil

from servegrid import stats


class SSEDecoder:
    """Incremental Server-Sent-Events framing: bytes in, ``data:`` payloads out.

    Events end at a blank line; vLLM sends ``\n\n``, other servers may send
    ``\r\n\r\n``. The common case costs one ``find`` per event.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> Iterator[bytes]:
        buffer = self._buffer + data if self._buffer else data
        crlf = b"\r" in buffer
        while True:
            end, sep_len = _event_end(buffer) if crlf else (buffer.find(b"\n\n"), 2)
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + sep_len :]
            if event.startswith(b"data:") and b"\n" not in event:  # one data line: the usual case
                yield event[5:].lstrip(b" ")
                continue
            payload = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
            if payload:
                yield b"\n".join(payload)
        self._buffer = buffer

    @property
    def pending(self) -> bytes:
        return self._buffer


def _event_end(buffer: bytes) -> tuple[int, int]:
    """Index and length of the first blank-line separator, or (-1, 0)."""
    candidates = [(buffer.find(sep), len(sep)) for sep in (b"\n\n", b"\r\n\r\n", b"\r\r")]
    found = [c for c in candidates if c[0] >= 0]
    return min(found) if found else (-1, 0)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are monotonic nanoseconds."""

    request_id: str
    session: int
    seq: int
    phase: str  # "warmup", "probe" or "measured"
    turn: int
    prompt_tokens_requested: int
    output_tokens_requested: int
    intended_send_ns: int = 0
    sent_ns: int = 0
    end_ns: int | None = None
    chunk_ns: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    # Calibration server only: when each chunk was written, on the same clock.
    chunk_server_ns: list[int] = field(default_factory=list)
    prompt_tokens_reported: int | None = None
    output_tokens_reported: int | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    messages: list[dict[str, str]] | None = None  # chat requests: what was sent
    repeat: int = 0  # which repeat of the cell's workload
    t0_ns: int = 0  # start of that repeat's measured phase

    @property
    def first_token_ns(self) -> int | None:
        return self.chunk_ns[0] if self.chunk_ns else None


class Streamer:
    """Sends one streaming request and fills a :class:`RequestRecord`."""

    def __init__(self, client: httpx.AsyncClient, base_url: str) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")

    async def stream(self, path: str, payload: dict[str, Any], record: RequestRecord) -> None:
        payload = {
            **payload,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        decoder = SSEDecoder()
        tokens_so_far = 0
        text_parts: list[str] = []
        record.sent_ns = time.monotonic_ns()
        try:
            async with self.client.stream("POST", self.base_url + path, json=payload) as response:
                record.http_status = response.status_code
                if response.status_code != 200:
                    body = (await response.aread())[:1000].decode("utf-8", "replace")
                    record.error = f"HTTP {response.status_code}: {body}"
                    record.end_ns = time.monotonic_ns()
                    return
                # The transport's reads as they come (httpx's aiter_raw adds only bookkeeping per read);
                # aiohttp also yields an empty read at every HTTP chunk boundary.
                async for raw in response.stream:  # type: ignore[union-attr]
                    if not raw:
                        continue
                    arrived = time.monotonic_ns()
                    for data in decoder.feed(raw):
                        if data == b"[DONE]":
                            continue
                        event = orjson.loads(data)
                        if "error" in event:
                            record.error = f"stream error: {json.dumps(event['error'])[:500]}"
                            continue
                        usage = event.get("usage") or {}
                        for choice in event.get("choices") or ():
                            text_parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                            if choice.get("finish_reason"):
                                record.finish_reason = choice["finish_reason"]
                        if "completion_tokens" in usage:
                            new_tokens = usage["completion_tokens"] - tokens_so_far
                            tokens_so_far = usage["completion_tokens"]
                            record.prompt_tokens_reported = usage.get("prompt_tokens")
                            record.output_tokens_reported = tokens_so_far
                        else:
                            new_tokens = 0
                        if new_tokens > 0:
                            record.chunk_ns.append(arrived)
                            record.chunk_tokens.append(new_tokens)
                            if "servegrid_sent_ns" in event:
                                record.chunk_server_ns.append(event["servegrid_sent_ns"])
                record.end_ns = time.monotonic_ns()
        except (httpx.HTTPError, aiohttp.ClientError, TimeoutError) as exc:  # aiohttp's, when it is the transport
            record.end_ns = time.monotonic_ns()
            record.error = f"{type(exc).__name__}: {exc}"[:1000]
        except orjson.JSONDecodeError as exc:
            record.end_ns = time.monotonic_ns()
            record.error = f"malformed SSE payload: {exc}"
        record.text = "".join(text_parts)
        if record.error is None and record.output_tokens_reported is None:
            record.error = "stream ended without usage (the server must honour stream_options.continuous_usage_stats)"


class ClientMonitor:
    """Watches the client itself while a cell measures: event-loop lag and CPU.

    Every ``interval_s`` a task asks to sleep and records how late it woke up;
    a loop that is busy parsing (or blocked) wakes late, and then chunk
    timestamps are late by about as much. CPU is this process's user + system
    time over the wall time of the measured phases, as a fraction of one core.
    It can be started and stopped again (once per repeat); figures accumulate.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None
        self._cpu_start = self._wall_start = 0.0
        self._cpu_total = self._wall_total = 0.0

    async def _watch(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, time.monotonic() - started - self.interval_s))

    @staticmethod
    def _cpu() -> float:
        times = psutil.Process().cpu_times()
        return times.user + times.system

    def start(self) -> None:
        self._cpu_start, self._wall_start = self._cpu(), time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self._cpu_total += self._cpu() - self._cpu_start
        self._wall_total += time.monotonic() - self._wall_start

    def summary(self) -> dict[str, float | int | None]:
        lags = stats.percentiles(self.lags, (50, 99))
        return {
            "loop_lag_samples": len(self.lags),
            "loop_lag_p50_s": lags["p50"],
            "loop_lag_p99_s": lags["p99"],
            "loop_lag_max_s": max(self.lags) if self.lags else None,
            "cpu_fraction": self._cpu_total / self._wall_total if self._wall_total > 0 else None,
        }
