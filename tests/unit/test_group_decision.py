"""When a cell group's verdict is decided (servegrid.stats.group_decision): the pair and group states, and a
simulation of the whole sequential procedure's coverage and wrong calls.

The procedure simulated: two configurations of one group, a first pass of 8 samples per cell, then up to 3
top-ups of 8 samples each for the cells of open pairs (with two configurations: both cells), decide_group asked
after each (the 99% interval against the band [1/m, m], m = 1.05). At the stop the verdict reports the factor of
the medians with its 95% bootstrap interval, as servegrid.analysis.verdict's duel does. The reference policy has
no repeated looks: a fixed 32 samples per cell, judged once. ``python tests/unit/test_group_decision.py``
prints the table docs/sampling.md quotes (2,000 groups per case, fixed seeds, both cores); ``--scan`` its scan of
the leads just past the band, where the repeated looks cost the most coverage.
"""

from __future__ import annotations

import math
import os
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
from test_sampling import lognormal, queueing

from servegrid.stats import intervals
from servegrid.stats.group_decision import MIN_VALUES, GroupDecision, decide_group, pair_state
from servegrid.stats.sampling import STOP_CONFIDENCE

M = 1.05  # min_factor: the tie band is [1/M, M]


def draws_of(sigma: float, n: int, seed: int, median: float = 0.2) -> np.ndarray:
    return median * np.exp(sigma * np.random.default_rng(seed).standard_normal(n))


def decided(values: dict[str, np.ndarray], higher_is_better: bool = False, **kwargs: object) -> GroupDecision:
    decision = decide_group(values, higher_is_better, M, seed="g", **kwargs)  # type: ignore[arg-type]
    assert decision is not None
    return decision


# ---- pair_state: the interval against the band ----


def test_pair_state_judges_the_interval_against_the_band():
    assert pair_state(1.06, 1.3, M) == "ahead"  # all above m: more samples will not make it a tie
    assert pair_state(0.97, 1.04, M) == "tie"  # all inside [1/m, m]
    assert pair_state(1 / M, M, M) == "tie"  # the band is closed
    assert pair_state(1.0, 1.2, M) == "open"  # straddles m
    assert pair_state(0.9, 1.02, M) == "open"  # reaches below 1/m: the other might lead
    assert pair_state(M, 1.2, M) == "open"  # a low of exactly m is not above it
    assert pair_state(None, None, M) == "open" and pair_state(1.2, None, M) == "open"


# ---- decide_group ----


def test_a_clear_win_is_decided():
    fast, slow = draws_of(0.05, 8, 1, 0.1), draws_of(0.05, 8, 2, 0.3)
    decision = decided({"fast": fast, "slow": slow})
    assert decision.state == "decided" and decision.leader == "fast"
    (pair,) = decision.pairs
    assert pair.other == "slow" and pair.state == "ahead"
    assert pair.factor == pytest.approx(np.median(slow) / np.median(fast))
    assert pair.low is not None and pair.high is not None and M < pair.low <= pair.factor <= pair.high
    assert decision.open_configurations == []


def test_near_identical_tight_samples_are_a_tie():
    decision = decided({"a": draws_of(0.005, 30, 3), "b": draws_of(0.005, 30, 4)})
    assert decision.state == "tie"
    (pair,) = decision.pairs
    assert pair.state == "tie" and pair.low is not None and pair.high is not None
    assert 1 / M <= pair.low <= 1 <= pair.factor <= pair.high <= M
    assert decision.open_configurations == []


def test_a_noisy_small_difference_is_open_and_both_cells_are_measured_again():
    decision = decided({"a": draws_of(0.5, 8, 5), "b": draws_of(0.5, 8, 6, 0.21)})
    assert decision.state == "open"
    (pair,) = decision.pairs
    assert pair.state == "open" and pair.low is not None and pair.high is not None
    assert pair.low < M < pair.high  # neither a win nor a tie yet
    assert sorted(decision.open_configurations) == ["a", "b"]
    assert decision.open_configurations[0] == decision.leader


