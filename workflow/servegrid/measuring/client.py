"""Streaming OpenAI-compatible client with per-chunk timestamps.

Timing rules (all clocks are ``time.monotonic_ns``, system-wide on Linux):
- ``sent`` is taken immediately before the request is handed to aiohttp;
- every socket read is stamped inside the connection's ``data_received``, the
  first Python code that sees the bytes, before HTTP parsing, before any task
  wakes up and before any decoding (:class:`StampingResponseHandler`);
- each SSE event takes the stamp of the read that completed it; events are
  decoded after the stream ends (orjson), so decoding never delays a stamp;
- a chunk's token count is the increase of ``usage.completion_tokens``, which
  the engine's payloads (:mod:`servegrid.engines`) ask for in every chunk, so
  a chunk that carries several speculative tokens is counted as such, not as one.

Stamping at the read rather than where a consumer task resumes is what keeps
stamps honest when many streams burst at once: the loop runs every socket's
``data_received`` before it resumes any consumer, so a stamp waits for the
other sockets' reads (microseconds each), not for other streams' decoding
(benchmarks/client_overhead.py measures both, side by side).

Its two decoders (a running token count in every chunk, and, through a
gateway that drops it, tokens counted by chunk) share the stamped reads and the SSE framing kept here.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import functools
import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import aiohttp
import orjson
from aiohttp.client_proto import ResponseHandler

from servegrid.errors import CellError
from servegrid.records.request import RequestRecord

# Events end at a blank line; vLLM sends "\n\n", other servers may send "\r\n\r\n".
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def sse_events(body: bytes) -> Iterator[tuple[int, bytes]]:
    """Server-Sent-Events framing: each event's ``data:`` payload, with the offset just past its end."""
    start = 0
    for end in _EVENT_END.finditer(body):
        event = body[start : end.start()]
        start = end.end()
        if event.startswith(b"data:") and b"\n" not in event and b"\r" not in event:  # the usual case
            yield start, event[5:].lstrip(b" ")
            continue
        payload = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
        if payload:
            yield start, b"\n".join(payload)


