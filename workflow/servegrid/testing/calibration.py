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

The server is :mod:`servegrid.testing.calibration_app`, its script and counters
:mod:`servegrid.testing.calibration_script`; this module is its command line, and
re-exports what tests and benchmarks import from it.

    python -m servegrid.testing.calibration --port 8900 --ttft 0.05 --interval 0.01
    python -m servegrid.testing.calibration --fault 3=reset --fault 4=503
    python -m servegrid.testing.calibration --dialect calibration --listen 127.0.0.1:8900
"""

from __future__ import annotations

import argparse
import os
import sys

from aiohttp import web

from servegrid.testing import dialect as calibration_dialect
from servegrid.testing.calibration_app import CalibrationServer, RunningServer
from servegrid.testing.calibration_script import FAULT_KINDS, Counters, Script, Vocabulary
from servegrid.testing.dialect import CALIBRATION, DIALECTS, VLLM

__all__ = ["FAULT_KINDS", "CalibrationServer", "Counters", "RunningServer", "Script", "Vocabulary", "main"]


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
    parser.add_argument(
        "--context-limit",
        type=int,
        default=calibration_dialect.CONTEXT_LIMIT,
        help="the longest request it says it accepts",
    )
    parser.add_argument(
        "--stall-from-request",
        type=int,
        default=0,
        help="fault: from this request on (1-based), one chunk and then nothing",
    )
    parser.add_argument(
        "--fault",
        action="append",
        type=_fault,
        default=[],
        metavar="N=KIND",
        help="fault: spoil generation request N (1-based; 1 is the start-up warm-up), repeatable; "
        f"KIND: {', '.join(FAULT_KINDS)}",
    )
    parser.add_argument(
        "--freeze",
        action="append",
        type=_freeze,
        default=[],
        metavar="N=SECONDS",
        help="fault: from generation request N on, no stream sends anything for SECONDS (the engine "
        "paused), then all go on; repeatable",
    )
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


def _freeze(value: str) -> tuple[int, float]:
    number, _, seconds = value.partition("=")
    try:
        return int(number), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected N=SECONDS (request number, pause)") from None


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
        freezes=dict(args.freeze),
    )
    app = CalibrationServer(script, model=names[0], aliases=names[1:], dialect=dialect, api_key=api_key).app()
    web.run_app(app, host=host.strip("[]"), port=int(port), access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
