"""The calibration server's aiohttp application (:mod:`servegrid.testing.calibration`): both dialects' endpoints, the
scripted streaming, the faults on the wire, and a runner on a background event loop for tests and benchmarks.

One server behind two dialects, whose scripted streaming, tokenizer use, counters and faults
are shared by both and make sense only together.
"""

import asyncio
import json
import os
import random
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from servegrid import text
from servegrid.stats import intervals
from servegrid.testing import dialect as calibration_dialect
from servegrid.testing.calibration_script import (
    BLOCK,
    CHAT_GENERATION_PROMPT,
    CHAT_OVERHEAD_PER_MESSAGE,
    ENGINE_DEATH_LOG,
    ENGINE_OOM_LOG,
    Counters,
    Script,
    Vocabulary,
)
from servegrid.testing.dialect import CALIBRATION, DIALECTS, VLLM

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class _Ask:
    """What one streamed request asks for and what the script does to it: its output tokens, chat or completion,
    its fault (None: none), whether it stalls mid-stream, and the prompt tokens its usage reports."""

    n_out: int
    chat: bool
    fault: str | None
    stalls: bool
    prompt_tokens: int


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
        self.frozen_until_ns = 0  # Script.freezes: nothing is sent before then
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
    def _exit_if_told(self) -> None:
        """The exit-after fault: once its request is answered, the next health check or model list (the client asks
        one on each connection it opens for a stage) finds the process gone."""
        exit_after = [n for n, kind in self.script.faults.items() if kind == "exit-after"]
        if exit_after and self.counters.requests >= min(exit_after):
            os._exit(1)

    async def health(self, _: web.Request) -> web.Response:
        self._exit_if_told()
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
        self._exit_if_told()
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
        if self.counters.requests in s.freezes:
            self.frozen_until_ns = time.monotonic_ns() + int(s.freezes[self.counters.requests] * 1e9)
        failed = self._failed(fault)
        if failed is not None:
            return failed
        self.counters.running += 1
        self._count_prefix_hits(ids)
        self.counters.prompt_tokens += len(ids)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        ask = _Ask(n_out, chat, fault, stalls, len(ids) + s.prompt_tokens_offset)
        try:
            if not await self._send_chunks(request, response, ask):
                return response  # reset: no orderly end
        finally:
            self.counters.running -= 1
        await response.write_eof()
        return response

    def _failed(self, fault: str | None) -> web.Response | None:
        """The answer of a request the script fails before its stream starts (None: it streams)."""
        if fault in ("engine-death", "engine-oom"):
            sys.stderr.write(ENGINE_DEATH_LOG if fault == "engine-death" else ENGINE_OOM_LOG)
            sys.stderr.flush()
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)  # after the answer is sent, as vLLM exits
            message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
            return web.json_response({"error": {"message": message, "code": 500}}, status=500)
        if fault in ("500", "503"):
            message = f"calibration server told to fail request {self.counters.requests} with HTTP {fault}"
            return web.json_response({"error": {"message": message, "code": int(fault)}}, status=int(fault))
        return None

    async def _send_chunks(self, request: web.Request, response: web.StreamResponse, ask: _Ask) -> bool:
        """The stream's chunks on the script's schedule, then its end; False: the connection was reset mid-way."""
        s, n_out = self.script, ask.n_out
        start = time.monotonic_ns()
        due = start + int(s.ttft_s * 1e9)
        produced = 0
        first_ns = last_ns = start
        while produced < n_out:
            take = min(s.chunk_tokens, n_out - produced)
            due = await self._wait_for_chunk(due, ask.stalls and bool(produced))
            produced += take
            sent = time.monotonic_ns()
            event = self._chunk_event(ask, produced, take, sent, late=max(0, sent - due))
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if ask.fault == "not-object" and produced == take:
                await response.write(b"data: [1, 2]\n\n")
            if ask.fault == "reset" and (produced >= 2 * s.chunk_tokens or produced == n_out):
                await _reset(request)
                return False
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
        return True

    async def _wait_for_chunk(self, due: int, stalled: bool) -> int:
        """Sleep until the chunk is due (later, if the engine is frozen meanwhile); the time it was due then."""
        if stalled:
            await asyncio.sleep(3600)  # an engine stuck mid-stream, its health check still 200
        due = max(due, self.frozen_until_ns)  # a frozen engine sends nothing, then resumes
        await _sleep_until(due)
        if self.frozen_until_ns > due:  # frozen while this chunk waited
            due = self.frozen_until_ns
            await _sleep_until(due)
        return due

    def _chunk_event(self, ask: _Ask, produced: int, take: int, sent: int, late: int) -> dict[str, Any]:
        """One chunk's SSE event (``take`` tokens, ``produced`` so far), counted on the server's counters."""
        s = self.script
        self.counters.late_ns.append(late)
        self.counters.events += 1
        if s.speculative_tokens:
            self.counters.verification_steps += 1
            self.counters.draft_tokens += s.speculative_tokens
            self.counters.accepted_tokens += take - 1
        words = " " + " ".join(self.rng.choice(text.WORDS) for _ in range(take))
        last = produced == ask.n_out
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
        choice.update({"delta": {"content": words}} if ask.chat else {"text": words})
        completion: int | None = produced + (s.completion_tokens_offset if last else 0)
        if ask.fault == "null-tokens" and produced == take:
            completion = None
        return {
            "object": "chat.completion.chunk" if ask.chat else "text_completion",
            "model": self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": ask.prompt_tokens, "completion_tokens": completion},
            "servegrid_sent_ns": sent,
            "servegrid_late_ns": late,
        }


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
        exits = {"engine-death", "engine-oom", "exit-after"} & set(script.faults.values())
        if exits:
            raise ValueError(f"the {exits.pop()} fault exits the process: only a calibration server of its own has it")
        self.server = CalibrationServer(script, dialect=dialect, api_key=api_key)
        self.host, self.port = host, port
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        self._runner = web.AppRunner(self.server.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the port the OS gave (port 0 asks for any)
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
