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

import bisect
import functools
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servegrid.errors import ConfigError
from servegrid.records.cell_spec import rate_label

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
class Window:
    """A part of a trace: the arrivals from ``start_s`` after its first one, for ``duration_s`` seconds (None: to
    the end). A trace mode's grid axis (``windows:``): its label is the last part of a trace cell's name."""

    start_s: float = 0.0
    duration_s: float | None = None

    @classmethod
    def from_settings(cls, window: Mapping[str, Any]) -> Window:
        duration = window.get("duration_s")
        return cls(float(window.get("start_s", 0.0)), None if duration is None else float(duration))

    def settings(self) -> dict[str, Any]:
        return {"start_s": self.start_s, "duration_s": self.duration_s}

    @property
    def whole(self) -> bool:
        return self.start_s == 0 and self.duration_s is None

    @property
    def label(self) -> str:
        """``""`` for the whole trace (a cell name without a window part: ``ctx0_x1``), ``w600`` from 600 s to the
        end, ``w600+300`` from 600 s for 300 s."""
        if self.whole:
            return ""
        length = "" if self.duration_s is None else f"+{rate_label(self.duration_s)}"
        return f"w{rate_label(self.start_s)}{length}"

    @classmethod
    def from_label(cls, label: str) -> Window:
        if not label:
            return cls()
        start, _, length = label.removeprefix("w").partition("+")
        return cls(float(start), float(length) if length else None)

    def describe(self) -> str:
        length = "the rest" if self.duration_s is None else f"{self.duration_s:g}"
        return f"from {self.start_s:g} s for {length} s"


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
            digest.update(
                json.dumps(
                    [r.timestamp_ms, r.input_tokens, r.output_tokens, r.hash_ids, r.session, r.delay_ms]
                ).encode()
            )
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

    def replay(self, window: Window, drain_arrivals: int) -> Replay:
        """What a cell replays of this trace: ``window``'s arrivals, then up to ``drain_arrivals`` of the
        arrivals after it (none where the window runs to the trace's end)."""
        if not self.conversations:
            return Replay(self, ())
        origin = self.conversations[0].arrival_ms + window.start_s * 1000
        end = math.inf if window.duration_s is None else origin + window.duration_s * 1000
        first = bisect.bisect_left(self.conversations, origin, key=lambda c: c.arrival_ms)
        after = bisect.bisect_left(self.conversations, end, key=lambda c: c.arrival_ms)
        kept = self.conversations[first:after]
        if not kept:
            raise ConfigError(f"{self.source}: no request arrives in the window {window.describe()}")
        requests = tuple(t for c in kept for t in c.turns)
        cut = Trace(self.source, self.block_tokens, requests, kept, window.duration_s)
        return Replay(cut, self.conversations[after : after + drain_arrivals])

    def longest(self) -> TraceRequest:
        """The request holding the most tokens at its end (prompt + output)."""
        return max(self.requests, key=lambda r: (r.total_tokens, -r.line))

    def due_offsets_s(self, speedup: float) -> list[float]:
        """Each conversation's arrival, seconds after the first, at ``speedup`` × the trace's pace."""
        if not self.conversations:
            return []
        first = self.conversations[0].arrival_ms
        return [(c.arrival_ms - first) / 1000 / speedup for c in self.conversations]


@dataclass(frozen=True)
class Replay:
    """A trace cell's arrivals: its window's (its first ``ramp_s`` seconds the ramp, the rest measured), then the
    trace's next ones, the **drain**: sent while the window's last requests finish, so that they meet the load the
    trace had there, and never measured."""

    window: Trace
    drain: tuple[Conversation, ...]

    @functools.cached_property
    def sent(self) -> Trace:
        """Every arrival the cell sends, in order: the window's, then the drain's."""
        if not self.drain:
            return self.window
        conversations = self.window.conversations + self.drain
        w = self.window
        return Trace(w.source, w.block_tokens, tuple(t for c in conversations for t in c.turns), conversations)

    @functools.cached_property
    def sha256(self) -> str:
        """The window's requests and the drain's: both shape what the cell measures."""
        return (
            self.window.sha256
            if not self.drain
            else hashlib.sha256(f"{self.window.sha256}/{self.sent.sha256}".encode()).hexdigest()[:16]
        )


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
    return trace_of(
        Path(source), block_tokens, [_mooncake_request(f"{source}:{n}", n, row, block_tokens) for n, row in rows]
    )


def _mooncake_request(where: str, number: int, row: Any, block_tokens: int) -> TraceRequest:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if "text_input" in row:
        raise ConfigError(
            f"{where}: text_input is not replayed (servegrid builds token-exact prompts from input_length and hash_ids)"
        )
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
    return TraceRequest(
        number, timestamp, input_tokens, output_tokens, tuple(ids), None if session is None else str(session), delay
    )


def trace_of(path: Path, block_tokens: int, requests: list[TraceRequest]) -> Trace:
    if not requests:
        raise ConfigError(f"{path}: no request in the trace")
    conversations = _group(str(path), requests)
    ordered = tuple(t for c in conversations for t in c.turns)
    return Trace(str(path), block_tokens, ordered, conversations)
