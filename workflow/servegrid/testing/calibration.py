"""A loopback calibration server: OpenAI-style streaming with scripted timing, no model.

It streams with a whitespace "tokenizer" and a script: time to first token,
interval per chunk, tokens per chunk, jitter. Every SSE event carries the
monotonic time it was written (``servegrid_sent_ns``) and how late that was
against the script (``servegrid_late_ns``), so a client's own latency can be
measured event by event, and an overloaded calibration server is visible too.

It speaks one of two dialects (``--dialect``):

- ``vllm`` (the default): vLLM's endpoints, request fields and metric names, and it
  accepts and ignores vLLM's launch flags, so that a config's ``engine.command``
  can point at it under the vLLM engine;
- ``calibration``: endpoints, request fields, metric names, start-up log line,
  launch flags and API key variable of its own (:mod:`servegrid.testing.dialect`),
  spoken by :class:`servegrid.testing.engine.CalibrationEngine`. A second engine
  that shares nothing on the wire with vLLM is what shows that servegrid reaches
  its servers through the engine boundary only.

It is a test and calibration tool: it never stands in for vLLM in the
pipeline, the demo or the benchmarks of serving configurations.

Faults on the wire are scripted per request (``--fault N=KIND``, :data:`FAULT_KINDS`): only a
server told exactly which request to spoil lets a test find that request in the cell file and time
the client's answer to it, while the requests around it show the rest of the cell was measured.

It runs over 300 lines: one server behind two dialects, whose scripted
streaming, tokenizer, counters and faults are shared by both and make sense only together.

    python -m servegrid.testing.calibration --port 8900 --ttft 0.05 --interval 0.01
    python -m servegrid.testing.calibration --fault 3=reset --fault 4=503
    python -m servegrid.testing.calibration --dialect calibration --listen 127.0.0.1:8900
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import struct
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from servegrid import text
from servegrid.stats import intervals
from servegrid.testing import dialect as calibration_dialect
from servegrid.testing.dialect import CALIBRATION, DIALECTS, VLLM

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# What ``Script.faults`` can do to one generation request. Each is something a real server or the
# network between does to a stream, and each must cost the client one failed request, never the cell.
FAULT_KINDS = {
    "reset": "stream two chunks, then reset the TCP connection (RST): the client's read fails mid-stream",
    "500": "answer HTTP 500 with a JSON error body instead of streaming",
    "503": "answer HTTP 503 with a JSON error body instead of streaming (an overloaded server)",
    "not-object": "after the first chunk, one SSE event whose data is JSON but not an object ([1, 2])",
    "null-tokens": "the first chunk's usage.completion_tokens is null: its tokens cannot be timed",
}


@dataclass
class Script:
    """How the server streams. Times in seconds."""

    ttft_s: float = 0.02
    interval_s: float = 0.005
    tokens_per_chunk: int = 1
    jitter_s: float = 0.0
    seed: int = 0
    # Speculative decoding as the metrics see it: each chunk is one verification step of this many
    # draft tokens, all accepted (its tokens beyond the first), and carries up to this many + 1 tokens.
    speculative_tokens: int = 0
    # Deliberate faults, to provoke the client's validity checks.
    prompt_tokens_offset: int = 0
    completion_tokens_offset: int = 0
    prefix_cache: bool = True
    fail_with_status: int = 0  # answer every generation request with this HTTP status
    legacy_metric_names: bool = False  # the vLLM dialect's names before vLLM 0.11
    context_limit: int = calibration_dialect.CONTEXT_LIMIT  # what /v1/models reports as max_model_len
    stall_from_request: int = 0  # fault: from this request on (1-based), stream one chunk, then hang; 0: never
    # Faults of single requests: {request number (1-based, counted as stall_from_request counts them): a
    # FAULT_KINDS key}. Request 1 is the server's own start-up warm-up, then come the cell's.
    faults: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = {n: kind for n, kind in self.faults.items() if kind not in FAULT_KINDS or n < 1}
        if unknown:
            raise ValueError(f"faults {unknown} (request numbers from 1, kinds: {', '.join(FAULT_KINDS)})")

    @property
    def chunk_tokens(self) -> int:
        return self.speculative_tokens + 1 if self.speculative_tokens else self.tokens_per_chunk


@dataclass
class Counters:
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    running: int = 0
    events: int = 0
    verification_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    late_ns: list[int] = field(default_factory=list)
    seen_blocks: set[int] = field(default_factory=set)
    # Its own timing of each request, as an engine's histograms keep it: seconds summed, requests counted.
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)


class Vocabulary:
    """Whitespace tokens ↔ ids: deterministic, good enough to count and round-trip."""

    def __init__(self) -> None:
        self.words = ["<|endoftext|>", *sorted(set(text.WORDS))]
        self.ids = {w: i for i, w in enumerate(self.words)}

    def encode(self, content: str) -> list[int]:
        return [
            self.ids.get(w.strip(".?!,").lower(), 1 + zlib.crc32(w.encode()) % (len(self.words) - 1))
            for w in content.split()
        ]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i % len(self.words)] for i in ids)


CHAT_OVERHEAD_PER_MESSAGE = 3
CHAT_GENERATION_PROMPT = 2
BLOCK = calibration_dialect.KV_BLOCK_TOKENS


class CalibrationServer:
    def __init__(
        self,
        script: Script,
        model: str = "calibration",
        dialect: str = VLLM,
        api_key: str | None = None,
        aliases: list[str] | None = None,
    ) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r} (known: {', '.join(DIALECTS)})")
        self.script = script
        self.model = model
        self.names = [model, *(aliases or [])]  # it answers to each, as vLLM with several served names
        self.dialect = dialect
        self.api_key = api_key
        self.vocab = Vocabulary()
        self.counters = Counters()
        self.rng = random.Random(script.seed)

    def app(self) -> web.Application:
        if self.dialect == CALIBRATION:
            paths = calibration_dialect.PATHS
            routes = [
                web.get(paths["health"], self.health),
                web.get(paths["info"], self.info),
                web.get(paths["metrics"], self.metrics),
                web.post(paths["tokenize"], self.tokenize_calibration),
                web.post(paths["detokenize"], self.detokenize_calibration),
                web.post(paths["reset_cache"], self.reset_cache),
                web.post(paths["completions"], self.completions),
                web.post(paths["chat"], self.chat),
            ]
        else:
            routes = [
                web.get("/health", self.health),
                web.get("/version", self.version),
                web.get("/v1/models", self.models),
                web.get("/metrics", self.metrics),
                web.post("/tokenize", self.tokenize_vllm),
                web.post("/detokenize", self.detokenize_vllm),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
            ]
        app = web.Application(middlewares=[self._authenticate] if self.api_key else [])
        app.add_routes([*routes, web.get("/servegrid/stats", self.stats)])
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every endpoint but the health check wants the key, so a client that forgets it fails loudly."""
        health = calibration_dialect.PATHS["health"] if self.dialect == CALIBRATION else "/health"
        if request.path != health and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "missing or wrong API key"}}, status=401)
        return await handler(request)

    # ---- plain endpoints --------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def stats(self, _: web.Request) -> web.Response:
        """How the server kept to its script: if it was late, the client's figures say nothing."""
        late_ms = [ns / 1e6 for ns in self.counters.late_ns]
        quantiles = intervals.percentiles(late_ms, (50, 99), enough_only=False)
        return web.json_response(
            {
                "requests": self.counters.requests,
                "events": self.counters.events,
                "late_p50_ms": quantiles["p50"],
                "late_p99_ms": quantiles["p99"],
                "late_max_ms": max(late_ms) if late_ms else None,
            }
        )

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "calibration"})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"data": [{"id": name, "max_model_len": self.script.context_limit} for name in self.names]}
        )

    async def info(self, _: web.Request) -> web.Response:
        return web.json_response(calibration_dialect.info() | {"names": self.names})

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids: list[int] = []
        for message in messages:
            ids += [0] * CHAT_OVERHEAD_PER_MESSAGE + self.vocab.encode(message.get("content") or "")
        return ids + [0] * CHAT_GENERATION_PROMPT

    async def tokenize_vllm(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids = self._chat_ids(body["messages"]) if "messages" in body else self.vocab.encode(body["prompt"])
        return web.json_response({"count": len(ids), "tokens": ids, "max_model_len": self.script.context_limit})

    async def detokenize_vllm(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": self.vocab.decode(body["tokens"])})

    async def tokenize_calibration(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(
            {"ids": self._chat_ids(body["messages"]) if "messages" in body else self.vocab.encode(body["text"])}
        )

    async def detokenize_calibration(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"text": self.vocab.decode(body["ids"])})

    async def reset_cache(self, _: web.Request) -> web.Response:
        self.counters.seen_blocks.clear()
        return web.json_response({"emptied": True})

    async def metrics(self, _: web.Request) -> web.Response:
        c = self.counters
        counters = {
            "prefix_cache_queries": c.prefix_queries,
            "prefix_cache_hits": c.prefix_hits,
            "prompt_tokens": c.prompt_tokens,
            "generation_tokens": c.generation_tokens,
        }
        if self.script.speculative_tokens:  # as engines do: speculative metrics only while speculating
            counters |= {
                "spec_decode_num_drafts": c.verification_steps,
                "spec_decode_num_draft_tokens": c.draft_tokens,
                "spec_decode_num_accepted_tokens": c.accepted_tokens,
            }
        gauges = {
            "num_requests_running": c.running,
            "num_requests_waiting": 0,
            "kv_cache_usage_perc": min(1.0, c.running / calibration_dialect.KV_POOL_SEQUENCES),
        }
        histograms = {"time_to_first_token_seconds": c.ttft_s, "request_time_per_output_token_seconds": c.tpot_s}
        if self.dialect == CALIBRATION:
            exposition = calibration_dialect.calibration_exposition(self.model, counters, gauges, histograms)
        else:
            exposition = calibration_dialect.vllm_exposition(
                self.model, counters, gauges, histograms, legacy=self.script.legacy_metric_names
            )
        return web.Response(text=exposition, content_type="text/plain")

    # ---- streaming ---------------------------------------------------------------
    def _count_prefix_hits(self, ids: list[int]) -> None:
        """Block-wise prefix caching as vLLM does it: a chain of block hashes, hits up to the first miss."""
        chain, hits, missed = 0, 0, False
        for start in range(0, len(ids) - len(ids) % BLOCK, BLOCK):
            chain = hash((chain, *ids[start : start + BLOCK]))
            if not missed and self.script.prefix_cache and chain in self.counters.seen_blocks:
                hits += BLOCK
            else:
                missed = True
            self.counters.seen_blocks.add(chain)
        self.counters.prefix_queries += len(ids)
        self.counters.prefix_hits += hits

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else self.vocab.encode(prompt)
        return await self._stream(request, body, ids, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await self._stream(request, body, self._chat_ids(body["messages"]), chat=True)

    def _output_tokens(self, body: dict[str, Any]) -> int | None:
        """How many tokens the request asks for, in the dialect's own field (vLLM's default: 16)."""
        if self.dialect == CALIBRATION:
            value = body.get(calibration_dialect.OUTPUT_TOKENS_FIELD)
            return value if isinstance(value, int) and value > 0 else None
        return int(body.get("max_tokens") or 16)

    async def _stream(
        self, request: web.Request, body: dict[str, Any], ids: list[int], chat: bool
    ) -> web.StreamResponse:
        s = self.script
        if s.fail_with_status and self.counters.requests > 0:  # the first (warm-up) request succeeds
            self.counters.requests += 1
            error = {"error": {"message": "calibration server told to fail", "code": s.fail_with_status}}
            return web.json_response(error, status=s.fail_with_status)
        n_out = self._output_tokens(body)
        if n_out is None:
            message = f"'{calibration_dialect.OUTPUT_TOKENS_FIELD}' (a positive integer) is required"
            return web.json_response({"error": {"message": message}}, status=400)
        self.counters.requests += 1
        stalls = bool(s.stall_from_request) and self.counters.requests >= s.stall_from_request
        fault = s.faults.get(self.counters.requests)
        if fault in ("500", "503"):
            message = f"calibration server told to fail request {self.counters.requests} with HTTP {fault}"
            return web.json_response({"error": {"message": message, "code": int(fault)}}, status=int(fault))
        self.counters.running += 1
        self._count_prefix_hits(ids)
        self.counters.prompt_tokens += len(ids)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        start = time.monotonic_ns()
        due = start + int(s.ttft_s * 1e9)
        produced = 0
        first_ns = last_ns = start
        prompt_tokens = len(ids) + s.prompt_tokens_offset
        try:
            while produced < n_out:
                take = min(s.chunk_tokens, n_out - produced)
                if stalls and produced:
                    await asyncio.sleep(3600)  # an engine stuck mid-stream, its health check still 200
                await _sleep_until(due)
                produced += take
                sent = time.monotonic_ns()
                late = max(0, sent - due)
                self.counters.late_ns.append(late)
                self.counters.events += 1
                if s.speculative_tokens:
                    self.counters.verification_steps += 1
                    self.counters.draft_tokens += s.speculative_tokens
                    self.counters.accepted_tokens += take - 1
                words = " " + " ".join(self.rng.choice(text.WORDS) for _ in range(take))
                choice = {"index": 0, "finish_reason": "length" if produced == n_out else None}
                choice.update({"delta": {"content": words}} if chat else {"text": words})
                completion: int | None = produced + (s.completion_tokens_offset if produced == n_out else 0)
                if fault == "null-tokens" and produced == take:
                    completion = None
                event = {
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": self.model,
                    "choices": [choice],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion},
                    "servegrid_sent_ns": sent,
                    "servegrid_late_ns": late,
                }
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                if fault == "not-object" and produced == take:
                    await response.write(b"data: [1, 2]\n\n")
                if fault == "reset" and (produced >= 2 * s.chunk_tokens or produced == n_out):
                    await _reset(request)
                    return response
                if produced == take:
                    first_ns = sent
                    self.counters.ttft_s.append((sent - start) / 1e9)
                last_ns = sent
                jitter = self.rng.uniform(-s.jitter_s, s.jitter_s) if s.jitter_s else 0.0
                due += int(max(0.0, s.interval_s + jitter) * 1e9)
            await response.write(b"data: [DONE]\n\n")
            self.counters.generation_tokens += n_out
            if n_out > 1:
                self.counters.tpot_s.append((last_ns - first_ns) / 1e9 / (n_out - 1))
        finally:
            self.counters.running -= 1
        await response.write_eof()
        return response


async def _reset(request: web.Request) -> None:
    """Abort the connection with a TCP reset, as a crashed proxy or a killed worker would.

    SO_LINGER with a zero timeout turns the close into an RST instead of an orderly FIN; the short
    sleep first lets the chunks already written reach the client, which a reset would discard.
    """
    await asyncio.sleep(0.05)
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _sleep_until(deadline_ns: int) -> None:
    delay = (deadline_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        await asyncio.sleep(delay)


class RunningServer:
    """A calibration server on a background event loop thread (for tests and benchmarks)."""

    def __init__(
        self, script: Script, host: str = "127.0.0.1", port: int = 0, dialect: str = VLLM, api_key: str | None = None
    ) -> None:
        self.server = CalibrationServer(script, dialect=dialect, api_key=api_key)
        self.host, self.port = host, port
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        self._runner = web.AppRunner(self.server.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = site._server.sockets if site._server else []
        self.port = sockets[0].getsockname()[1]
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


def _parser(dialect: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m servegrid.testing.calibration",
        description="servegrid calibration server (loopback only by default). In the vllm dialect it accepts "
        "and ignores vLLM's launch flags, so a config's engine.command can point at it in tests; in the "
        "calibration dialect it takes its own flags only.",
        allow_abbrev=False,  # an engine flag must never pass for an abbreviation of one of ours
    )
    parser.add_argument("--dialect", choices=DIALECTS, default=VLLM)
    if dialect == CALIBRATION:
        parser.add_argument("--listen", default="127.0.0.1:8900", metavar="HOST:PORT")
        parser.add_argument("--name", nargs="+", default=["calibration"], help="the served model's names")
        parser.add_argument("--model", help="ignored (the config's {model} placeholder lands here)")
        parser.add_argument(
            "--speculative-tokens", type=int, default=0, help="draft tokens per step (chunks of this + 1)"
        )
    else:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8900)
        parser.add_argument("--served-model-name", nargs="+", default=["calibration"])
    parser.add_argument("--ttft", type=float, default=0.02, help="seconds to the first chunk")
    parser.add_argument("--interval", type=float, default=0.005, help="seconds between chunks")
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--jitter", type=float, default=0.0)
    parser.add_argument("--context-limit", type=int, default=calibration_dialect.CONTEXT_LIMIT,
                        help="the longest request it says it accepts")  # fmt: skip
    parser.add_argument("--stall-from-request", type=int, default=0,
                        help="fault: from this request on (1-based), one chunk and then nothing")  # fmt: skip
    parser.add_argument("--fault", action="append", type=_fault, default=[], metavar="N=KIND",
                        help="fault: spoil generation request N (1-based; 1 is the start-up warm-up), repeatable; "
                        f"KIND: {', '.join(FAULT_KINDS)}")  # fmt: skip
    parser.add_argument("--no-prefix-cache", action="store_true", help="prefix caching off: never a cache hit")
    parser.add_argument("--prompt-tokens-offset", type=int, default=0, help="fault: misreport usage.prompt_tokens")
    parser.add_argument("--completion-tokens-offset", type=int, default=0, help="fault: misreport the output")
    parser.add_argument(
        "--fail-with",
        type=int,
        default=0,
        help="fault: answer every generation after the first (the warm-up) with this HTTP status",
    )
    return parser


def _fault(value: str) -> tuple[int, str]:
    """``N=KIND`` → (N, KIND), refused by argparse with the reason when either part is wrong."""
    number, sep, kind = value.partition("=")
    if not sep or not number.strip().isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected N=KIND with N a request number from 1, e.g. 3=reset")
    if kind not in FAULT_KINDS:
        raise argparse.ArgumentTypeError(f"{value!r}: unknown fault {kind!r} (known: {', '.join(FAULT_KINDS)})")
    return int(number), kind


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    which = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    which.add_argument("--dialect", choices=DIALECTS, default=VLLM)
    dialect = which.parse_known_args(argv)[0].dialect
    parser = _parser(dialect)
    if dialect == CALIBRATION:
        args = parser.parse_args(argv)  # its own flags only: another engine's flag is an error here
        host, _, port = args.listen.rpartition(":")
        names, api_key, speculative = (
            args.name,
            os.environ.get(calibration_dialect.API_KEY_VAR),
            args.speculative_tokens,
        )
        print(calibration_dialect.startup_line(), flush=True)
    else:
        args, _vllm_flags = parser.parse_known_args(argv)
        host, port, names, api_key, speculative = args.host, args.port, args.served_model_name, None, 0
    faults = dict(args.fault)
    if len(faults) < len(args.fault):
        parser.error(f"--fault: one fault per request (given: {', '.join(f'{n}={k}' for n, k in args.fault)})")
    script = Script(
        ttft_s=args.ttft,
        interval_s=args.interval,
        tokens_per_chunk=args.tokens_per_chunk,
        jitter_s=args.jitter,
        speculative_tokens=speculative,
        prompt_tokens_offset=args.prompt_tokens_offset,
        completion_tokens_offset=args.completion_tokens_offset,
        prefix_cache=not args.no_prefix_cache,
        fail_with_status=args.fail_with,
        context_limit=args.context_limit,
        stall_from_request=args.stall_from_request,
        faults=faults,
    )
    app = CalibrationServer(script, model=names[0], aliases=names[1:], dialect=dialect, api_key=api_key).app()
    web.run_app(app, host=host.strip("[]"), port=int(port), access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
