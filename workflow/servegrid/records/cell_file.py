"""The per-cell Parquet file: one row per request, cell facts in the file metadata.

Times in a cell file are seconds relative to the start of the cell's measured
phase (``t0``), from the client's monotonic clock; chunk arrival times are
relative to the request's own send time. Column meanings are documented in
``docs/parquet-schema.md`` and in each field's Parquet metadata.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from servegrid import atomic
from servegrid.errors import CellFileError
from servegrid.records import cell_format
from servegrid.records.cell_record import CellRecord
from servegrid.records.request import RequestRecord


def _field(name: str, kind: pa.DataType, doc: str, nullable: bool = True) -> pa.Field:
    return pa.field(name, kind, nullable=nullable, metadata={"doc": doc})


CELL_SCHEMA = pa.schema(
    [
        _field("request_id", pa.string(), "unique within the cell", nullable=False),
        _field("repeat", pa.int32(), "which repeat of the cell's workload (0-based)", nullable=False),
        _field("session", pa.int32(), "closed-loop session index, 0..concurrency-1", nullable=False),
        _field("seq", pa.int32(), "request (or conversation) index within the session", nullable=False),
        _field("turn", pa.int32(), "conversation turn, 1-based (1 outside multi_turn)", nullable=False),
        _field("phase", pa.string(), "measured | warmup | probe; only 'measured' enters figures", nullable=False),
        _field("intended_send_s", pa.float64(), "when the session wanted to send (previous reply's end), s since t0"),
        _field("sent_s", pa.float64(), "when the request was handed to httpx, s since t0 (its repeat's)"),
        _field("end_s", pa.float64(), "when the stream closed, s since t0"),
        _field("chunk_times_s", pa.list_(pa.float64()), "arrival of each token-carrying SSE chunk, s after sent_s"),
        _field("chunk_tokens", pa.list_(pa.int32()), "tokens in each chunk (increase of usage.completion_tokens)"),
        _field("prompt_tokens_requested", pa.int32(), "prompt length servegrid built (server tokenizer)"),
        _field("prompt_tokens_reported", pa.int32(), "usage.prompt_tokens from the server"),
        _field("output_tokens_requested", pa.int32(), "exact output tokens asked for (end of sequence ignored)"),
        _field("output_tokens_reported", pa.int32(), "usage.completion_tokens from the server"),
        _field("http_status", pa.int32(), "HTTP status of the response"),
        _field("finish_reason", pa.string(), "the server's finish_reason"),
        _field("error", pa.string(), "null when the request succeeded"),
        _field("route", pa.string(), "direct, or proxy: through the gateway (null in older files: direct)"),
        _field(
            "chunk_tokens_exact",
            pa.bool_(),
            "false: chunk_tokens spread evenly, the stream gave no per-chunk count (a gateway; null in older files)",
        ),
    ]
)


def rows(records: list[RequestRecord]) -> dict[str, list[Any]]:
    def rel(ns: int | None, base: int) -> float | None:
        return None if ns is None or ns == 0 else (ns - base) / 1e9

    columns: dict[str, list[Any]] = {name: [] for name in CELL_SCHEMA.names}
    for r in records:
        route = "" if r.route == "direct" else f"{r.route}-"  # direct ids as before routes existed
        columns["request_id"].append(f"r{r.repeat}-{route}{r.request_id}")
        columns["repeat"].append(r.repeat)
        columns["session"].append(r.session)
        columns["seq"].append(r.seq)
        columns["turn"].append(r.turn)
        columns["phase"].append(r.phase)
        columns["intended_send_s"].append(rel(r.intended_send_ns, r.t0_ns))
        columns["sent_s"].append(rel(r.sent_ns, r.t0_ns))
        columns["end_s"].append(rel(r.end_ns, r.t0_ns))
        columns["chunk_times_s"].append([(t - r.sent_ns) / 1e9 for t in r.chunk_ns])
        columns["chunk_tokens"].append(list(r.chunk_tokens))
        columns["prompt_tokens_requested"].append(r.prompt_tokens_requested)
        columns["prompt_tokens_reported"].append(r.prompt_tokens_reported)
        columns["output_tokens_requested"].append(r.output_tokens_requested)
        columns["output_tokens_reported"].append(r.output_tokens_reported)
        columns["http_status"].append(r.http_status)
        columns["finish_reason"].append(r.finish_reason)
        columns["error"].append(r.error)
        columns["route"].append(r.route)
        columns["chunk_tokens_exact"].append(r.chunk_tokens_exact)
    return columns


def write_cell(path: Path | str, records: list[RequestRecord], cell: CellRecord) -> None:
    """Write the cell atomically, in today's format (:mod:`servegrid.records.cell_format`): the file appears
    complete or not at all."""
    schema = CELL_SCHEMA.with_metadata(cell_format.encode(cell.facts()))
    table = pa.table(rows(records), schema=schema)
    with atomic.atomic_path(path) as tmp:  # a write that fails (disk full) is an OutputError naming the path
        # Page checksums: a bit flipped on disk is an error on read, never a silently wrong latency.
        pq.write_table(table, tmp, write_page_checksum=True)


def read_cell(path: Path | str) -> tuple[pa.Table, CellRecord]:
    """A cell file of any format servegrid wrote, as today's: its request table (today's columns) and its record
    (``format_version`` says which format the file is). :class:`CellFileError` naming the file if it cannot be
    read, :class:`~servegrid.errors.NewerFormatError` if a newer servegrid wrote it."""
    try:
        table = pq.read_table(path, page_checksum_verification=True)
    except (OSError, pa.ArrowException) as exc:
        raise CellFileError(f"{path}: cannot read the cell file ({exc})") from exc
    record = _record(path, table.schema.metadata)
    return cell_format.upgrade_table(table, CELL_SCHEMA), record


def read_record(path: Path | str) -> CellRecord:
    """The cell's record alone (the footer only is read, not the requests)."""
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise CellFileError(f"{path}: cannot read the cell file ({exc})") from exc
    return _record(path, schema.metadata)


def _record(path: Path | str, file_metadata: dict[bytes, bytes] | None) -> CellRecord:
    """The record from a cell file's Parquet metadata (any format), checked against its checksum."""
    facts = cell_format.upgrade(cell_format.decode(path, file_metadata))
    try:
        return CellRecord.from_facts(facts)
    except (KeyError, TypeError, ValueError) as exc:
        raise CellFileError(f"{path}: its footer does not describe a cell ({exc!r})") from exc


def set_aside(path: Path | str) -> Path:
    """Move a damaged cell file out of the grid, kept for inspection: the next run measures its cell again."""
    kept = Path(f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, kept)
    return kept
