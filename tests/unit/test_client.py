"""SSE framing and per-chunk timing, against the loopback calibration server."""

from __future__ import annotations

import asyncio
import gc

import httpx
import pytest

from servegrid.engines.vllm import VLLMEngine
from servegrid.measuring.client import (
    StartPacer,
    Streamer,
    decode_into,
    decode_stream,
    sse_events,
    streaming_session,
)
from servegrid.measuring.client_monitor import CollectorPause
from servegrid.records.request import RequestRecord
from servegrid.testing.calibration import Script

pytestmark = pytest.mark.exclusive  # the client's timestamps and the calibration server's schedule

EVENTS = [b'data: {"a": 1}\n\n', b'data: {"b": 2}\r\n\r\n', b": keep-alive comment\n\n", b"data: [DONE]\n\n"]


def test_sse_events_come_with_the_offset_just_past_their_end():
    body = b"".join(EVENTS)
    ends = [len(b"".join(EVENTS[: i + 1])) for i in range(len(EVENTS))]
    assert list(sse_events(body)) == [(ends[0], b'{"a": 1}'), (ends[1], b'{"b": 2}'), (ends[3], b"[DONE]")]


def test_sse_events_join_multiline_data_fields_and_skip_an_unfinished_event():
    first = b"data: line one\ndata: line two\n\n"
    assert list(sse_events(first + b"data: cut")) == [(len(first), b"line one\nline two")]


def _usage_event(tokens: int) -> bytes:
    return b'data: {"choices":[{"text":"x"}],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n' % tokens


def test_each_event_takes_the_stamp_of_the_read_that_completed_it():
    events = [_usage_event(1), _usage_event(3), _usage_event(4), b"data: [DONE]\n\n"]
    body = b"".join(events)
    first, second = len(events[0]), len(events[0]) + len(events[1])
    # Read 1 ends inside event 1; read 2 completes events 1 and 2; read 3 brings the rest.
    reads = [(100, first - 5), (200, second), (300, len(body))]
    record = _record(4)
    decode_stream(body, reads, record)
    assert record.chunk_ns == [200, 200, 300]
    assert record.chunk_tokens == [1, 2, 1]  # usage.completion_tokens grows by the tokens each chunk carries
    assert record.output_tokens_reported == 4 and record.prompt_tokens_reported == 3


def test_bytes_no_read_accounts_for_are_an_error_not_a_guess():
    with pytest.raises(RuntimeError, match="no longer calls StampingResponseHandler"):
        decode_stream(_usage_event(1), [(100, 10)], _record(1))


def test_the_pacer_starts_one_request_per_loop_iteration():
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        iteration = [0]

        def tick() -> None:  # runs once per loop iteration
            iteration[0] += 1
            loop.call_soon(tick)

        loop.call_soon(tick)
        pacer = StartPacer(per_iteration=2)
        started: list[int] = []

        async def request() -> None:
            await pacer.turn()
            started.append(iteration[0])

        await asyncio.gather(*(request() for _ in range(9)))
        return started

    started = asyncio.run(main())
    assert len(started) == 9
    assert max(started.count(i) for i in set(started)) <= 2
    assert len(set(started)) >= 5


def test_the_collector_is_paused_while_timing_and_left_as_it_was():
    assert gc.isenabled()
    pause = CollectorPause()
    pause.start()
    assert not gc.isenabled()
    pause.stop()
    assert gc.isenabled()
    gc.disable()
    try:
        pause.start()
        pause.stop()
        assert not gc.isenabled()  # someone else had turned it off: it stays off
    finally:
        gc.enable()


def _record(output_tokens: int = 12) -> RequestRecord:
    return RequestRecord("r", 0, 0, "measured", 1, prompt_tokens_requested=4, output_tokens_requested=output_tokens)


async def _stream(url: str, payload: dict, record: RequestRecord, path: str = "/v1/completions") -> None:
    async with streaming_session(4, 10) as session:
        await Streamer(session, url).stream(path, payload, record)


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
    assert record.error and "ClientConnectorError" in record.error
    assert record.end_ns is not None