@pytest.mark.parametrize("higher_is_better", [False, True])
def test_the_leader_has_the_best_median_whichever_way_is_better(higher_is_better):
    low_values, high_values = draws_of(0.05, 10, 7, 0.1), draws_of(0.05, 10, 8, 0.2)
    decision = decided({"low": low_values, "high": high_values}, higher_is_better)
    assert decision.leader == ("high" if higher_is_better else "low")
    (pair,) = decision.pairs
    assert pair.other == ("low" if higher_is_better else "high")
    assert pair.factor == pytest.approx(np.median(high_values) / np.median(low_values))  # ≥ 1 both ways
    assert pair.factor > 1 and pair.state == "ahead"


def test_insertion_order_breaks_a_tie_of_the_medians():
    same = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    assert decided({"x": same, "y": same.copy()}).leader == "x"
    assert decided({"y": same.copy(), "x": same}).leader == "y"


def test_fewer_than_two_configurations_with_values_is_no_decision():
    values = draws_of(0.1, 8, 9)
    assert decide_group({"a": values}, False, M) is None
    assert decide_group({"a": values, "b": [math.nan, math.nan]}, False, M) is None
    assert decide_group({"a": values, "b": []}, False, M) is None
    assert decide_group({}, True, M) is None


def test_nan_is_ignored():
    a, b = draws_of(0.1, 12, 10), draws_of(0.1, 12, 11, 0.3)
    with_nan = {"a": np.concatenate([[math.nan], a, [math.nan]]), "b": np.insert(b, 5, math.nan)}
    assert decided(with_nan) == decided({"a": a, "b": b})  # same seed, same values: the same decision


def test_too_few_values_for_a_median_leave_the_pair_open():
    a, b = draws_of(0.05, 20, 12, 0.1), np.array([0.3, 0.31, 0.3, 0.32, 0.29])  # b far behind, but only 5 values
    assert b.size < MIN_VALUES
    decision = decided({"a": a, "b": b})
    (pair,) = decision.pairs
    assert (pair.low, pair.high, pair.state) == (None, None, "open")
    assert pair.factor == pytest.approx(np.median(b) / np.median(a))  # the medians' factor is still given
    assert decision.state == "open" and decision.open_configurations == ["a", "b"]


def test_open_configurations_are_the_leader_and_the_others_of_open_pairs():
    values = {
        "far": draws_of(0.05, 12, 13, 0.3),  # well behind the leader: ahead, no more samples
        "leader": draws_of(0.05, 12, 14, 0.1),
        "close": draws_of(0.4, 12, 15, 0.105),  # noisy and close: open
    }
    decision = decided(values)
    states = {p.other: p.state for p in decision.pairs}
    assert decision.leader == "leader"
    assert states["far"] == "ahead" and states["close"] == "open"
    assert decision.state == "open"
    open_others = [p.other for p in decision.pairs if p.state == "open"]
    assert decision.open_configurations == [decision.leader, *open_others]
    assert "far" not in decision.open_configurations


def test_a_group_with_an_ahead_pair_and_a_tie_pair_is_decided():
    values = {
        "a": draws_of(0.003, 40, 17, 0.1),
        "b": draws_of(0.003, 40, 18, 0.1),  # a's twin: a tie
        "c": draws_of(0.003, 40, 19, 0.2),  # far behind: ahead
    }
    decision = decided(values)
    assert {p.other: p.state for p in decision.pairs}.get("c") == "ahead"
    assert sorted(p.state for p in decision.pairs) == ["ahead", "tie"]
    assert decision.state == "decided" and decision.open_configurations == []


