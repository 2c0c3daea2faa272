"""A request trace: read (Mooncake JSONL or a plain CSV), checked line by line, windowed and hashed.

Two formats, one model (:class:`TraceRequest`):

- **Mooncake JSONL**, as AIPerf and Dynamo replay it: one JSON object per line with ``timestamp`` (ms),
  ``input_length``, ``output_length`` and ``hash_ids``, the ids of the prompt's fixed-size blocks
  (``block_tokens``, 512 in Mooncake's traces): two requests whose ``hash_ids`` start alike share those blocks'
  tokens. Optional ``session_id`` groups a conversation's turns; a later turn may give ``delay`` (ms after the
  previous turn's answer) instead of a ``timestamp``.
- **CSV** (servegrid.modes.trace_csv) a gateway's logs export to: a header line and ``timestamp`` (ms),
  ``input_tokens``, ``output_tokens``, optional ``session``, ``prefix_group`` and ``prefix_tokens``. Prefix
  sharing becomes block ids: requests of one ``prefix_group`` share its first ``prefix_tokens`` tokens (where no
  row of the group says, the whole blocks of its shortest request), and a session's later turn starts with the
  whole blocks of its previous turn's prompt, as a conversation does.

What a cell depends on is the trace's content, never its path: :attr:`Trace.sha256` hashes the parsed requests
(a reformatted file with the same requests keeps its cells) and is part of every trace cell's settings.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servegrid.errors import ConfigError

FORMATS = ("auto", "mooncake", "csv")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace; ``line``: where the file has it (1-based), for messages."""

    line: int
    timestamp_ms: float | None  # None: a later turn given by its delay after the previous answer
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    session: str | None = None
    delay_ms: float | None = None

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class Conversation:
    """What arrives at once: a request, or a session's turns (each later turn after the previous answer)."""

    arrival_ms: float
    turns: tuple[TraceRequest, ...]


@dataclass(frozen=True)
class Trace:
    """A trace's requests in arrival order, grouped into the units that arrive (:class:`Conversation`)."""

    source: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]
    conversations: tuple[Conversation, ...] = field(default=())
    window_s: float | None = None  # the window's stated length, if cut to one

    @functools.cached_property
    def sha256(self) -> str:
        """The requests' content (not the file's bytes, nor its path): what a trace cell's identity holds."""
        digest = hashlib.sha256(f"block_tokens={self.block_tokens}\n".encode())
        for r in self.requests:
            digest.update(json.dumps([r.timestamp_ms, r.input_tokens, r.output_tokens, r.hash_ids, r.session,
                                      r.delay_ms]).encode())  # fmt: skip
        return digest.hexdigest()[:16]

    @property
    def span_s(self) -> float:
        """From the first arrival to the last one (a conversation's later turns not counted)."""
        if len(self.conversations) < 2:
            return 0.0
        return (self.conversations[-1].arrival_ms - self.conversations[0].arrival_ms) / 1000

    @property
    def rate(self) -> float:
        """Requests per second at 1× speed, a conversation's every turn counted (what goodput is compared with):
        over the window's stated length, else the arrivals' rate over their span times requests per arrival."""
        if self.window_s:
            return len(self.requests) / self.window_s
        span = self.span_s
        if span <= 0:
            return 0.0
        return (len(self.conversations) - 1) / span * len(self.requests) / len(self.conversations)

    def window(self, start_s: float, duration_s: float | None) -> Trace:
        """The arrivals from ``start_s`` (after the first) for ``duration_s`` seconds (None: to the end)."""
        if not self.conversations:
            return self
        origin = self.conversations[0].arrival_ms + start_s * 1000
        end = math.inf if duration_s is None else origin + duration_s * 1000
        kept = tuple(c for c in self.conversations if origin <= c.arrival_ms < end)
        if not kept:
            raise ConfigError(f"{self.source}: no request arrives in the window from {start_s:g} s "
                              f"for {duration_s if duration_s is not None else 'the rest'} s")  # fmt: skip
        requests = tuple(t for c in kept for t in c.turns)
        return Trace(self.source, self.block_tokens, requests, kept, duration_s)

    def longest(self) -> TraceRequest:
        """The request holding the most tokens at its end (prompt + output)."""
        return max(self.requests, key=lambda r: (r.total_tokens, -r.line))

    def due_offsets_s(self, speedup: float) -> list[float]:
        """Each conversation's arrival, seconds after the first, at ``speedup`` × the trace's pace."""
        if not self.conversations:
            return []
        first = self.conversations[0].arrival_ms
        return [(c.arrival_ms - first) / 1000 / speedup for c in self.conversations]


