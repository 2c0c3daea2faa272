"""Where a cell's measured streams go (:class:`Route`): straight to the server, or through the gateway."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Route", "route_order"]


@dataclass(frozen=True)
class Route:
    """Where a cell's measured streams go: straight to the server, or through the gateway (servegrid.serving.gateway).
    Control calls (tokenizer, metrics, cache resets) always go to the server itself."""

    name: str  # "direct" or "proxy"
    url: str
    model: str  # the name the requests carry there
    headers: Mapping[str, str] = field(default_factory=dict)
    health_path: str = "/health"  # a cheap GET that fills the keep-alive pool
    per_chunk_usage: bool = True  # False: the stream carries no running token count (client.decode_counted_by_chunk)
    # The name only the launched server (or gateway) answers to, checked on every connection the cell opens
    # (Streamer.open_connections): where it lists its names, and how to read them (its engine's, or the gateway's).
    # None: not checked (a gateway servegrid did not start).
    identity: str | None = None
    names_path: str = ""
    names: Callable[[bytes], list[str]] | None = None

    def connection_check(self) -> tuple[str, str | None, Callable[[bytes], list[str]] | None]:
        """What each new connection asks (Streamer.open_connections): the names, where there is an identity."""
        if self.identity and self.names is not None:
            return self.names_path, self.identity, self.names
        return self.health_path, None, None


def route_order(routes: Sequence[Route], repeat: int) -> list[Route]:
    """Both routes in every repeat, their order alternating (direct first in even repeats): a drift in the
    server's speed over the cell then weighs on both alike, not on whichever always ran second."""
    return list(routes) if repeat % 2 == 0 else list(reversed(routes))