def test_the_same_seed_gives_the_same_decision_and_another_seed_other_resamples():
    values = {"a": draws_of(0.3, 16, 20), "b": draws_of(0.3, 16, 21, 0.22)}
    first = decide_group(values, False, M, seed="mode/1024/4")
    assert first == decide_group(values, False, M, seed="mode/1024/4")
    other = decide_group(values, False, M, seed="mode/1024/8")
    assert first is not None and other is not None
    assert (first.leader, first.pairs[0].factor) == (other.leader, other.pairs[0].factor)  # medians: no resampling
    assert first.pairs[0].low != other.pairs[0].low  # the bootstrap's resamples differ


def test_the_stopping_interval_is_the_99_percent_one_around_the_reported_95_percent_one():
    values = {"a": draws_of(0.2, 24, 22), "b": draws_of(0.2, 24, 23, 0.23)}
    (stop,) = decided(values).pairs
    (report,) = decided(values, confidence=0.95).pairs
    assert STOP_CONFIDENCE == 0.99
    assert stop.low is not None and stop.high is not None and report.low is not None and report.high is not None
    assert stop.low < report.low <= report.factor <= report.high < stop.high


# ---- the simulation: the sequential procedure against a fixed count ----

Draw = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]
FIRST_PASS, TOP_UP, ROUNDS = 8, 8, 3
SEQUENTIAL = tuple(FIRST_PASS + TOP_UP * r for r in range(ROUNDS + 1))  # looks at 8, 16, 24, 32 samples per cell
FIXED = (SEQUENTIAL[-1],)  # no repeated looks: 32 samples per cell, judged once
# name -> (draw, seed). Each scales by a factor exactly (the mixture's median too), so the true factor is known.
DISTRIBUTIONS: dict[str, tuple[Draw, int]] = {
    "lognormal σ 0.15": (lognormal(0.15), 31),
    "lognormal σ 0.3": (lognormal(0.3), 32),
    "queueing mixture": (queueing, 33),
    "lognormal σ 0.05": (lognormal(0.05), 34),  # tight enough that a tie can be called within 32 samples
}
FACTORS = (1.0, 1.03, 1.05, 1.10, 1.5, 3.0)
GROUPS = 2000


@dataclass(frozen=True)
class Outcome:
    coverage: float  # the reported 95% interval contains the true factor (oriented as reported)
    mean_n: float  # samples per cell at the stop
    decided: float  # shares of the groups by their state at the stop; "open" = the budget ran out
    tie: float
    open: float
    wrong: float  # decided with a true lead below m, or a tie with a true lead beyond the band
    early: float = 0.0  # share of the groups that stopped before the last look
    early_coverage: float = math.nan  # the coverage among those


def group_draws(name: str, factor: float, groups: int) -> np.ndarray:
    """(groups, 2, 32) latencies: configuration "a" (row 0) is faster by ``factor`` than "b" (its draws × factor);
    lower is better, so the true leader is "a"."""
    draw, seed = DISTRIBUTIONS[name]
    rng = np.random.default_rng([seed, round(factor * 1000)])
    values = draw(rng, (groups, 2 * SEQUENTIAL[-1])).reshape(groups, 2, SEQUENTIAL[-1])
    values[:, 1] *= factor
    return values


def reported_interval(values: dict[str, np.ndarray], top: str, bottom: str, group: int) -> tuple[float, float]:
    """The verdict's 95% interval of median(top) / median(bottom) (analysis.verdict.CellSamples: bootstrap each cell
    once, with a seed of its own, independent of the stopping check's)."""
    boot = {
        name: intervals.bootstrap_medians(
            values[name], np.random.default_rng(zlib.crc32(f"verdict/{group}/{name}".encode()))
        )
        for name in (top, bottom)
    }
    low, high = intervals.ratio_interval(boot[top], boot[bottom])
    assert low is not None and high is not None
    return low, high


