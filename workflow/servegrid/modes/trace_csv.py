"""The plain CSV trace format (servegrid.modes.trace_file's docstring): rows as requests whose block ids carry
the rows' prefix sharing."""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path

from servegrid.errors import ConfigError
from servegrid.modes.trace_file import Trace, TraceRequest, milliseconds, positive_int, trace_of

CSV_REQUIRED = ("timestamp", "input_tokens", "output_tokens")
CSV_OPTIONAL = ("session", "prefix_group", "prefix_tokens")


def parse_csv(path: Path, block_tokens: int) -> Trace:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        header = [h.strip() for h in reader.fieldnames or []]
        missing = [c for c in CSV_REQUIRED if c not in header]
        unknown = [c for c in header if c not in (*CSV_REQUIRED, *CSV_OPTIONAL)]
        if missing or unknown:
            raise ConfigError(
                f"{path}:1: header {','.join(header)!r}: "
                + (f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(unknown)}")
                + f" (columns: {', '.join(CSV_REQUIRED)}[, {', '.join(CSV_OPTIONAL)}])"
            )
        rows: list[tuple[int, dict[str, str]]] = []
        for row in reader:
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k is not None}
            if any(row.values()):
                rows.append((reader.line_num, row))
    return trace_of(path, block_tokens, list(_csv_requests(path, rows, block_tokens)))


def _number(text: str, name: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{where}: {name} {text!r} is not a number") from None


def _csv_requests(path: Path, rows: list[tuple[int, dict[str, str]]], block: int) -> Iterable[TraceRequest]:
    """Rows as requests whose block ids carry the rows' sharing (see the module docstring)."""
    parsed: list[tuple[int, float, int, int, str | None, str | None, int | None]] = []
    for line, row in rows:
        where = f"{path}:{line}"
        stated = row.get("prefix_tokens") or None
        parsed.append(
            (
                line,
                milliseconds(_number(row["timestamp"], "timestamp", where), "timestamp", where) or 0.0,
                positive_int(_number(row["input_tokens"], "input_tokens", where), "input_tokens", where),
                positive_int(_number(row["output_tokens"], "output_tokens", where), "output_tokens", where),
                row.get("session") or None,
                row.get("prefix_group") or None,
                None
                if stated is None
                else positive_int(_number(stated, "prefix_tokens", where), "prefix_tokens", where),
            )
        )
    shared_of: dict[str, int] = {}
    for _, _, _, _, _, group, prefix in parsed:
        if group is not None:
            if prefix is not None:
                shared_of[group] = prefix
            elif group not in shared_of:
                shortest = min(p[2] for p in parsed if p[5] == group)
                shared_of[group] = shortest // block * block
    next_id = 0
    group_ids: dict[str, list[int]] = {}
    previous_turn: dict[str, tuple[int, ...]] = {}
    for line, timestamp, tokens, output, session, group, _ in sorted(parsed, key=lambda p: (p[1], p[0])):
        ids: list[int] = []
        if session is not None and session in previous_turn:
            ids = list(previous_turn[session])  # the conversation so far: the previous prompt's whole blocks
        elif group is not None:
            shared = min(shared_of[group], tokens)
            known = group_ids.setdefault(group, [])
            while len(known) < shared // block:
                known.append(next_id)
                next_id += 1
            ids = known[: shared // block]
        needed = -(-tokens // block)
        ids = ids[:needed]
        while len(ids) < needed:
            ids.append(next_id)
            next_id += 1
        if session is not None:
            previous_turn[session] = tuple(ids[: tokens // block])
        yield TraceRequest(line, timestamp, tokens, output, tuple(ids), session)
