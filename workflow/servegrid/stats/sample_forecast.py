"""How long a cell of the sequential rule will measure, forecast from a calibration probe's values.

The rule (servegrid.stats.sampling) judges a cell at its stage targets and stops when the 99% interval of the median
is within ``target_rel_ci``, at ``max_samples``, or at ``max_duration_s``. How many samples that takes depends on
the spread of the cell's primary figure, which a calibration probe measured. The forecast replays the rule on draws
from the probe's values (resampled with replacement, as the bootstrap does: the spread is taken to be the probe's),
round by round at the probe's seconds per round, and returns the spread of the measuring seconds over the replays.
The relative spread is what matters, so a probe's values stand for any cell its round time is scaled to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from servegrid.stats.sampling import SamplingRule, decide, next_stage_rounds

REPLAYS = 200
LOW_QUANTILE, HIGH_QUANTILE = 0.1, 0.9


@dataclass(frozen=True)
class Forecast:
    low_s: float  # measuring seconds: 10% of the replays measure less
    median_s: float
    high_s: float  # 90% of the replays measure less
    samples_median: int


def measuring_time(
    values: Sequence[float] | np.ndarray,
    rule: SamplingRule,
    sessions: int,
    round_s: float,
    seed: int = 0,
    replays: int = REPLAYS,
) -> Forecast:
    """The measuring seconds of a cell of ``sessions`` sessions whose rounds take ``round_s``, sampled under ``rule``
    from the spread of ``values`` (at least one value; NaN ignored)."""
    pool = np.asarray(values, dtype=float)
    pool = pool[~np.isnan(pool)]
    if pool.size == 0:
        raise ValueError("a forecast needs at least one value")
    rng = np.random.default_rng(seed)
    seconds, samples = np.empty(replays), np.empty(replays)
    for i in range(replays):
        drawn: list[float] = []
        rounds = 0
        while True:
            stage = next_stage_rounds(rule, len(drawn), sessions)
            if stage == 0:
                break
            if np.isfinite(rule.max_duration_s):  # sessions start nothing after the limit: the rounds begun before it
                stage = min(stage, max(1, int(np.ceil(rule.max_duration_s / round_s)) - rounds))
            drawn.extend(rng.choice(pool, size=stage * sessions))
            rounds += stage
            if decide(drawn, rounds * round_s, rule).stop:
                break
        seconds[i], samples[i] = rounds * round_s, len(drawn)
    low, median, high = np.quantile(seconds, [LOW_QUANTILE, 0.5, HIGH_QUANTILE])
    return Forecast(float(low), float(median), float(high), int(np.median(samples)))