class StampingResponseHandler(ResponseHandler):
    """aiohttp's per-connection protocol, stamping every read of a response body as it arrives.

    ``reads[body stream]`` gets ``(monotonic ns, body bytes received so far)``
    per socket read; :class:`Streamer` pops its response's list when done.
    """

    def __init__(self, *args: Any, reads: dict[Any, list[tuple[int, int]]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reads = reads

    def data_received(self, data: bytes) -> None:
        arrived = time.monotonic_ns()
        super().data_received(data)
        # aiohttp keeps the body stream of the response being parsed in _payload (3.x).
        body = self._payload
        if body is not None and data:
            self._reads.setdefault(body, []).append((arrived, body.total_bytes))


def _last_body_read_ns(stamps: list[tuple[int, int]]) -> int:
    """The last read of a stream that brought body bytes (stamps: (ns, body bytes so far)); 0 if none did. From the
    end: the guard asks every half second while a long stream's stamps run into thousands (the loop's time)."""
    for i in range(len(stamps) - 1, -1, -1):
        if stamps[i][1] > (stamps[i - 1][1] if i else 0):
            return stamps[i][0]
    return 0


class StampingConnector(aiohttp.TCPConnector):
    """A TCP connector that makes every connection a :class:`StampingResponseHandler`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reads: dict[Any, list[tuple[int, int]]] = {}
        if not hasattr(self, "_factory"):
            raise RuntimeError(
                f"aiohttp {aiohttp.__version__} has no TCPConnector._factory; servegrid needs it to stamp reads"
            )
        # aiohttp has no public hook for the protocol class; _factory is what it calls per connection (3.x).
        # A partial of the subclass is one of the class (typeshed declares partial invariant, its call is not).
        self._factory = cast(
            "functools.partial[ResponseHandler]",
            functools.partial(StampingResponseHandler, loop=asyncio.get_running_loop(), reads=self.reads),
        )


def streaming_session(
    connections: int, request_timeout_s: float, headers: dict[str, str] | None = None
) -> aiohttp.ClientSession:
    """The session :class:`Streamer` needs: stamping connections, ``connections`` of them at most."""
    return aiohttp.ClientSession(
        connector=StampingConnector(limit=connections),
        # Like httpx's read timeout: the longest silence, so a long stream is never cut off while it flows.
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=request_timeout_s),
        headers=headers or {},
    )


_JSON = {"Content-Type": "application/json"}


class StartPacer:
    """Lets at most ``per_iteration`` requests start per event-loop iteration.

    Starting a request costs aiohttp about 0.15 ms of CPU. When hundreds of
    closed-loop sessions finish together and all start their next request in
    one iteration, the loop would not poll its sockets for tens of
    milliseconds, and every read arriving meanwhile would be stamped that much
    late, with nothing to show for it. Paced, the loop polls between starts:
    reads keep honest stamps, and the sends that wait are recorded (``sent``
    against ``intended_send``) and flagged when they slip too far. At 256
    streams, one start per iteration gave the lowest added p99 (0.9-1.2 ms,
    against 1.8-3.1 ms with eight). What it costs, measured there: sends went
    out up to 3.2 ms late (p99) with 16 sessions, 7.9 ms with 64.
    """

    def __init__(self, per_iteration: int = 1) -> None:
        self.per_iteration = per_iteration
        self._started = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._next_scheduled = False

    async def turn(self) -> None:
        if not self._waiting and self._started < self.per_iteration:
            self._take()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        await waiter

    def _take(self) -> None:
        self._started += 1
        if not self._next_scheduled:
            self._next_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_iteration)

    def _next_iteration(self) -> None:
        self._next_scheduled = False
        self._started = 0
        while self._waiting and self._started < self.per_iteration:
            waiter = self._waiting.popleft()
            if not waiter.done():  # a cancelled request gave up its turn
                waiter.set_result(None)
                self._take()


class Streamer:
    """Sends streaming requests and fills in one :class:`RequestRecord` per request.

    With ``decode=False`` a stream's events are decoded by :meth:`decode_pending`
    instead, once the measured phase is over, so that hundreds of streams ending
    together do not hold the loop (and the other streams' stamps) while they decode.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, per_chunk_usage: bool = True) -> None:
        """``per_chunk_usage=False``: the stream's events carry no running token count (a gateway that drops
        vLLM's continuous usage stats, servegrid.measuring.gateway_check): tokens are counted by chunk."""
        if not isinstance(session.connector, StampingConnector):
            raise TypeError("Streamer needs a session from servegrid.measuring.client.streaming_session()")
        self.session = session
        self.reads = session.connector.reads
        self.base_url = base_url.rstrip("/")
        self.per_chunk_usage = per_chunk_usage
        self.pacer = StartPacer()
        self._pending: list[tuple[bytes, list[tuple[int, int]], RequestRecord]] = []
        self.in_flight = 0  # requests sent and not yet ended (client_monitor.StallGuard reads these two)
        self.last_sent_ns = 0
        # When requests went in flight after none were: the start of a busy period. A send while others are in
        # flight is no progress (a timed-out request's successor would otherwise reset a hung engine's clock).
        self.busy_since_ns = 0

    async def stream(self, path: str, payload: dict[str, Any], record: RequestRecord, decode: bool = True) -> None:
        """POST ``payload`` (a complete streaming request, as the engine builds it) to ``path``."""
        body = orjson.dumps(payload)
        await self.pacer.turn()
        record.sent_ns = self.last_sent_ns = time.monotonic_ns()
        if self.in_flight == 0:
            self.busy_since_ns = record.sent_ns
        self.in_flight += 1
        try:
            async with self.session.post(self.base_url + path, data=body, headers=_JSON) as response:
                record.http_status = response.status
                try:
                    raw = await response.content.read()
                finally:
                    reads = self.reads.pop(response.content, [])
        except (aiohttp.ClientError, TimeoutError) as exc:
            record.end_ns = time.monotonic_ns()
            record.error = f"{type(exc).__name__}: {exc}"[:1000]
            return
        finally:
            self.in_flight -= 1
        record.end_ns = reads[-1][0] if reads else time.monotonic_ns()
        if record.http_status != 200:
            record.error = f"HTTP {record.http_status}: {raw[:1000].decode('utf-8', 'replace')}"
        elif decode:
            decode_into(raw, reads, record, self.per_chunk_usage)
        else:
            self._pending.append((raw, reads, record))

    def last_progress_ns(self) -> int:
        """When a byte of a stream's body last arrived (an event: a token, for an engine; a response's headers are
        none, since a hung engine's API server still sends them), or requests went in flight after none were."""
        return max([self.busy_since_ns, *(_last_body_read_ns(stamps) for stamps in self.reads.values())])

    async def open_connections(
        self, count: int, path: str, identity: str | None = None, names: Callable[[bytes], list[str]] | None = None
    ) -> None:
        """Fill the keep-alive pool with ``count`` connections (``GET path`` on each: a cheap endpoint).

        Run before a measured phase so its sessions do not all connect at once:
        hundreds of connects completing together would send their requests in one
        loop iteration, past the pacer, and hold the loop as long.

        With ``identity``, ``path`` lists the names the server answers to (read by ``names``) and every connection
        must reach the server that answers to ``identity``: where two servers share a port (SO_REUSEPORT), the
        kernel spreads connections between them, and a connection to the other one would be measured silently.
        """

        async def check() -> None:
            async with self.session.get(self.base_url + path) as response:
                body = await response.read()
                self.reads.pop(response.content, None)
            if identity is None or names is None:
                return
            answers_as = names(body)
            if identity not in answers_as:
                raise CellError(
                    f"a connection to {self.base_url} reached another server (it answers as {answers_as or 'nothing'}, "
                    f"not as {identity}): two servers share its port; nothing was measured on it"
                )

        # Held open together, each GET needs its own connection.
        await asyncio.gather(*(check() for _ in range(count)))

    def decode_pending(self) -> None:
        """Decode the streams that :meth:`stream` was told not to decode yet."""
        pending, self._pending = self._pending, []
        for raw, reads, record in pending:
            decode_into(raw, reads, record, self.per_chunk_usage)


def decode_into(raw: bytes, reads: list[tuple[int, int]], record: RequestRecord, per_chunk_usage: bool = True) -> None:
    try:
        if per_chunk_usage:
            decode_stream(raw, reads, record)
        else:
            decode_counted_by_chunk(raw, reads, record)
    except (ValueError, TypeError, AttributeError) as exc:  # JSON errors are ValueErrors too
        # One request with a malformed event is one failed request, never a lost cell.
        record.error = f"malformed SSE event: {exc}"[:1000]
    if record.error is None and record.output_tokens_reported is None:
        record.error = "stream ended without usage (the server must report usage in every chunk)"


def _received(raw: bytes, reads: list[tuple[int, int]]) -> list[int]:
    """Body bytes received by each stamped read; checks that the stamps cover the whole body."""
    received = [total for _, total in reads]
    if raw and (not reads or received[-1] < len(raw)):
        raise RuntimeError(
            f"{len(raw)} body bytes but reads stamped up to {received[-1] if reads else 0}: "
            f"aiohttp {aiohttp.__version__} no longer calls StampingResponseHandler as servegrid expects"
        )
    return received


def stream_events(raw: bytes, record: RequestRecord | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each JSON event of an SSE body with the offset just past it; an ``error`` event is put on ``record``
    (where given) and skipped, ``[DONE]`` skipped, anything that is not a JSON object raises ValueError."""
    for end, data in sse_events(raw):
        if data == b"[DONE]":
            continue
        event = orjson.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"an event is JSON but not an object: {data[:200]!r}")
        if "error" in event:
            if record is not None:
                record.error = f"stream error: {json.dumps(event['error'])[:500]}"
            continue
        yield end, event


def choice_text(choice: dict[str, Any]) -> str:
    """The text a choice carries: a completion's ``text`` or a chat chunk's ``delta.content``."""
    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    if not isinstance(piece, str):
        raise ValueError(f"a choice's text is {piece!r}, not a string")
    return piece


def decode_stream(raw: bytes, reads: list[tuple[int, int]], record: RequestRecord) -> None:
    """Fill ``record`` from a whole SSE body and the stamped reads it arrived in."""
    received = _received(raw, reads)
    tokens_so_far = 0
    text_parts: list[str] = []
    uncounted_text = False  # text arrived in an event that gave no token count
    for end, event in stream_events(raw, record):
        usage = event.get("usage") or {}
        completion = usage.get("completion_tokens")
        for choice in event.get("choices") or ():
            piece = choice_text(choice)
            text_parts.append(piece)
            uncounted_text |= bool(piece) and completion is None
            if choice.get("finish_reason"):
                record.finish_reason = str(choice["finish_reason"])
        if completion is None:  # absent or null: this event says nothing about tokens
            continue
        if not isinstance(completion, int) or isinstance(completion, bool):
            raise ValueError(f"usage.completion_tokens is {completion!r}, not an integer")
        prompt_tokens = usage.get("prompt_tokens")
        if prompt_tokens is not None and (not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool)):
            raise ValueError(f"usage.prompt_tokens is {prompt_tokens!r}, not an integer")
        new_tokens = completion - tokens_so_far
        tokens_so_far = completion
        record.prompt_tokens_reported = usage.get("prompt_tokens")
        record.output_tokens_reported = tokens_so_far
        if new_tokens > 0:
            record.chunk_ns.append(reads[bisect.bisect_left(received, end)][0])
            record.chunk_tokens.append(new_tokens)
            if isinstance(event.get("servegrid_sent_ns"), int):  # the calibration server's own stamp
                record.chunk_server_ns.append(event["servegrid_sent_ns"])
    record.text = "".join(text_parts)
    if uncounted_text and record.output_tokens_reported is not None:
        # Its tokens would be stamped with the next counted event's read: a first chunk without a count moves
        # the TTFT to the second one, silently. (A stream that never counts fails in decode_into, "without usage".)
        raise ValueError("an event with text has no usage.completion_tokens (null or absent): its tokens are untimed")


def decode_counted_by_chunk(raw: bytes, reads: list[tuple[int, int]], record: RequestRecord) -> None:
    """Fill ``record`` from a stream whose events carry text but no running token count, only a final usage
    (what LiteLLM's proxy makes of vLLM's stream). Every event with text is a chunk, stamped at the read that
    completed it; the final usage gives the exact totals. Where the chunks are as many as the tokens, each
    carried one and the per-chunk counts are exact; otherwise (speculative decoding sends several tokens in
    one chunk) they are spread evenly and ``chunk_tokens_exact`` is False: TTFT, e2e and TPOT stay exact,
    per-token inter-token latency is not computed from such a request (servegrid.analysis.aggregation)."""
    received = _received(raw, reads)
    text_parts: list[str] = []
    for end, event in stream_events(raw, record):
        usage = event.get("usage") or {}
        if isinstance(usage.get("completion_tokens"), int):
            record.output_tokens_reported = usage["completion_tokens"]
            record.prompt_tokens_reported = usage.get("prompt_tokens")
        for choice in event.get("choices") or ():
            piece = choice_text(choice)
            if piece:
                text_parts.append(piece)
                record.chunk_ns.append(reads[bisect.bisect_left(received, end)][0])
            if choice.get("finish_reason"):
                record.finish_reason = str(choice["finish_reason"])
    record.text = "".join(text_parts)
    total, chunks = record.output_tokens_reported, len(record.chunk_ns)
    if total is None or not chunks:
        return
    record.chunk_tokens_exact = chunks == total
    if chunks >= total:
        record.chunk_tokens = [1] * chunks
        return
    # The first chunk's first token is what TTFT times; the rest spread evenly, the remainder early.
    rest, extra = divmod(total - 1, max(chunks - 1, 1))
    record.chunk_tokens = [1] + [rest + (1 if i < extra else 0) for i in range(chunks - 1)] if chunks > 1 else [total]
