"""Where a trace cell's requests come from (``workloads.trace.source``): a file, or the seeded generator.

Both become one :class:`~servegrid.modes.trace_file.Trace`. A cell replays one of the mode's ``windows`` of it, then
the arrivals after that window as its drain (:class:`~servegrid.modes.trace_file.Replay`), named by their content's
hash, which :func:`cell_workload` puts into the cell's settings: a new trace file, window or generator setting
reruns exactly the cells whose requests changed, and a file reformatted with the same requests reruns none.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servegrid.errors import ConfigError
from servegrid.modes import trace_csv
from servegrid.modes.trace_file import FORMATS, Replay, Trace, Window, from_rows, parse_mooncake
from servegrid.modes.trace_generator import TraceShape, generate


def detect_format(path: Path) -> str:
    return "csv" if path.suffix.lower() == ".csv" else "mooncake"


@functools.lru_cache(maxsize=8)
def _read(path: str, fmt: str, block_tokens: int, mtime_ns: int, size: int) -> Trace:
    file = Path(path)
    return trace_csv.parse_csv(file, block_tokens) if fmt == "csv" else parse_mooncake(file, block_tokens)


def read(path: str | Path, fmt: str = "auto", block_tokens: int = 512) -> Trace:
    """The trace at ``path`` (cached while the file is unchanged); :class:`ConfigError` naming the file and line."""
    file = Path(path)
    if fmt not in FORMATS:
        raise ConfigError(f"trace format {fmt!r} (known: {', '.join(FORMATS)})")
    try:
        stat = file.stat()
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the trace: {exc.strerror}") from None
    return _read(str(file), detect_format(file) if fmt == "auto" else fmt, block_tokens, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _generated(shape: TraceShape, block_tokens: int) -> Trace:
    return from_rows(enumerate(generate(shape, block_tokens), start=1), block_tokens, "generated trace")


def whole(workload: Mapping[str, Any]) -> Trace:
    """The trace a trace mode's settings name, before any window."""
    source, block = workload["source"], int(workload["block_tokens"])
    if source.get("file") is not None:
        return read(source["file"], source.get("format", "auto"), block)
    return _generated(TraceShape.from_settings(source.get("generate") or {}), block)


def windows(workload: Mapping[str, Any]) -> tuple[Window, ...]:
    """The windows a trace mode's settings list (its grid axis beside the speedups)."""
    return tuple(Window.from_settings(w) for w in workload["windows"])


def replay(workload: Mapping[str, Any], window: Window, drain_arrivals: int = 0) -> Replay:
    """What a cell replays at ``window``: its arrivals, then up to ``drain_arrivals`` after it as the drain."""
    return whole(workload).replay(window, drain_arrivals)


def replayed(workload: Mapping[str, Any]) -> Replay:
    """What a trace cell replays, from the cell's own workload settings (its ``window`` and ``drain_arrivals``,
    which Experiment.cell_settings puts there). A cell measured before windows existed (2026-12-06) has neither:
    it replayed the whole trace, with no drain."""
    return replay(workload, Window.from_settings(workload.get("window") or {}), int(workload.get("drain_arrivals", 0)))


def cell_workload(workload: Mapping[str, Any], window: Window, drain_arrivals: int) -> dict[str, Any]:
    """A trace cell's workload settings: the mode's, with its own window (instead of every window), its drain and
    what it replays (its identity, instead of the whole trace's), so that a new window reruns no other cell and a
    trace edited outside a cell's window and drain reruns none of its cells."""
    own = {k: v for k, v in workload.items() if k not in ("windows", "trace")}
    own |= {"window": window.settings(), "drain_arrivals": drain_arrivals}
    return own | {"trace": identity(replayed(own))}


def identity(replayed: Replay | Trace) -> dict[str, Any]:
    """What settings hold of a replayed trace: the requests' hash and what they are (a replay's: its window's count
    and rate, the drain's arrivals, the longest request either sends)."""
    if isinstance(replayed, Trace):
        replayed = Replay(replayed, ())
    trace = replayed.window
    return {
        "sha256": replayed.sha256,
        "requests": len(trace.requests),
        "arrivals": len(trace.conversations),
        "rate": round(trace.rate, 6),
        "longest_tokens": replayed.sent.longest().total_tokens,
        "drain_arrivals": len(replayed.drain),
    }


def to_jsonl(trace: Trace) -> str:
    """The trace as Mooncake JSONL (what ``servegrid trace write`` prints): a generated trace for a reader, or for
    another tool to replay the same requests."""
    lines = []
    for r in trace.requests:
        row: dict[str, Any] = {
            "timestamp": r.timestamp_ms,
            "session_id": r.session,
            "delay": r.delay_ms,
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": list(r.hash_ids),
        }
        for key in ("timestamp", "delay"):  # whole milliseconds as integers, as Mooncake writes them
            if row[key] is not None and float(row[key]).is_integer():
                row[key] = int(row[key])
        lines.append(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")
    return "".join(lines)


def describe(trace: Trace) -> dict[str, Any]:
    """What ``servegrid trace show`` prints: the trace's size, pace, lengths and reuse."""
    prompts = sorted(r.input_tokens for r in trace.requests)
    outputs = sorted(r.output_tokens for r in trace.requests)

    def pct(values: list[int], q: float) -> int:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "source": trace.source,
        "requests": len(trace.requests),
        "arrivals": len(trace.conversations),
        "sessions": sum(1 for c in trace.conversations if len(c.turns) > 1),
        "span_s": round(trace.span_s, 3),
        "rate_per_s": round(trace.rate, 4),
        "block_tokens": trace.block_tokens,
        "prompt_tokens_p50_p99_max": [pct(prompts, 0.5), pct(prompts, 0.99), prompts[-1]],
        "output_tokens_p50_p99_max": [pct(outputs, 0.5), pct(outputs, 0.99), outputs[-1]],
        "sha256": trace.sha256,
    }
