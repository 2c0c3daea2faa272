"""SSE framing and per-chunk timing, against the loopback calibration server."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from servegrid.calibration import Script
from servegrid.client import RequestRecord, SSEDecoder, Streamer

EVENTS = [b'data: {"a": 1}\n\n', b'data: {"b": 2}\r\n\r\n', b": keep-alive comment\n\n", b"data: [DONE]\n\n"]


def test_sse_decoder_reassembles_events_split_anywhere():
    stream = b"".join(EVENTS)
    expected = [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
    rng = random.Random(3)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(0, 8)))
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        decoder = SSEDecoder()
        got = [payload for piece in pieces for payload in decoder.feed(piece)]
        assert got == expected
        assert decoder.pending == b""


def test_sse_decoder_joins_multiline_data_fields():
    assert list(SSEDecoder().feed(b"data: line one\ndata: line two\n\n")) == [b"line one\nline two"]


def _record(output_tokens: int = 12) -> RequestRecord:
    return RequestRecord("r", 0, 0, "measured", 1, prompt_tokens_requested=4, output_tokens_requested=output_tokens)


async def _stream(url: str, payload: dict, record: RequestRecord, path: str = "/v1/completions") -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        await Streamer(client, url).stream(path, payload, record)


@pytest.mark.parametrize("tokens_per_chunk", [1, 3])
def test_streamer_counts_tokens_per_chunk_and_times_them(calibration, tokens_per_chunk):
    script = Script(ttft_s=0.08, interval_s=0.02, tokens_per_chunk=tokens_per_chunk)
    with calibration(script) as srv:
        record = _record(12)
        asyncio.run(_stream(srv.url, {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 12}, record))
    assert record.error is None
    assert record.http_status == 200
    assert sum(record.chunk_tokens) == 12 == record.output_tokens_reported
    assert record.chunk_tokens == [tokens_per_chunk] * (12 // tokens_per_chunk)
    assert record.prompt_tokens_reported == 4
    ttft = (record.chunk_ns[0] - record.sent_ns) / 1e9
    assert 0.08 <= ttft < 0.5
    gaps = [(b - a) / 1e9 for a, b in zip(record.chunk_ns, record.chunk_ns[1:], strict=False)]
    assert all(g >= 0.015 for g in gaps), gaps
    # The client stamps each chunk after the server wrote it, on the same clock.
    assert all(rx >= tx for rx, tx in zip(record.chunk_ns, record.chunk_server_ns, strict=True))
    assert record.finish_reason == "length"
    assert record.end_ns >= record.chunk_ns[-1]


def test_streamer_reads_chat_deltas(calibration):
    with calibration(Script(ttft_s=0.01, interval_s=0.001)) as srv:
        record = _record(5)
        payload = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}
        asyncio.run(_stream(srv.url, payload, record, "/v1/chat/completions"))
    assert record.error is None
    assert len(record.text.split()) == 5


def test_streamer_records_http_errors_without_raising(calibration):
    with calibration(Script()) as srv:
        record = _record()
        asyncio.run(_stream(srv.url, {"model": "m", "prompt": [1]}, record, "/v1/nowhere"))
    assert record.http_status == 404
    assert record.error.startswith("HTTP 404")
    assert record.chunk_ns == []


def test_streamer_records_connection_errors():
    record = _record()
    asyncio.run(_stream("http://127.0.0.1:9", {"model": "m", "prompt": [1]}, record))
    assert record.error and "ConnectError" in record.error
    assert record.end_ns is not None


def test_calibration_server_keeps_its_script_and_says_how_late_it_was(calibration):
    with calibration(Script(ttft_s=0.02, interval_s=0.01, tokens_per_chunk=2, jitter_s=0.002)) as srv:
        records = [_record(10) for _ in range(4)]

        async def four_streams() -> None:
            async with httpx.AsyncClient(timeout=10) as client:
                streamer = Streamer(client, srv.url)
                payload = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 10}
                await asyncio.gather(*(streamer.stream("/v1/completions", payload, r) for r in records))

        asyncio.run(four_streams())
        served = httpx.get(f"{srv.url}/servegrid/stats").json()
    assert served["requests"] == 4 and served["events"] == 4 * 5
    assert 0 <= served["late_p50_ms"] <= served["late_p99_ms"] <= served["late_max_ms"] < 50
    for record in records:
        assert record.chunk_tokens == [2] * 5
        gaps = [(b - a) / 1e6 for a, b in zip(record.chunk_server_ns, record.chunk_server_ns[1:], strict=False)]
        assert all(7 <= g <= 40 for g in gaps), gaps  # 10 ms ± 2 ms jitter, written on schedule