def simulate(
    draws: np.ndarray, factor: float, looks: Sequence[int] = SEQUENTIAL, confidence: float = STOP_CONFIDENCE
) -> Outcome:
    """Each group looked at after each count of ``looks`` samples per cell until decide_group says it is decided or
    a tie (or the looks run out: the budget), then the verdict's 95% interval of the leader's factor."""
    covered, n_stop, states, wrong = [], [], [], []
    for group, rows in enumerate(draws):
        for n in looks:
            values = {"a": rows[0, :n], "b": rows[1, :n]}
            decision = decide_group(values, False, M, seed=f"group/{group}", confidence=confidence)
            assert decision is not None
            if decision.state != "open":
                break
        leader = decision.leader
        other = "b" if leader == "a" else "a"
        low, high = reported_interval(values, other, leader, group)  # lower is better: other / leader ≥ 1
        truth = factor if leader == "a" else 1 / factor  # the true factor, oriented as the verdict reports it
        covered.append(low <= truth <= high)
        n_stop.append(n)
        states.append(decision.state)
        # Wrong: a group decided although its leader's true lead is below m (a tie, or the wrong leader), or a
        # tie although the true factor lies outside [1/m, m]. A true factor of exactly m is in neither: both
        # calls are right there (unless decided for the wrong leader, whose true lead is 1/m < m).
        wrong.append((decision.state == "decided" and truth < M) or (decision.state == "tie" and factor > M))
    share = {state: states.count(state) / len(states) for state in ("decided", "tie", "open")}
    early = np.array(n_stop) < looks[-1]
    return Outcome(
        float(np.mean(covered)),
        float(np.mean(n_stop)),
        **share,
        wrong=float(np.mean(wrong)),
        early=float(early.mean()),
        early_coverage=float(np.array(covered)[early].mean()) if early.any() else math.nan,
    )


def test_the_simulated_procedure_looks_after_the_first_pass_and_each_top_up():
    assert SEQUENTIAL == (8, 16, 24, 32) and FIXED == (32,)
    draws = group_draws("lognormal σ 0.15", 1.5, 3)
    assert draws.shape == (3, 2, 32)
    again = group_draws("lognormal σ 0.15", 1.5, 3)
    assert np.array_equal(draws, again)  # fixed seeds
    slower = group_draws("lognormal σ 0.15", 1.0, 3)
    assert not np.array_equal(draws[:, 0], slower[:, 0])  # each case its own draws


# The modest run: 300 groups per case (fixed seeds), three cases, about 14 s on one core. Each asks decide_group at
# every look, so each exercises a part of the rule the full run measured (docs/sampling.md, "Sampling that serves the
# verdict"; 2,000 groups per case: coverage 93.2-96.9%, wrong calls at most 0.7%):
# - σ 0.3 at 1.5: groups are decided at 8, 16, 24 or 32 samples, the lucky ones first (full run: 96.5%);
# - σ 0.3 at 1.03: a lead inside the band, where an early "decided" is a wrong call (full run: 96.0%, 0.6% wrong);
# - σ 0.05 at 1.0: ties are called, a quarter of the groups' before the last look (full run: 96.5%, no wrong call).
# The worst case of the full run, σ 0.15 at 1.10 (93.2%), is not here: at 300 groups a coverage's standard error is
# about 1.3 points, so it would test the noise. Wrong calls ≤ 2%: about three times the full run's worst (0.7%),
# while a stopping check on the 80% interval makes 21% of the σ 0.3 groups at 1.03 wrong calls (and covers 90.3%).
# (name, factor, fewest groups that must stop before the budget: the case exercises the early stop)
CHECKED = [("lognormal σ 0.3", 1.5, 0.5), ("lognormal σ 0.3", 1.03, 0.0), ("lognormal σ 0.05", 1.0, 0.2)]


@pytest.mark.parametrize(("name", "factor", "stopping"), CHECKED)
def test_stopping_when_decided_keeps_the_reported_interval_honest_and_calls_rarely_wrong(name, factor, stopping):
    result = case(name, factor, SEQUENTIAL, 300, STOP_CONFIDENCE)
    assert result.coverage >= 0.93, result  # the issue: at least 93% at nominal 95%, as for a single cell's rule
    assert result.wrong <= 0.02, result
    assert result.early >= stopping, result


