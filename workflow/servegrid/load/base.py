"""What a mode hands the load and what the load drives: a :class:`Work` of units, each sent as a :class:`Unit`.

A mode says what one unit of work is (a request, a conversation, a trace arrival), how its content is built
(``prepare``, before anything is in flight) and how one is sent (``send``); the load strategy
(:mod:`servegrid.load.strategies`) says when. The load sends through the cell's context, of which it uses what
:class:`Driver` declares (servegrid.modes.runner.WorkloadContext implements it), so this layer never imports a mode.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar

from servegrid.records.request import RequestRecord

if TYPE_CHECKING:
    from servegrid.load.stages import StagePlan

MeasureHook = Callable[[], Awaitable[None]]
Content = TypeVar("Content")

RAMP, MEASURED, DRAIN = "ramp", "measured", "drain"


class Unit(NamedTuple):
    """One unit of work as the load sends it: its session (0 in open loop: every arrival is its own), its index
    (the session's round; the arrival's place in the schedule) and its phase (ramp, measured, drain)."""

    session: int
    seq: int
    phase: str


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Work(Generic[Content]):
    """A mode's units of work.

    ``prepare(units)`` builds the content of each ``(session, index)`` unit before any of them is sent
    (synchronously: it may ask the server's tokenizer, so nothing may be in flight); ``send(unit, content,
    intended_ns)`` runs one unit due at ``intended_ns`` and returns when its session wanted to send its next one
    (the reply's end; what an open loop ignores); ``settle()`` completes the records once no stream is in flight
    (what is not measured while streams are, after each closed-loop stage and after an open-loop run);
    ``requests_per_unit``: a unit's requests (a conversation's turns), for the progress lines.
    """

    prepare: Callable[[list[tuple[int, int]]], Sequence[Content]]
    send: Callable[[Unit, Content, int], Awaitable[int]]
    settle: Callable[[], None] = _nothing
    requests_per_unit: int = 1


class Decoder(Protocol):
    """The streaming client's one call a closed loop makes between its stages."""

    def decode_pending(self) -> None:
        """Decode the streams kept raw while they arrived (nothing may be in flight)."""


class Driver(Protocol):
    """What the load uses of the cell's context (servegrid.modes.runner.WorkloadContext)."""

    records: list[RequestRecord]
    measuring_since_ns: int | None  # the load sets it when the measured phase begins

    @property
    def label(self) -> str:
        """The cell's name, for its progress lines."""
        ...

    @property
    def plan(self) -> StagePlan:
        """The closed-loop stages of the cell (its sampling rule)."""
        ...

    @property
    def streamer(self) -> Decoder: ...

    @property
    def pause_timing(self) -> MeasureHook:
        """Called before the pause between two stages (nothing in flight): what watches the timing stops."""
        ...

    @property
    def resume_timing(self) -> MeasureHook:
        """Called after that pause, before the next stage starts."""
        ...

    def elapsed_s(self) -> float:
        """Seconds since the measured phase began (0 before)."""
        ...

    def may_start(self) -> bool:
        """False once the measured phase has run for the plan's time limit (where it has one)."""
        ...
