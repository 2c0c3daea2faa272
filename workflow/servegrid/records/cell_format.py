"""Every format of cell file servegrid ever wrote, and how each is read as today's.

A measured cell is GPU hours: no change of servegrid may make one unreadable. The footer (the cell's facts, JSON in
the Parquet file's metadata) is found under the key its format used, checked against its checksum where it has one,
and upgraded in memory, step by step, to today's shape; the file on disk is never rewritten. A file of a format newer
than this servegrid's is refused (kept as it is, never set aside). One fixture of each format, written by the commit
named beside it, is in ``tests/data/cells/`` (its README says how each was made).

    format  written                   footer under                           what changed
    1       2026-11-29 .. 2026-12-03  servegrid.cell                         (the first); repeats, cache state, client
                                                                             monitor and gauges came within it
    2       2026-12-03 .. 2026-12-05  servegrid.pipeline.cell_job            key renamed by the package move (routes,
                                                                             the gateway, Slurm job came within it)
    3       2026-12-05 .. 2026-12-06  servegrid.pipeline.cell_job            + SHA-256 of the footer; open loop, refused
                                      (+ .sha256)                            cells and trace windows came within it
    4       2026-12-06 ..             servegrid.cell_file (+ .format,        a key named for the format, its number in
                                      .sha256)                               the file and in the footer

Within formats 1-3 keys were added without a number: a key's absence has one meaning, applied in
:func:`upgrade` (no ``repeat`` column: one repeat; no ``route``: direct; no ``rate``: closed loop; ...).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from servegrid.errors import CellFileError, NewerFormatError

FORMAT_VERSION = 4
FOOTER_KEY = b"servegrid.cell_file"
FORMAT_KEY = b"servegrid.cell_file.format"
SHA256_KEY = b"servegrid.cell_file.sha256"

# Older formats' keys, newest first: (format, footer key, checksum key or None). A file carries exactly one.
_OLDER_KEYS = (
    (3, b"servegrid.pipeline.cell_job", b"servegrid.pipeline.cell_job.sha256"),
    (1, b"servegrid.cell", None),
)
# Format 3 is format 2 with the checksum: the same key, told apart by the checksum's presence.
_UNCHECKED_PIPELINE_FORMAT = 2


@dataclass(frozen=True)
class Footer:
    """A cell file's footer as found on disk: which format it is, and its facts (as written, not yet upgraded)."""

    format_version: int
    facts: dict[str, Any]


def encode(facts: Mapping[str, Any]) -> dict[bytes, bytes]:
    """The Parquet metadata of a cell file written today: the footer, its format and its checksum."""
    encoded = json.dumps({**facts, "format_version": FORMAT_VERSION}, sort_keys=True, default=str).encode()
    return {
        FOOTER_KEY: encoded,
        FORMAT_KEY: str(FORMAT_VERSION).encode(),
        SHA256_KEY: hashlib.sha256(encoded).hexdigest().encode(),
    }


def decode(path: object, file_metadata: Mapping[bytes, bytes] | None) -> Footer:
    """The footer of a cell file of any format; :class:`CellFileError` if it has none or it is damaged,
    :class:`NewerFormatError` if a newer servegrid wrote it."""
    found = dict(file_metadata or {})
    if FOOTER_KEY in found or FORMAT_KEY in found:
        version = _format_number(path, found.get(FORMAT_KEY))
        if version > FORMAT_VERSION:
            raise NewerFormatError(
                f"{path}: a cell file of format {version}, written by a newer servegrid (this one reads formats 1 to "
                f"{FORMAT_VERSION}); it is kept as it is: upgrade servegrid to read it"
            )
        raw, digest = found.get(FOOTER_KEY), found.get(SHA256_KEY)
        if raw is None or digest is None:
            raise CellFileError(f"{path}: a format-{version} cell file without its footer or its checksum")
    else:
        for version, key, sha_key in _OLDER_KEYS:
            if key in found:
                raw, digest = found[key], found.get(sha_key) if sha_key else None
                if version == 3 and digest is None:
                    version = _UNCHECKED_PIPELINE_FORMAT
                break
        else:
            raise CellFileError(
                f"{path}: not a servegrid cell file (no {FOOTER_KEY.decode()} metadata, nor that of an older format)"
            )
    if digest is not None and hashlib.sha256(raw).hexdigest().encode() != digest:
        raise CellFileError(
            f"{path}: its footer (the cell's facts: duration, server metrics, settings) does not match its checksum"
        )
    try:
        facts = json.loads(raw)
    except ValueError as exc:
        raise CellFileError(f"{path}: its footer is not readable JSON ({exc})") from exc
    if not isinstance(facts, dict):
        raise CellFileError(f"{path}: its footer is not a JSON object")
    if version == FORMAT_VERSION and facts.get("format_version") != FORMAT_VERSION:
        raise CellFileError(f"{path}: its footer says format {facts.get('format_version')}, its metadata {version}")
    return Footer(version, facts)


