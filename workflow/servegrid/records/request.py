"""One request as the client saw it: what the client fills in and the cell file stores.

A module of its own so that reading and aggregating cell files never imports the
streaming client (aiohttp).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are monotonic nanoseconds."""

    request_id: str
    session: int
    seq: int
    phase: str  # "warmup", "probe" or "measured"
    turn: int
    prompt_tokens_requested: int
    output_tokens_requested: int
    intended_send_ns: int = 0
    sent_ns: int = 0
    end_ns: int | None = None
    chunk_ns: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    # Calibration server only: when each chunk was written, on the same clock.
    chunk_server_ns: list[int] = field(default_factory=list)
    prompt_tokens_reported: int | None = None
    output_tokens_reported: int | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    messages: list[dict[str, str]] | None = None  # chat requests: what was sent
    repeat: int = 0  # which repeat of the cell's workload
    route: str = "direct"  # "direct" or "proxy" (through the gateway)
    # False where the stream gave no per-chunk token count and the chunks were fewer than the tokens
    # (client.decode_counted_by_chunk): the per-chunk counts are spread evenly, not measured.
    chunk_tokens_exact: bool = True
    t0_ns: int = 0  # start of that repeat's measured phase

    @property
    def first_token_ns(self) -> int | None:
        return self.chunk_ns[0] if self.chunk_ns else None