def test_calibration_server_keeps_its_script_and_says_how_late_it_was(calibration):
    with calibration(Script(ttft_s=0.02, interval_s=0.01, tokens_per_chunk=2, jitter_s=0.002)) as srv:
        records = [_record(10) for _ in range(4)]

        async def four_streams() -> None:
            async with streaming_session(8, 10) as session:
                streamer = Streamer(session, srv.url)
                payload = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 10}
                await asyncio.gather(*(streamer.stream("/v1/completions", payload, r) for r in records))

        asyncio.run(four_streams())
        served = httpx.get(f"{srv.url}/servegrid/stats").json()
    assert served["requests"] == 4 and served["events"] == 4 * 5
    assert 0 <= served["late_p50_ms"] <= served["late_p99_ms"] <= served["late_max_ms"] < 50
    for record in records:
        assert record.chunk_tokens == [2] * 5
        gaps = [(b - a) / 1e6 for a, b in zip(record.chunk_server_ns, record.chunk_server_ns[1:], strict=False)]
        # 10 ms ± 2 ms jitter, on an absolute schedule: one late write shortens the next gap (a busy host
        # delays single writes), but on average the events keep the script's pace.
        assert all(0 < g <= 40 for g in gaps) and 8 <= sum(gaps) / len(gaps) <= 12.5, gaps


def test_streams_leave_no_read_stamps_behind(calibration):
    with calibration(Script(ttft_s=0.01, interval_s=0.002)) as srv:
        records = [_record(5) for _ in range(3)]

        async def three_streams() -> dict:
            async with streaming_session(8, 10) as session:
                streamer = Streamer(session, srv.url)
                await streamer.open_connections(3, "/health")
                payload = {"model": "m", "prompt": [1, 2], "max_tokens": 5}
                await asyncio.gather(*(streamer.stream("/v1/completions", payload, r, decode=False) for r in records))
                assert all(r.chunk_ns == [] for r in records)  # not decoded yet
                streamer.decode_pending()
                return dict(streamer.reads)

        assert asyncio.run(three_streams()) == {}
    assert all(r.error is None and r.chunk_tokens == [1] * 5 for r in records)
    assert all(r.end_ns >= r.chunk_ns[-1] >= r.chunk_ns[0] > r.sent_ns for r in records)


def test_a_stream_longer_than_aiohttps_default_buffer_is_read_whole(calibration):
    # aiohttp stops reading a socket once 128 KiB wait unread (its default buffer): a reader that drained
    # the body only at its end would stall there. 3,000 events of about 300 bytes each.
    with calibration(Script(ttft_s=0.0, interval_s=0.0)) as srv:
        record = _record(3000)
        asyncio.run(_stream(srv.url, {"model": "m", "prompt": [1, 2], "max_tokens": 3000}, record))
    assert record.error is None
    assert sum(record.chunk_tokens) == 3000 == record.output_tokens_reported


def test_a_silent_server_fails_the_request_on_the_read_timeout(calibration):
    with calibration(Script(ttft_s=5.0)) as srv:
        record = _record()

        async def impatient() -> None:
            async with streaming_session(2, 0.3) as session:
                await Streamer(session, srv.url).stream("/v1/completions", {"model": "m", "prompt": [1]}, record)

        asyncio.run(impatient())
    assert record.error and "Timeout" in record.error
    assert (record.end_ns - record.sent_ns) / 1e9 < 3


@pytest.mark.parametrize(
    ("event", "named"),
    [
        (b"[1, 2]", "not an object"),
        (b'"text"', "not an object"),
        (b'{"choices": [{"text": "a"}], "usage": {"completion_tokens": "3"}}', "not an integer"),
        (b'{"choices": ["a"], "usage": {"completion_tokens": 1}}', "malformed SSE event"),
        (b'{"choices": [{"text": "a"}], "usage": {"prompt_tokens": "4", "completion_tokens": 2}}', "not an integer"),
        (b'{"choices": [{"text": 5}], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}', "not a string"),
        (b"{not json", "malformed SSE event"),
        # Text without a count in a stream that counts: its tokens would be timed at the next count's read.
        (b'{"choices": [{"text": "b"}], "usage": {"completion_tokens": null}}', "its tokens are untimed"),
    ],
)
def test_a_malformed_event_fails_its_request_not_the_cell(event, named):
    good = b'data: {"choices": [{"text": "a"}], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}\n\n'
    raw = good + b"data: " + event + b"\n\ndata: [DONE]\n\n"
    record = RequestRecord("r", 0, 0, "measured", 1, 4, 2)
    decode_into(raw, [(1, len(raw))], record)
    assert record.error is not None and record.error.startswith("malformed SSE event")
    assert named in record.error


def test_null_token_counts_are_no_count_and_a_stream_without_any_is_an_error():
    raw = b'data: {"choices": [{"text": "a"}], "usage": {"completion_tokens": null}}\n\ndata: [DONE]\n\n'
    record = RequestRecord("r", 0, 0, "measured", 1, 4, 2)
    decode_into(raw, [(1, len(raw))], record)
    assert record.error is not None and "without usage" in record.error


