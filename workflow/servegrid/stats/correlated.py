"""Intervals for samples that are not independent: an open-loop cell's requests, in arrival order.

In an open loop a request that meets a queue is slow, and so is the one after it: neighbours are alike. The
order-statistic interval of the median (servegrid.stats.sampling) assumes independent samples and, on a
simulated queue at 50% utilisation, covered the true median 80-85% of the time instead of 95% (at 80%: 43%;
docs/sampling.md, "Open loop"). Batch medians do better: the samples in arrival order are cut into
:data:`BATCHES` consecutive batches, and the interval is the overall median ± t(k−1) × the spread of the batch
medians / √k. Batches long enough to be nearly independent of each other carry the correlation inside them.
Where the correlation runs longer than a batch the interval is still too narrow, and no interval computed from
the cell alone fixes that (selecting cells by an estimated correlation time made coverage worse); the summary
therefore also states the effective sample size (:func:`effective_samples`) and flags a cell whose samples are
strongly correlated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
BATCHES = 5  # the best of 5, 10 and 20 in the simulation: the longest batches, the least correlated with each other
MIN_PER_BATCH = 6  # as the order-statistic interval, which needs 6 samples: none from fewer than 30
# A cell is flagged when its samples are worth less than 1 / CORRELATED_TAU of their count (queues at ρ ≥ 0.5 had
# τ of 2 and more in the simulation; at ρ 0.3, about 1.5) and fewer than FEW_EFFECTIVE independent ones: there the
# batch-medians interval fell short (docs/sampling.md). Either alone flags well-covered cells: many requests at a
# moderate τ, or few requests that are not correlated at all.
CORRELATED_TAU = 2.0
FEW_EFFECTIVE = 40


def strongly_correlated(n: int, n_effective: float) -> bool:
    return n_effective * CORRELATED_TAU < n and n_effective < FEW_EFFECTIVE


def batch_median_interval(values: Sequence[float] | np.ndarray) -> tuple[float | None, float | None]:
    """The 95% batch-medians interval of the median of ``values`` (in the order they arrived); (None, None) below
    :data:`BATCHES` × :data:`MIN_PER_BATCH` values."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    per_batch = x.size // BATCHES
    if per_batch < MIN_PER_BATCH:
        return None, None
    medians = np.median(x[: per_batch * BATCHES].reshape(BATCHES, per_batch), axis=1)
    half = stats.t.ppf(0.5 + CONFIDENCE / 2, BATCHES - 1) * medians.std(ddof=1) / np.sqrt(BATCHES)
    centre = float(np.median(x))
    return centre - float(half), centre + float(half)


def effective_samples(values: Sequence[float] | np.ndarray) -> float | None:
    """How many independent samples ``values`` (in arrival order) are worth for their median: n / τ, τ the
    integrated autocorrelation time of the indicator "at or below the median" (Geyer's initial positive sequence);
    None below 10 values. It underestimates τ on short, strongly correlated series: a flag, never a correction."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    n = x.size
    if n < 10:
        return None
    y = (x <= np.median(x)).astype(float)
    y -= y.mean()
    variance = float((y * y).mean())
    if variance == 0:
        return float(n)
    spectrum = np.fft.rfft(y, 2 * n)
    autocorrelation = np.fft.irfft(spectrum * np.conj(spectrum))[:n] / n / variance
    tau, m = -1.0, 0
    while 2 * m + 1 < n:
        pair = autocorrelation[2 * m] + autocorrelation[2 * m + 1]
        if pair <= 0:
            break
        tau += 2 * pair
        m += 1
    effective: float = n / max(tau, 1.0)
    return effective
