"""Statistics and record helpers that only the benchmarks need (benchmarks/upstream_compare.py).

Kept out of the pipeline's package modules: the pipeline never imports servegrid.testing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from servegrid.records.cell_file import CELL_SCHEMA, rows
from servegrid.records.request import RequestRecord
from servegrid.stats.intervals import CONFIDENCE, RESAMPLES


def records_frame(records: list[RequestRecord]) -> pd.DataFrame:
    """Records as a cell file would hold them, as a pandas DataFrame."""
    return pa.table(rows(records), schema=CELL_SCHEMA).to_pandas()


def rank_matched_ratios(
    numerator: Sequence[float] | np.ndarray, denominator: Sequence[float] | np.ndarray
) -> np.ndarray:
    """The k-th smallest of ``numerator`` over the k-th smallest of ``denominator``, for every k.

    Two samples of the same requests compared rank by rank: where a latency is
    multimodal (a request's place in a prefill queue), a median that falls
    between two modes jumps when one request changes place, while the values at
    each rank still compare like with like. Counts that differ are matched at
    the same quantiles (the smaller count's).
    """
    a = np.asarray(numerator, dtype=float)
    b = np.asarray(denominator, dtype=float)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    count = min(a.size, b.size)
    if count == 0:
        return np.empty(0)
    quantiles = (np.arange(count) + 0.5) / count
    top, bottom = np.quantile(a, quantiles, method="inverted_cdf"), np.quantile(b, quantiles, method="inverted_cdf")
    ratios: np.ndarray = top / bottom
    return ratios


def grouped_median_ci(
    groups: Sequence[Sequence[float] | np.ndarray], seed: int = 0
) -> tuple[float | None, float | None]:
    """95% percentile-bootstrap interval of the median of all values, resampling whole groups.

    For values that share conditions within a group (a benchmark round on a
    server whose speed drifts between rounds), so that the interval reflects
    the variation between rounds, not only within them. (None, None) below 3 groups.
    """
    arrays = [np.asarray(g, dtype=float) for g in groups]
    arrays = [g[~np.isnan(g)] for g in arrays if g.size]
    if len(arrays) < 3:
        return None, None
    rng = np.random.default_rng(seed)
    medians = [
        float(np.median(np.concatenate([arrays[i] for i in rng.integers(0, len(arrays), len(arrays))])))
        for _ in range(RESAMPLES)
    ]
    tail = (1 - CONFIDENCE) / 2 * 100
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))
