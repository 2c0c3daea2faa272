"""Sequential sampling (servegrid.stats.sampling): a cell that stops when its interval is narrow still reports an
interval that covers the true median; the floor, the ceilings, the tails rule and the rule's validation.

The coverage simulation judges each cell where the cell runner does, at the end of each stage
(sampling.next_stage_rounds, then sampling.decide), on synthetic latencies, 1,000 cells per distribution,
with fixed seeds. ``python tests/unit/test_sampling.py`` prints the table docs/sampling.md quotes, with the
percentile bootstrap servegrid.stats.intervals uses for comparison; ``--scan`` prints its scan over sigma, judged at
stage ends and, for comparison, after every round.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from scipy import optimize
from scipy import stats as sps

from servegrid.errors import ConfigError
from servegrid.stats import intervals, sampling
from servegrid.stats.sampling import MIN_SAMPLES_FOR, SamplingRule, decide, median_interval, tail_allowed

TRIALS = 1000
RULE = SamplingRule(target_rel_ci=0.05, min_samples=10, max_samples=200, max_duration_s=math.inf)
Draw = Callable[[np.random.Generator, tuple[int, int]], np.ndarray]


def lognormal(sigma: float, median: float = 0.2) -> Draw:
    return lambda rng, shape: median * np.exp(sigma * rng.standard_normal(shape))


def queueing(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """4 sessions on one core: 75% of requests served at once (~0.1 s), 25% queued (~0.4 s), lognormal noise."""
    return np.where(rng.random(shape) < 0.75, 0.1, 0.4) * np.exp(0.1 * rng.standard_normal(shape))


def queueing_median() -> float:
    def cdf(x: float) -> float:
        return 0.75 * sps.norm.cdf(np.log(x / 0.1) / 0.1) + 0.25 * sps.norm.cdf(np.log(x / 0.4) / 0.1)

    return optimize.brentq(lambda x: cdf(x) - 0.5, 0.05, 0.4, xtol=1e-12)


# name -> (draw, true median, seed). sigma 0.15: its cells stop "precise" at a random n (stage 53-180), where
# stopping on luck costs coverage; judged after every round it was the worst case of a scan over sigma.
DISTRIBUTIONS = {
    "lognormal sigma 0.3": (lognormal(0.3), 0.2, 1),
    "lognormal sigma 0.8": (lognormal(0.8), 0.2, 2),
    "lognormal sigma 0.15": (lognormal(0.15), 0.2, 3),
    "queueing mixture": (queueing, queueing_median(), 4),
}
Interval = Callable[[np.ndarray, float], tuple[np.ndarray, np.ndarray, np.ndarray] | None]


Schedule = Callable[[SamplingRule, int], Iterator[int]]


def stage_ends(rule: SamplingRule, round_size: int) -> Iterator[int]:
    """The sample counts at which the cell runner judges a cell: the end of each stage (sessions = round_size)."""
    n = 0
    while rounds := sampling.next_stage_rounds(rule, n, round_size):
        n += rounds * round_size
        yield n


def every_round(rule: SamplingRule, round_size: int) -> Iterator[int]:
    """The old schedule, a look after every round up to max_samples (kept to compare the two)."""
    yield from range(round_size, rule.max_samples + round_size, round_size)


def simulate(
    draws: np.ndarray,
    round_size: int,
    rule: SamplingRule,
    interval: Interval,
    stop_confidence: float,
    schedule: Schedule = stage_ends,
):
    """Every row a cell, judged at each n of the schedule until the rule stops it; its final 95% interval and reason.

    The vectorised twin of the runner's loop over sampling.next_stage_rounds and sampling.decide (checked
    against it below): precise (at stop_confidence) once n >= min_samples, else at max_samples.
    """
    trials = draws.shape[0]
    n_at_stop = np.zeros(trials, dtype=int)
    low, high = np.zeros(trials), np.zeros(trials)
    precise_at_stop = np.zeros(trials, dtype=bool)
    active = np.ones(trials, dtype=bool)
    for n in schedule(rule, round_size):
        rows = np.sort(draws[active, :n], axis=1)
        judged = interval(rows, stop_confidence)
        if judged is None or n < rule.min_samples:
            precise = np.zeros(rows.shape[0], dtype=bool)
        else:
            precise = sampling.relative_half_width(*judged) <= rule.target_rel_ci
        done = precise | (n >= rule.max_samples)
        if not done.any():
            continue
        reported = interval(rows, sampling.CONFIDENCE)
        assert reported is not None
        ids = np.flatnonzero(active)[done]
        n_at_stop[ids], precise_at_stop[ids] = n, precise[done]
        low[ids], high[ids] = reported[1][done], reported[2][done]
        active[ids] = False
        if not active.any():
            break
    assert not active.any(), "the schedule ended before max_samples"
    return n_at_stop, low, high, precise_at_stop


def cells(name: str, round_size: int, rule: SamplingRule = RULE) -> tuple[np.ndarray, float]:
    draw, true_median, seed = DISTRIBUTIONS[name]
    return draw(np.random.default_rng(seed), (TRIALS, rule.max_samples + round_size)), true_median


def covers(
    draws: np.ndarray,
    true_median: float,
    round_size: int,
    interval: Interval,
    stop_confidence: float,
    schedule: Schedule = stage_ends,
) -> dict[str, float]:
    n, low, high, precise = simulate(draws, round_size, RULE, interval, stop_confidence, schedule)
    covered = (low <= true_median) & (true_median <= high)
    return {"coverage": float(covered.mean()), "precise": float(precise.mean()), "mean_n": float(n.mean())}


def coverage(
    name: str, round_size: int, interval: Interval, stop_confidence: float, schedule: Schedule = stage_ends
) -> dict[str, float]:
    draws, true_median = cells(name, round_size)
    return covers(draws, true_median, round_size, interval, stop_confidence, schedule)


def lognormal_cells(sigma: float, trials: int, round_size: int) -> np.ndarray:
    """trials cells of lognormal(sigma) latencies, median 0.2 s, seeded by sigma and round_size."""
    rng = np.random.default_rng([round(sigma * 1000), round_size])
    return lognormal(sigma)(rng, (trials, RULE.max_samples + round_size))


@pytest.mark.parametrize("round_size", [1, 4])
@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_the_reported_interval_covers_the_true_median_under_sequential_stopping(name, round_size):
    result = coverage(name, round_size, sampling.interval_from_sorted, sampling.STOP_CONFIDENCE)
    print(f"{name}, rounds of {round_size}: {result}")
    assert result["coverage"] >= 0.93, result


@pytest.mark.parametrize("round_size", [1, 4])
@pytest.mark.parametrize("name", ["lognormal sigma 0.15", "queueing mixture", "lognormal sigma 0.3"])
def test_the_simulation_is_decide_stage_by_stage(name, round_size):
    """The vectorised simulation stops each cell where the runner's loop does, for the same reason.

    That loop: run sampling.next_stage_rounds rounds of round_size samples, ask sampling.decide; stop when it
    says stop or when there is no next stage.
    """
    draws, _ = cells(name, round_size)
    draws = draws[:25]
    n_at_stop, low, high, precise = simulate(
        draws, round_size, RULE, sampling.interval_from_sorted, sampling.STOP_CONFIDENCE
    )
    reasons = set()
    for row, stop_n, lo, hi, was_precise in zip(draws, n_at_stop, low, high, precise, strict=True):
        n, decision = 0, None
        while rounds := sampling.next_stage_rounds(RULE, n, round_size):
            n += rounds * round_size
            decision = decide(row[:n], elapsed_s=0.0, rule=RULE)
            if decision.stop:
                break
        assert decision is not None and decision.stop  # at the ceiling decide says max_samples itself
        assert (decision.n, decision.precise) == (stop_n, was_precise)
        assert decision.reason == ("precise" if was_precise else "max_samples")
        assert median_interval(row[:n]) == (lo, hi)
        reasons.add(decision.reason)
    if name != "lognormal sigma 0.3":  # (which nearly always runs to max_samples)
        assert "precise" in reasons


def test_judging_at_stage_ends_loses_less_to_optional_stopping_than_judging_every_round():
    """The same cells under the plain check (stop on the reported 95% interval itself): judged after every round
    (up to 191 looks) they stop on luck and undercover; judged at the 9 stage ends, much less."""
    every = coverage("lognormal sigma 0.15", 1, sampling.interval_from_sorted, sampling.CONFIDENCE, every_round)
    staged = coverage("lognormal sigma 0.15", 1, sampling.interval_from_sorted, sampling.CONFIDENCE)
    assert every["coverage"] < 0.935 and staged["coverage"] >= 0.94  # 92.3% and 94.2% with these seeds


def test_stopping_on_the_reported_interval_itself_still_undercovers_a_little_at_stage_ends():
    """Why the check still judges the 99% interval: at stage ends the plain 95% check covers 94.4-94.5% where
    cells stop precise at a random stage (sigma 0.1-0.15 in the --scan), the 99% check at least 95%, at about
    1.5 times the samples. 10,000 cells (the scan's sigma 0.12 row): at 1,000, as in the table, the two
    differ by less than their noise.
    """
    draws = lognormal_cells(0.12, 10_000, 1)
    plain = covers(draws, 0.2, 1, sampling.interval_from_sorted, sampling.CONFIDENCE)
    chosen = covers(draws, 0.2, 1, sampling.interval_from_sorted, sampling.STOP_CONFIDENCE)
    assert plain["coverage"] < 0.947 and chosen["coverage"] >= 0.952, (plain, chosen)  # 94.5% and 95.6%
    assert plain["mean_n"] < chosen["mean_n"]


def test_the_order_statistic_interval_has_at_least_nominal_coverage_at_every_n():
    for confidence in (sampling.CONFIDENCE, sampling.STOP_CONFIDENCE):
        for n in range(1, 400):
            low = sampling.lower_rank(n, confidence)
            if low < 0:
                assert 2 * 0.5**n > 1 - confidence  # even [min, max] is not wide enough
                continue
            covered = 1 - 2 * sps.binom.cdf(low, n, 0.5)
            assert covered >= confidence - 1e-12  # nominal or better...
            assert 1 - 2 * sps.binom.cdf(low + 1, n, 0.5) < confidence  # ...and the narrowest such interval
    assert sampling.lower_rank(5) == -1 and sampling.lower_rank(6) == 0
    assert sampling.MIN_SAMPLES_FLOOR == 8 and sampling.lower_rank(7, 0.99) == -1


def test_median_interval_ignores_nan_and_needs_six_values():
    assert median_interval([0.3, 0.1, 0.2, 0.5, 0.4]) is None
    assert median_interval([0.3, 0.1, np.nan, 0.2, 0.6, 0.5, 0.4]) == (0.1, 0.6)  # 6 values: [min, max]
    assert median_interval([0.25] * 20) == (0.25, 0.25)
    assert median_interval(np.arange(1.0, 11.0)) == (2.0, 9.0)  # n=10: the 2nd and 9th values (97.9%)
    assert median_interval(np.arange(1.0, 11.0), confidence=0.99) == (1.0, 10.0)


def run_cell(
    latencies: np.ndarray,
    rule: SamplingRule,
    round_size: int = 1,
    round_s: float = 0.0,
    schedule: Schedule = stage_ends,
):
    """A cell's loop: ask sampling.decide at each n of the schedule (the runner's stage ends unless told
    otherwise), round_s seconds a round; returns the decision that stopped it."""
    for n in schedule(rule, round_size):
        decision = decide(latencies[:n], elapsed_s=n / round_size * round_s, rule=rule)
        if decision.stop:
            return decision
    raise AssertionError("the schedule ended and decide never said stop")


def test_tight_latencies_stop_early_and_spread_ones_run_to_the_ceiling():
    rule = SamplingRule(target_rel_ci=0.05, min_samples=10, max_samples=40, max_duration_s=math.inf)
    tight = run_cell(lognormal(0.02)(np.random.default_rng(5), (1, 40))[0], rule)
    assert (tight.reason, tight.n, tight.precise) == ("precise", 10, True)  # at the first stage end
    assert tight.rel_half_width is not None and tight.rel_half_width <= 0.05
    spread = run_cell(lognormal(1.5)(np.random.default_rng(6), (1, 40))[0], rule, round_size=4)
    assert (spread.reason, spread.n, spread.precise) == ("max_samples", 40, False)  # stage ends 12 16 24 36 40
    assert spread.rel_half_width is not None and spread.rel_half_width > 0.05


def test_max_duration_stops_a_cell_even_below_min_samples():
    """decide alone, asked after every round: past the deadline it stops whatever n, even below min_samples.

    (At stage ends, the first of which is min_samples, the cell would first be asked at 20 samples.)
    """
    rule = SamplingRule(target_rel_ci=0.05, min_samples=20, max_samples=200, max_duration_s=3.0)
    latencies = lognormal(0.8)(np.random.default_rng(7), (1, 200))[0]
    early = run_cell(latencies, rule, round_size=4, round_s=0.75, schedule=every_round)  # 3 s after round 4
    assert (early.stop, early.reason, early.n, early.precise) == (True, "max_duration", 16, False)
    later = run_cell(latencies, rule, round_size=4, round_s=0.25, schedule=every_round)  # 3 s after round 12
    assert (later.reason, later.n, later.precise) == ("max_duration", 48, False)
    staged = run_cell(latencies, rule, round_size=4, round_s=0.75)  # stage ends 20 32 48 ...: 3.75 s at 20
    assert (staged.reason, staged.n, staged.precise) == ("max_duration", 20, False)


def test_the_stages_grow_by_half_from_min_samples_to_max_samples():
    rule = SamplingRule(target_rel_ci=0.05, min_samples=8, max_samples=300, max_duration_s=math.inf)
    assert sampling.stage_targets(rule) == (8, 12, 18, 27, 41, 62, 93, 140, 210, 300)
    assert sampling.stage_targets(RULE) == (10, 15, 23, 35, 53, 80, 120, 180, 200)
    assert sampling.stage_targets(SamplingRule(0.05, 8, 8, math.inf)) == (8,)
    assert sampling.stage_targets(SamplingRule(0.05, 8, 13, math.inf)) == (8, 12, 13)  # capped at the ceiling
    targets = sampling.stage_targets(rule)
    for concurrency in range(1, 40):
        n, ends = 0, []
        while rounds := sampling.next_stage_rounds(rule, n, concurrency):
            target = next(t for t in targets if t > n)
            assert rounds == math.ceil((target - n) / concurrency)
            n += rounds * concurrency
            assert target <= n < target + concurrency  # whole rounds: past the target by less than one
            ends.append(n)
        assert ends == list(stage_ends(rule, concurrency))
        assert rule.max_samples <= n < rule.max_samples + concurrency
        assert sampling.next_stage_rounds(rule, n, concurrency) == 0  # at the ceiling, no next stage
    assert [n for n in stage_ends(rule, 1)] == list(targets)  # one session: exactly the targets
    assert list(stage_ends(rule, 16)) == [16, 32, 48, 64, 96, 144, 224, 304]  # rounds of 16 pass 12 and 27
    assert sampling.next_stage_rounds(rule, 0, 4) == 2  # to 8
    assert sampling.next_stage_rounds(rule, 13, 4) == 2  # from mid-stage: to 18, at 21
    assert sampling.next_stage_rounds(rule, 299, 4) == 1 and sampling.next_stage_rounds(rule, 300, 4) == 0
    assert sampling.next_stage_rounds(rule, 350, 1) == 0
    for concurrency in (0, -1):
        with pytest.raises(ValueError, match="concurrency"):
            sampling.next_stage_rounds(rule, 0, concurrency)


def test_no_stop_before_min_samples_however_tight():
    rule = SamplingRule(target_rel_ci=0.05, min_samples=20, max_samples=200, max_duration_s=60.0)
    latencies = np.random.default_rng(8).normal(0.2, 0.0005, 40)
    waiting = decide(latencies[:19], elapsed_s=10.0, rule=rule)
    assert not waiting.stop and waiting.reason is None and not waiting.precise
    assert waiting.rel_half_width is not None and waiting.rel_half_width < 0.01  # precise enough, too few
    assert decide(latencies[:20], elapsed_s=10.0, rule=rule).reason == "precise"
    assert decide(latencies[:7], elapsed_s=0.0, rule=rule).rel_half_width is None  # no 99% interval yet
    assert decide([0.0] * 30, elapsed_s=0.0, rule=rule).rel_half_width is None  # nothing to be relative to


def test_tails_need_three_samples_expected_beyond_them():
    assert [MIN_SAMPLES_FOR(q) for q in (0.5, 0.9, 0.95, 0.99, 0.999)] == [6, 30, 60, 300, 3000]
    assert math.ceil(3 / (1 - 0.9)) == 31  # the float trap MIN_SAMPLES_FOR avoids
    assert not tail_allowed(299, 0.99) and tail_allowed(300, 0.99)
    assert not tail_allowed(29, 0.9) and tail_allowed(30, 0.9)
    assert not tail_allowed(5, 0.5) and tail_allowed(6, 0.5)
    assert tail_allowed(300, np.float64(0.99))
    for q in (0.5, 0.9, 0.99, 0.999):  # all samples fall below the percentile in at most ~5% of cells
        assert q ** MIN_SAMPLES_FOR(q) <= 0.05
    for q in (0.0, 1.0, 99.0, -0.5):
        with pytest.raises(ValueError, match="percentile"):
            MIN_SAMPLES_FOR(q)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"target_rel_ci": 0.0}, "sampling.target_rel_ci"),
        ({"target_rel_ci": 1.0}, "sampling.target_rel_ci"),
        ({"target_rel_ci": math.nan}, "sampling.target_rel_ci"),
        ({"target_rel_ci": "5%"}, "sampling.target_rel_ci"),
        ({"min_samples": 7}, "sampling.min_samples"),
        ({"min_samples": 10.0}, "sampling.min_samples"),
        ({"max_samples": True}, "sampling.max_samples"),
        ({"min_samples": 50, "max_samples": 40}, "sampling.max_samples"),
        ({"max_duration_s": 0}, "sampling.max_duration_s"),
        ({"max_duration_s": -1.0}, "sampling.max_duration_s"),
        ({"max_duration_s": math.nan}, "sampling.max_duration_s"),
    ],
)
def test_a_bad_rule_is_a_config_error_naming_its_key(changes, key):
    fields = {"target_rel_ci": 0.05, "min_samples": 10, "max_samples": 200, "max_duration_s": 600.0} | changes
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}\b"):
        SamplingRule(**fields)


def test_a_good_rule_is_accepted_and_frozen():
    rule = SamplingRule(target_rel_ci=0.05, min_samples=8, max_samples=8, max_duration_s=math.inf)
    assert (rule.min_samples, rule.max_samples) == (8, 8)
    with pytest.raises(AttributeError):
        rule.min_samples = 3  # type: ignore[misc]


# ---- the comparison docs/sampling.md reports: stats.intervals' percentile bootstrap under the same rule ----

RESAMPLES = intervals.RESAMPLES
_resample_ranks: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def bootstrap_from_sorted(rows: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """stats.median_ci's percentile bootstrap, vectorised over rows of sorted values.

    The median of a resample of sorted values is the value at the resample's median rank(s), so the
    RESAMPLES resamples at each n are drawn once as ranks and read off every row.
    """
    n = rows.shape[-1]
    if n < 3:
        return None
    if n not in _resample_ranks:
        ranks = np.sort(np.random.default_rng(n).integers(0, n, (RESAMPLES, n)), axis=1)
        _resample_ranks[n] = (ranks[:, (n - 1) // 2], ranks[:, n // 2])
    a, b = _resample_ranks[n]
    medians = (rows[..., a] + rows[..., b]) / 2
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail], axis=-1)
    return (rows[..., (n - 1) // 2] + rows[..., n // 2]) / 2, low, high


def test_the_comparison_bootstrap_is_stats_median_ci():
    rng = np.random.default_rng(9)
    for n in (7, 20, 51, 150):
        values = 0.2 * np.exp(0.5 * rng.standard_normal(n))
        ours = bootstrap_from_sorted(np.sort(values)[None, :], 0.95)
        assert ours is not None
        low, high = intervals.median_ci(values)
        assert low is not None and high is not None
        width = high - low
        assert abs(ours[1][0] - low) <= 0.15 * width and abs(ours[2][0] - high) <= 0.15 * width


def main() -> None:
    header = "| distribution | round | order statistic, stop on 99% (chosen) | order statistic, stop on 95% |"
    print(header + " bootstrap, stop on 99% | bootstrap, stop on 95% |")
    print("|---|---|---|---|---|---|")
    procedures = [
        (sampling.interval_from_sorted, 0.99),
        (sampling.interval_from_sorted, 0.95),
        (bootstrap_from_sorted, 0.99),
        (bootstrap_from_sorted, 0.95),
    ]
    for name in DISTRIBUTIONS:
        for round_size in (1, 4):
            results = [coverage(name, round_size, interval, confidence) for interval, confidence in procedures]
            shown = [f"{r['coverage']:.1%} (mean n {r['mean_n']:.0f}, {r['precise']:.0%} precise)" for r in results]
            print(f"| {name} | {round_size} | " + " | ".join(shown) + " |", flush=True)


def scan() -> None:
    """Lognormal sigma from 0.08 to 0.3, 10,000 cells each: coverage (mean n) of the plain check and of the
    chosen one, judged at stage ends and, for comparison, after every round."""
    print("| sigma | round | stage ends, stop on 95% | stage ends, stop on 99% (chosen) |", end="")
    print(" every round, stop on 95% | every round, stop on 99% |")
    print("|---|---|---|---|---|---|")
    for round_size in (1, 4):
        for sigma in (0.08, 0.1, 0.12, 0.15, 0.18, 0.2, 0.25, 0.3):
            draws = lognormal_cells(sigma, 10_000, round_size)
            shown = []
            for schedule in (stage_ends, every_round):
                for confidence in (sampling.CONFIDENCE, sampling.STOP_CONFIDENCE):
                    r = covers(draws, 0.2, round_size, sampling.interval_from_sorted, confidence, schedule)
                    shown.append(f"{r['coverage']:.1%} (n {r['mean_n']:.0f})")
            print(f"| {sigma} | {round_size} | " + " | ".join(shown) + " |", flush=True)


if __name__ == "__main__":
    scan() if "--scan" in sys.argv[1:] else main()