def _group(source: str, requests: list[TraceRequest]) -> tuple[Conversation, ...]:
    """Arrival order, a session's turns together under its first turn's arrival."""
    sessions: dict[str, list[TraceRequest]] = {}
    units: list[list[TraceRequest]] = []
    for r in requests:
        if r.session is None:
            units.append([r])
            continue
        turns = sessions.get(r.session)
        if turns is None:
            if r.timestamp_ms is None:
                raise ConfigError(f"{source}:{r.line}: the first turn of session {r.session!r} has no timestamp")
            sessions[r.session] = turns = [r]
            units.append(turns)
        else:
            turns.append(r)
    conversations = [Conversation(float(turns[0].timestamp_ms or 0.0), tuple(turns)) for turns in units]
    conversations.sort(key=lambda c: (c.arrival_ms, c.turns[0].line))  # stable: ties keep the file's order
    return tuple(conversations)


def positive_int(value: Any, name: str, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < minimum:
        raise ConfigError(f"{where}: {name} {value!r} (expected an integer ≥ {minimum})")
    return int(value)


def milliseconds(value: Any, name: str, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: {name} {value!r} (expected milliseconds ≥ 0)")
    return float(value)


def _check_blocks(where: str, input_tokens: int, hash_ids: Sequence[int], block_tokens: int) -> None:
    """Mooncake's rule: the prompt fills every block but the last, which holds 1 to block_tokens tokens."""
    blocks = len(hash_ids)
    if not (blocks - 1) * block_tokens < input_tokens <= blocks * block_tokens:
        need = -(-input_tokens // block_tokens)
        raise ConfigError(
            f"{where}: input_length {input_tokens} needs {need} block(s) of {block_tokens} tokens but hash_ids has "
            f"{blocks} (is workloads.trace.block_tokens the trace's block size?)"
        )


def parse_mooncake(path: Path, block_tokens: int) -> Trace:
    rows: list[tuple[int, Any]] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            rows.append((number, json.loads(raw)))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg})") from None
    return from_rows(rows, block_tokens, str(path))


def from_rows(rows: Iterable[tuple[int, Any]], block_tokens: int, source: str) -> Trace:
    """A trace of Mooncake records (``(line, object)`` pairs: a file's, or the generator's)."""
    return trace_of(Path(source), block_tokens, [_mooncake_request(f"{source}:{n}", n, row, block_tokens)
                                                for n, row in rows])  # fmt: skip


def _mooncake_request(where: str, number: int, row: Any, block_tokens: int) -> TraceRequest:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if "text_input" in row:
        raise ConfigError(f"{where}: text_input is not replayed (servegrid builds token-exact prompts from "
                          "input_length and hash_ids)")  # fmt: skip
    for key in ("input_length", "hash_ids"):
        if key not in row:
            raise ConfigError(f"{where}: no {key}")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{where}: hash_ids must be a non-empty list of integers")
    input_tokens = positive_int(row["input_length"], "input_length", where)
    _check_blocks(where, input_tokens, ids, block_tokens)
    timestamp, delay = (
        milliseconds(row.get("timestamp"), "timestamp", where),
        milliseconds(row.get("delay"), "delay", where),
    )
    session = row.get("session_id")
    if timestamp is None and (session is None or delay is None):
        raise ConfigError(f"{where}: no timestamp (only a session's later turn may give a delay instead)")
    output_tokens = positive_int(row.get("output_length", 1), "output_length", where)
    return TraceRequest(number, timestamp, input_tokens, output_tokens, tuple(ids),
                        None if session is None else str(session), delay)  # fmt: skip


def trace_of(path: Path, block_tokens: int, requests: list[TraceRequest]) -> Trace:
    if not requests:
        raise ConfigError(f"{path}: no request in the trace")
    conversations = _group(str(path), requests)
    ordered = tuple(t for c in conversations for t in c.turns)
    return Trace(str(path), block_tokens, ordered, conversations)
