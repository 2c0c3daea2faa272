"""Percentiles and bootstrap confidence intervals (numpy/scipy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats as sps

QUANTILES = (50, 90, 99)
CONFIDENCE = 0.95
RESAMPLES = 2000


def missing(value: Any) -> bool:
    """None or a NaN scalar, as a Parquet cell with no value arrives; lists and arrays never are."""
    return value is None or (isinstance(value, float | np.floating) and bool(np.isnan(value)))


def percentiles(values: Sequence[float] | np.ndarray, qs: Sequence[int] = QUANTILES) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def median_ci(values: Sequence[float] | np.ndarray, seed: int = 0) -> tuple[float | None, float | None]:
    """95% percentile-bootstrap interval of the median; (None, None) below 3 values."""
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size < 3:
        return None, None
    if np.all(arr == arr[0]):
        return float(arr[0]), float(arr[0])
    result = sps.bootstrap(
        (arr,),
        np.median,
        confidence_level=CONFIDENCE,
        n_resamples=RESAMPLES,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


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
    ratios = np.median(rng.choice(a, (RESAMPLES, a.size)), axis=1) / np.median(
        rng.choice(b, (RESAMPLES, b.size)), axis=1
    )
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return None, None
    tail = (1 - CONFIDENCE) / 2 * 100
    return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))
