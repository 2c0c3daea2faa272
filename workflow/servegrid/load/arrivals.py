"""When an open-loop cell's requests are due: a seeded arrival schedule at an offered rate.

Open loop means the schedule alone decides when a request goes out, never the server: a server that slows
down meets more requests in flight, as it would in production, instead of a client that slows its sending
with it (coordinated omission). The patterns are those of ``vllm bench serve`` (``--request-rate``,
``--burstiness``): gaps drawn from a gamma distribution of shape ``burstiness`` and mean ``1 / rate``, so
``burstiness`` 1 is a Poisson process, below 1 burstier, above 1 steadier; ``constant`` sends at exact
intervals. The first request is due at 0. The schedule depends only on the rate, the pattern and the seed:
every configuration meets the same arrival times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PATTERNS = ("poisson", "constant", "gamma")


@dataclass(frozen=True)
class Arrival:
    """An arrival process: ``pattern`` (poisson, constant, gamma) and, for gamma, its ``burstiness`` (shape)."""

    pattern: str = "poisson"
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"arrival pattern {self.pattern!r} (known: {', '.join(PATTERNS)})")
        if not self.burstiness > 0:
            raise ValueError(f"arrival burstiness {self.burstiness} (must be > 0)")

    @property
    def shape(self) -> float | None:
        """The gamma shape of the gaps; None for constant gaps."""
        return {"poisson": 1.0, "gamma": self.burstiness, "constant": None}[self.pattern]


def due_offsets_s(rate: float, count: int, arrival: Arrival, seed: int) -> np.ndarray:
    """Seconds after the schedule's start at which each of ``count`` requests is due (first at 0)."""
    if not rate > 0:
        raise ValueError(f"rate {rate} (requests/s must be > 0)")
    if count <= 0:
        return np.zeros(0)
    mean_gap = 1.0 / rate
    if arrival.shape is None:  # by multiplication, not a running sum: the 10th arrival at 10 gaps, exactly
        return np.arange(count) * mean_gap
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(arrival.shape, mean_gap / arrival.shape, size=count - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
