"""How often an open-loop cell's interval of the median covers the true one, where requests queue (docs/sampling.md,
"Open loop: correlated samples"): a G/G/1 queue by Lindley's recursion, Poisson arrivals, lognormal service times
(mean 1, σ 0.5), utilisation ρ; each cell its own queue, started empty and run through a ramp of 200 arrivals, then
n measured response times in arrival order. The true median is that of one long run of the same queue.

`python tests/unit/test_open_loop_coverage.py` prints the table docs/sampling.md shows (1,000 cells a row, fixed
seeds); the test checks the rows the docs call covered, and that the independent-sample interval is not.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from servegrid.stats import correlated, sampling

SIGMA, RAMP = 0.5, 200


def response_times(rho: float, cells: int, n: int, rng: np.random.Generator, ramp: int = RAMP) -> np.ndarray:
    """(cells, n) response times (wait + service) of FIFO single-server queues, after ``ramp`` arrivals each."""
    total = ramp + n
    gaps = rng.exponential(1 / rho, (cells, total))
    service = rng.lognormal(-(SIGMA**2) / 2, SIGMA, (cells, total))
    wait, out = np.zeros(cells), np.empty((cells, total))
    for i in range(total):
        if i:
            wait = np.maximum(0.0, wait + service[:, i - 1] - gaps[:, i])
        out[:, i] = wait + service[:, i]
    return out[:, ramp:]


def true_median(rho: float, seed: int) -> float:
    return float(np.median(response_times(rho, 20, 200_000, np.random.default_rng(seed), ramp=5_000)))


def coverage(rho: float, n: int, cells: int = 1000, seed: int = 2026) -> dict[str, float]:
    truth = true_median(rho, seed + 1)
    samples = response_times(rho, cells, n, np.random.default_rng(seed))
    batch = np.array([correlated.batch_median_interval(row) for row in samples], dtype=float)
    independent = np.array([sampling.median_interval(row) for row in samples], dtype=float)
    n_effective = np.array([correlated.effective_samples(row) for row in samples], dtype=float)

    def covered(bounds: np.ndarray) -> float:
        return float(np.mean((bounds[:, 0] <= truth) & (truth <= bounds[:, 1])))

    return {
        "batch": covered(batch),
        "independent": covered(independent),
        "width": float(np.mean(batch[:, 1] - batch[:, 0]) / truth),
        "n_effective": float(np.median(n_effective)),
        "flagged": float(np.mean([correlated.strongly_correlated(n, e) for e in n_effective])),
    }


ROWS = [(0.3, 100), (0.5, 100), (0.5, 300), (0.8, 300), (0.8, 1000), (0.9, 1000)]
# Where the docs say the batch-medians interval holds (at least 93% over 1,000 cells, whose standard error is 0.7).
COVERED = [(0.3, 100), (0.5, 100), (0.5, 300), (0.8, 1000)]


@pytest.mark.parametrize(("rho", "n"), COVERED)
def test_batch_medians_cover_where_the_docs_say_and_the_independent_interval_does_not(rho, n):
    result = coverage(rho, n)
    assert result["batch"] >= 0.93, result
    if rho >= 0.5:  # why the open loop does not use the independent-sample interval (at ρ 0.3 it still holds)
        assert result["independent"] < 0.90, result


def test_a_strongly_correlated_cell_is_flagged_more_often_than_a_calm_one():
    assert coverage(0.8, 300, cells=300)["flagged"] > 0.5 > coverage(0.3, 100, cells=300)["flagged"]


if __name__ == "__main__":
    header = [
        "ρ",
        "n",
        "batch medians (5 batches)",
        "its width / median",
        "independent (order statistic)",
        "n_eff (median)",
        "flagged (n_eff < n / 2 and < 40)",
    ]
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|")
    for rho, n in ROWS:
        r = coverage(rho, n)
        print(
            f"| {rho} | {n} | {r['batch']:.1%} | {r['width']:.2f} | {r['independent']:.1%} | {r['n_effective']:.0f} | "
            f"{r['flagged']:.0%} |",
            flush=True,
        )
    sys.exit(0)
