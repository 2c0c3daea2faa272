"""A stand-in *process* for server-lifecycle tests: no model, no HTTP realism.

It behaves like vLLM where the process manager cares: it forks a child in its
own process group (as vLLM forks its engine core), serves /health, /version
and a non-streaming /v1/completions for the warm-up, and logs a KV-cache line.
Modes: ``--exit-at-start`` (bad argument), ``--never-healthy``,
``--ignore-sigterm`` (needs SIGKILL), ``--answer-as NAME`` (not the server it was launched as),
``--hang-after N`` (an engine stuck after N completions, its health check still 200).
Measurements never use it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar


class Handler(BaseHTTPRequestHandler):
    healthy = True
    names: ClassVar[list[str]] = ["fake"]

    def log_message(self, fmt: str, *args: object) -> None:
        print(fmt % args, flush=True)

    def _json(self, obj: object, status: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json({}, 200 if Handler.healthy else 503)
        elif self.path == "/version":
            self._json({"version": "fake-0"})
        elif self.path == "/v1/models":
            self._json({"data": [{"id": name, "max_model_len": 4096} for name in Handler.names]})
        else:
            self._json({"error": "not found"}, 404)

    hang_after: int | None = None  # completions answered before the "engine" hangs (health stays 200)
    answered = 0

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        Handler.answered += 1
        if Handler.hang_after is not None and Handler.answered > Handler.hang_after:
            time.sleep(3600)
        self._json({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}})


def blank_environment_in_proc() -> None:
    """As vLLM's engine core renames itself (setproctitle: ``VLLM::EngineCore``): the memory that
    /proc/PID/environ shows is overwritten, so the process's session variable cannot be read there."""
    import ctypes

    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115 - read once
    env_start, env_end = int(fields[47]), int(fields[48])  # fields 50 and 51 of proc(5)
    ctypes.memset(env_start, 0, env_end - env_start)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", nargs="+", default=["fake"])
    parser.add_argument("--hang-after", type=int, help="completions answered before every later one hangs")
    parser.add_argument("--answer-as", help="list this name instead of its own, as another process on the port would")
    parser.add_argument("--exit-at-start", action="store_true")
    parser.add_argument("--never-healthy", action="store_true")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--startup-delay", type=float, default=0.2)
    parser.add_argument("--start-when", help="stay unhealthy (not listening) until this file exists")
    args, _ = parser.parse_known_args()
    print(f"fake server pid {os.getpid()} args {sys.argv[1:]}", flush=True)
    if args.exit_at_start:
        print("error: argument --bogus: invalid choice (fake server exiting)", flush=True)
        return 2
    child = os.fork()
    if child == 0:  # the "engine core": same process group, outlives a SIGKILLed parent
        blank_environment_in_proc()
        if args.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    print(f"engine child pid {child}", flush=True)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        # As vLLM's API server does on SIGTERM: shut its engine down, then exit. (On SIGKILL the child
        # lives on, as vLLM's engine core does.)
        def shut_down(_signum: int, _frame: object) -> None:
            os.kill(child, signal.SIGKILL)
            os._exit(0)

        signal.signal(signal.SIGTERM, shut_down)
    time.sleep(args.startup_delay)
    while args.start_when and not os.path.exists(args.start_when):
        time.sleep(0.05)
    print("CPU KV cache size: 12,345 tokens, Maximum concurrency for 4,096 tokens per request: 3.01x", flush=True)
    Handler.healthy = not args.never_healthy
    Handler.hang_after = args.hang_after
    Handler.names = [args.answer_as] if args.answer_as else args.served_model_name
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