def _format_number(path: object, raw: bytes | None) -> int:
    try:
        return int((raw or b"").decode())
    except ValueError:
        raise CellFileError(f"{path}: its format number {raw!r} is not a number") from None


# ---- upgrading: what each key's absence meant when it was absent ----

# The cell entry's load keys, added with open loop (rate, 2026-12-05) and trace replay (speedup, window).
_CELL_DEFAULTS: dict[str, Any] = {"rate": 0.0, "speedup": 0.0, "window": ""}
# The footer's keys added after format 1 began, with what a file without them measured.
_FOOTER_DEFAULTS: dict[str, Any] = {
    "other_routes": {},  # one route only (2026-12-03)
    "gateway": None,  # measured directly (2026-12-03)
    "slurm_job": None,  # not on a cluster (2026-12-02)
    "open_loop": None,  # closed loop (2026-12-05)
    "client": None,  # no client monitor (2026-11-29)
    "cache_state": None,  # not recorded
    "sampling": None,  # a fixed number of requests
}


def upgrade(footer: Footer) -> dict[str, Any]:
    """The footer's facts in today's shape (a new dict; the file is not touched)."""
    facts = {**_FOOTER_DEFAULTS, **footer.facts, "format_version": footer.format_version}
    cell = dict(facts.get("cell") or {})
    for key, absent in _CELL_DEFAULTS.items():
        cell.setdefault(key, absent)
    facts["cell"] = cell
    facts["other_routes"] = facts["other_routes"] or {}
    return facts


# Facts today's tables report that a file of an older format may not hold: (where, what a re-measured cell gets).
_LATER_FACTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("cache_state",), "the prefix cache's state at the start (reset or fresh content)"),
    (("client",), "the client's own load (event-loop lag, CPU): whether the client was the bottleneck"),
    (("server_metrics", "derived", "ttft_mean_s"), "the server's own TTFT and TPOT beside the client's"),
)


def lacks(facts: Mapping[str, Any]) -> list[str]:
    """What today's tables report for a cell that this (upgraded) footer does not hold: its cell is read and
    compared all the same, with those columns empty; re-measuring the cell fills them. Empty for a refused cell
    (nothing was measured) and for every file of today's format."""
    if facts.get("refused") or facts.get("format_version") == FORMAT_VERSION:
        return []
    missing = []
    for where, what in _LATER_FACTS:
        value: Any = facts
        for key in where:
            value = value.get(key) if isinstance(value, Mapping) else None
        if value is None:
            missing.append(what)
    return missing


# The request table's columns added after format 1 began, with what a file without them measured.
_COLUMN_DEFAULTS: dict[str, tuple[Any, pa.DataType]] = {
    "repeat": (0, pa.int32()),  # one repeat (2026-11-29)
    "route": ("direct", pa.string()),  # direct (2026-12-03)
}


def upgrade_table(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """The request table with today's columns in today's order: a column an older format lacks is filled with what
    its absence meant (or nulls, where the schema documents that null means "older file")."""
    columns = []
    for field in schema:
        if field.name in table.column_names:
            columns.append(table.column(field.name).cast(field.type))
        elif field.name in _COLUMN_DEFAULTS:
            value, kind = _COLUMN_DEFAULTS[field.name]
            columns.append(pa.array([value] * table.num_rows, type=kind))
        else:
            columns.append(pa.nulls(table.num_rows, type=field.type))
    return pa.Table.from_arrays(columns, schema=schema.remove_metadata())