def test_a_send_while_others_are_in_flight_is_no_progress(calibration):
    """The stall guard's clock: a request sent while others are in flight does not reset it (a timed-out request's
    successor, on a hung engine, would otherwise keep the guard from ever firing); only a byte that arrives does."""
    with calibration(Script(ttft_s=0.5, interval_s=1.0)) as srv:  # a chunk 0.5 s after each send, then 1 s apart

        async def overlapping() -> tuple[int, int, int]:
            async with streaming_session(4, 10) as session:
                streamer = Streamer(session, srv.url)
                payload = {"model": "m", "prompt": [1, 2], "max_tokens": 2}
                first = asyncio.ensure_future(streamer.stream("/v1/completions", payload, _record(2)))
                while not any(total for stamps in streamer.reads.values() for _, total in stamps):  # its first chunk
                    await asyncio.sleep(0.005)
                chunk_ns = streamer.last_progress_ns()
                await asyncio.sleep(0.1)
                second = asyncio.ensure_future(streamer.stream("/v1/completions", payload, _record(2)))
                await asyncio.sleep(0.2)  # the second request is out, its headers in, its first chunk 0.3 s away
                progress_ns, sent_ns = streamer.last_progress_ns(), streamer.last_sent_ns
                await asyncio.gather(first, second)
                return chunk_ns, progress_ns, sent_ns

        chunk_ns, progress_ns, sent_ns = asyncio.run(overlapping())
    assert sent_ns - chunk_ns > 0.05e9  # the second request went out after the chunk...
    assert progress_ns == chunk_ns  # ...and counted for nothing


def test_the_stall_limit_is_capped_by_the_cells_own_budget():
    from servegrid.measuring.client_monitor import stall_limit_s
    from servegrid.measuring.measured_phase import stall_ceiling_s

    warmup = _record(8)
    warmup.sent_ns, warmup.end_ns = 10**9, 11 * 10**9  # a 10 s warm-up request
    assert stall_limit_s([warmup], 32, 2.0, 60.0) == 3200.0  # 53 min without a ceiling
    settings = {"sampling": {"rule": {"max_duration_s": 300.0}}}
    ceiling = stall_ceiling_s(settings, request_timeout_s=1800.0)
    assert ceiling == 300.0 and stall_limit_s([warmup], 32, 2.0, 60.0, ceiling) == 300.0
    assert stall_ceiling_s({"sampling": {"rule": None}}, 1800.0) == 1800.0  # a fixed count: the request timeout
    assert stall_limit_s([warmup], 1, 2.0, 60.0, ceiling) == 100.0  # under the ceiling: from the warm-up
    assert stall_limit_s([warmup], 1, 200.0, 60.0, 30.0) == 200.0  # never under the floor


def test_every_connection_opened_for_a_stage_must_reach_the_launched_server():
    """Two real servers on one port, both bound with SO_REUSEPORT (as vLLM's several API servers bind): the kernel
    spreads connections between them. Each connection the client opens is asked for its server's names; one that
    reaches the other server fails the cell, where a health check alone would have measured it silently."""
    from aiohttp import web

    from servegrid.errors import CellError
    from servegrid.testing.calibration_app import CalibrationServer

    async def scenario() -> str:
        runners = []
        port = 0
        for name in ("servegrid-launched", "someone-else"):
            runner = web.AppRunner(CalibrationServer(Script(), model=name).app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", port, reuse_port=True)
            await site.start()
            port = port or site._server.sockets[0].getsockname()[1]
            runners.append(runner)
        try:
            async with streaming_session(16, 10) as session:
                # 16 new connections, spread by the kernel's hash of each one's ports: all on one server 2 × 2^-16.
                with pytest.raises(CellError) as raised:
                    await Streamer(session, f"http://127.0.0.1:{port}").open_connections(
                        16, VLLMEngine.names_path, "servegrid-launched", VLLMEngine().names
                    )
                return str(raised.value)
        finally:
            for runner in runners:
                await runner.cleanup()

    message = asyncio.run(scenario())
    assert "reached another server (it answers as ['someone-else'], not as servegrid-launched)" in message
    assert "two servers share its port" in message


def test_connections_to_the_launched_server_alone_pass_the_check(calibration):
    with calibration(Script()) as srv:

        async def scenario() -> None:
            async with streaming_session(8, 10) as session:
                await Streamer(session, srv.url).open_connections(
                    8, VLLMEngine.names_path, "calibration", VLLMEngine().names
                )

        asyncio.run(scenario())
        assert srv.counters.requests == 0  # a names request is no generation request