def case(name: str, factor: float, looks: Sequence[int], groups: int, confidence: float) -> Outcome:
    return simulate(group_draws(name, factor, groups), factor, looks, confidence)


def shown(r: Outcome) -> str:
    return f"{r.coverage:.1%} | {r.mean_n:.1f} | {r.decided:.0%} / {r.tie:.0%} / {r.open:.0%} | {r.wrong:.1%}"


def main(groups: int = GROUPS, confidence: float = STOP_CONFIDENCE) -> None:
    cases = [(name, factor) for name in DISTRIBUTIONS for factor in FACTORS]
    start = time.perf_counter()
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        jobs = {
            (name, factor, looks): pool.submit(case, name, factor, looks, groups, confidence)
            for name, factor in cases
            for looks in (SEQUENTIAL, FIXED)
        }
        print(f"{groups} groups per case, stop confidence {confidence}, m {M}, looks {SEQUENTIAL} vs {FIXED}\n")
        print("| distribution | true factor | sequential: coverage | mean n | decided / tie / budget | wrong |", end="")
        print(" fixed 32: coverage | decided / tie / open | wrong |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, factor in cases:
            seq, fixed = jobs[name, factor, SEQUENTIAL].result(), jobs[name, factor, FIXED].result()
            reference = shown(fixed).split(" | ")
            print(
                f"| {name} | {factor:g} | {shown(seq)} | {reference[0]} | {reference[2]} | {reference[3]} |", flush=True
            )
    print(f"\n{time.perf_counter() - start:.0f} s with {os.cpu_count()} processes")


SCAN_DISTRIBUTIONS = ("lognormal σ 0.15", "lognormal σ 0.3", "queueing mixture")
SCAN_FACTORS = (1.08, 1.10, 1.13, 1.17, 1.22)  # leads just past the band, where some groups decide early, most not
SCAN_CONFIDENCES = (STOP_CONFIDENCE, 0.995)


def scan(groups: int = GROUPS) -> None:
    """The leads just past the band, where the repeated looks cost the most coverage: the rule's stop confidence
    against a stricter one and the fixed count; coverage (mean n; the share that stopped before the budget, and
    their coverage)."""
    cases = [(name, factor) for name in SCAN_DISTRIBUTIONS for factor in SCAN_FACTORS]
    policies = [(SEQUENTIAL, confidence) for confidence in SCAN_CONFIDENCES] + [(FIXED, STOP_CONFIDENCE)]
    start = time.perf_counter()
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        jobs = {
            (name, factor, looks, confidence): pool.submit(case, name, factor, looks, groups, confidence)
            for name, factor in cases
            for looks, confidence in policies
        }
        print(f"{groups} groups per case, m {M}; coverage (mean n; stopped early: share, their coverage)\n")
        stops = " | ".join(f"stop on {confidence:.1%}" for confidence in SCAN_CONFIDENCES)
        print(f"| distribution | true factor | {stops} | fixed 32 |")
        print("|---" * (3 + len(SCAN_CONFIDENCES)) + "|")
        for name, factor in cases:
            shown = []
            for looks, confidence in policies:
                r = jobs[name, factor, looks, confidence].result()
                early = (
                    ""
                    if looks == FIXED
                    else f"; {r.early:.0%} early" + (f", {r.early_coverage:.0%}" if r.early else "")
                )
                shown.append(f"{r.coverage:.1%} (n {r.mean_n:.1f}{early})")
            print(f"| {name} | {factor:g} | " + " | ".join(shown) + " |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s with {os.cpu_count()} processes")


if __name__ == "__main__":
    args = sys.argv[1:]
    groups = int(args[args.index("--groups") + 1]) if "--groups" in args else GROUPS
    if "--scan" in args:
        scan(groups)
    else:
        main(groups, float(args[args.index("--confidence") + 1]) if "--confidence" in args else STOP_CONFIDENCE)
