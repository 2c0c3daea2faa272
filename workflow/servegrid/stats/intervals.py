"""Percentiles (those a cell has enough samples for), intervals of the median, bootstrap intervals (numpy/scipy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from servegrid.stats import sampling

QUANTILES = (50, 90, 99)
CONFIDENCE = 0.95
RESAMPLES = 2000


def missing(value: Any) -> bool:
    """None or a NaN scalar, as a Parquet cell with no value arrives; lists and arrays never are."""
    return value is None or (isinstance(value, float | np.floating) and bool(np.isnan(value)))


def percentiles(
    values: Sequence[float] | np.ndarray, qs: Sequence[int] = QUANTILES, enough_only: bool = True
) -> dict[str, float | None]:
    """Percentiles ``qs`` (in %) of ``values`` (NaN ignored), each None unless there are enough values for it
    (servegrid.stats.sampling.tail_allowed: p50 from 6, p90 from 30, p99 from 300). ``enough_only=False``: any
    percentile from one value on, for a diagnostic that must flag on few values (the client's loop lag)."""
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    shown = [q for q in qs if arr.size and (not enough_only or sampling.tail_allowed(arr.size, q / 100))]
    # One call for all of them: the summary asks for thousands of cells' percentiles (docs/scale.md).
    found = dict(zip(shown, np.percentile(arr, shown).tolist(), strict=True)) if shown else {}
    return {f"p{q}": found.get(q) for q in qs}


def median_ci(values: Sequence[float] | np.ndarray, seed: int = 0) -> tuple[float | None, float | None]:
    """95% percentile-bootstrap interval of the median; (None, None) below 3 values. The benchmarks' (and the
    sampling simulation's comparison); the summary reports :func:`median_interval`."""
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size < 3:
        return None, None
    if np.all(arr == arr[0]):
        return float(arr[0]), float(arr[0])
    from scipy import stats  # here, not at the top: every job imports this module, few bootstrap (0.7 s a start)

    result = stats.bootstrap(
        (arr,),
        np.median,
        confidence_level=CONFIDENCE,
        n_resamples=RESAMPLES,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def median_interval(values: Sequence[float] | np.ndarray) -> tuple[float | None, float | None]:
    """The 95% order-statistic interval of the median the summary reports (servegrid.stats.sampling, the interval
    sequential sampling judges); (None, None) below 6 values."""
    bounds = sampling.median_interval(values)
    return (None, None) if bounds is None else bounds


def bootstrap_medians(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The medians of :data:`RESAMPLES` resamples (with replacement) of ``values`` (no NaN, at least one)."""
    medians: np.ndarray = np.median(rng.choice(values, (RESAMPLES, values.size)), axis=1)
    return medians


def ratio_interval(
    numerator_medians: np.ndarray, denominator_medians: np.ndarray, confidence: float = CONFIDENCE
) -> tuple[float | None, float | None]:
    """Percentile interval (95% unless told) of the ratio of two independent sets of bootstrap medians."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = numerator_medians / denominator_medians
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return None, None
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, (tail, 100 - tail))
    return float(low), float(high)


def ratio_of_medians_ci(
    numerator: Sequence[float] | np.ndarray, denominator: Sequence[float] | np.ndarray, seed: int = 0
) -> tuple[float | None, float | None]:
    """95% bootstrap interval of median(numerator) / median(denominator), resampling both independently."""
    a = np.asarray(numerator, dtype=float)
    b = np.asarray(denominator, dtype=float)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if a.size < 3 or b.size < 3:
        return None, None
    rng = np.random.default_rng(seed)
    return ratio_interval(bootstrap_medians(a, rng), bootstrap_medians(b, rng))
