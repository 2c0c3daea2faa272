"""Who wins each cell group, and by how much, computed from the data.

A cell group is one mode × context × concurrency measured on any number of
configurations. They are ranked on the primary figure (p50); the winner is the
first, the factor how many times better it is than the runner-up (always ≥ 1).
The 95% interval of that factor comes from bootstrapping both configurations'
requests; when it includes 1 the group is a tie. When either cell ran into the
KV-cache capacity the group is "neither — KV limit": the figure then measures
the pool, not the configuration. For every pair of configurations, the
crossover is where the lead between them changes as the load grows.

This module is the whole verdict engine (ranking, duels and their shared
bootstrap, classes, crossovers): every rule that turns numbers into a verdict reads in one place.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pandas as pd

from servegrid import modes
from servegrid.config import ClassRule, VerdictRules
from servegrid.stats import intervals

__all__ = [
    "CellSamples",
    "ClassRule",
    "VerdictRules",
    "classify",
    "compare",
    "crossovers",
    "decisive",
    "duels",
    "values_of_cell",
]

GROUP_KEYS = ["mode", "context", "concurrency"]


CellValues = dict[tuple[str, str, int, int], np.ndarray]  # primary values by (configuration, *GROUP_KEYS)


def values_of_cell(requests: pd.DataFrame, configuration: str, mode: str, context: int, concurrency: int) -> np.ndarray:
    """One cell's primary values (its mode's figure of its valid measured requests)."""
    return primary_values_by_cell(requests).get((configuration, mode, context, concurrency), np.empty(0))


def primary_values_by_cell(requests: pd.DataFrame) -> CellValues:
    """Each cell's primary values, from one grouping (a filter of the whole table per duel grew as cells²)."""
    keys = ["configuration", *GROUP_KEYS]
    if requests.empty or not set(keys) <= set(requests.columns):
        return {}
    wanted = [*keys, "phase", "valid", "turn", *(m.primary.column for m in modes.registered())]
    slim = requests[[c for c in dict.fromkeys(wanted) if c in requests.columns]]
    out = {}
    for key, cell in slim.groupby(keys, sort=False):
        primary = modes.get(key[1]).primary
        out[key] = primary.rows(cell)[primary.column].to_numpy(dtype=float)
    return out


class CellSamples:
    """Each cell's primary values and, made once when a duel first needs them, its bootstrap medians.

    A cell meets several others in :func:`compare` and :func:`duels` (every pair of configurations of its
    group): resampling it once, with a seed of its own (its key's CRC-32, so the tables are the same on every
    run), and pairing the medians of two cells gives the same independent-resampling interval as resampling
    both per duel, at a fraction of the cost (docs/scale.md)."""

    def __init__(self, requests: pd.DataFrame, salt: str = "") -> None:
        # ``salt``: two runs' samples of the same cell (reporting.run_comparison) must not share their resamples.
        self.values = primary_values_by_cell(requests)
        self.salt = salt
        self._medians: dict[tuple[str, str, int, int], np.ndarray | None] = {}

    def medians(self, key: tuple[str, str, int, int]) -> np.ndarray | None:
        if key not in self._medians:
            values = self.values.get(key, np.empty(0))
            values = values[~np.isnan(values)]
            rng = np.random.default_rng(zlib.crc32((self.salt + "/".join(map(str, key))).encode()))
            self._medians[key] = None if values.size < 3 else intervals.bootstrap_medians(values, rng)
        return self._medians[key]

    def ratio_ci(
        self,
        numerator: tuple[str, str, int, int],
        denominator: tuple[str, str, int, int],
        denominator_samples: CellSamples | None = None,
    ) -> tuple[float | None, float | None]:
        """95% bootstrap interval of median(numerator cell) / median(denominator cell), the denominator from
        ``denominator_samples`` where given (another run); None below 3 values."""
        top, bottom = self.medians(numerator), (denominator_samples or self).medians(denominator)
        return (None, None) if top is None or bottom is None else intervals.ratio_interval(top, bottom)


def _duel(
    samples: CellSamples, mode: str, context: int, concurrency: int, a: dict[str, Any], b: dict[str, Any]
) -> dict[str, Any]:
    """Two configurations' cells of one group: which is better on the primary p50, by how many times
    (always ≥ 1), the 95% interval of that factor, and whether either ran into the KV capacity."""
    higher = bool(modes.get(mode).primary.higher_is_better)
    a_first = a["primary_p50"] >= b["primary_p50"] if higher else a["primary_p50"] <= b["primary_p50"]
    best, other = (a, b) if a_first else (b, a)
    best_key = (best["configuration"], mode, context, concurrency)
    other_key = (other["configuration"], mode, context, concurrency)
    if higher:
        factor = best["primary_p50"] / other["primary_p50"]
        low, high = samples.ratio_ci(best_key, other_key)
    else:
        factor = other["primary_p50"] / best["primary_p50"]
        low, high = samples.ratio_ci(other_key, best_key)
    return {
        "winner": best["configuration"],
        "winner_p50": float(best["primary_p50"]),
        "runner_up": other["configuration"],
        "runner_up_p50": float(other["primary_p50"]),
        "factor": float(factor),
        "factor_ci_low": low,
        "factor_ci_high": high,
        "tie": bool(low is not None and low <= 1.0),
        "kv_limited": bool(best["kv_limited"] or other["kv_limited"]),
    }


def compare(summary: pd.DataFrame, samples: CellSamples, min_factor: float = 1.05) -> pd.DataFrame:
    """One row per cell group with at least two valid configurations: all of them ranked on the primary
    p50, the winner, and its factor over the runner-up with that factor's 95% interval.

    With more than two configurations the winner may be tied with others (a runner-up it does not beat
    decisively) while these together are clearly ahead of the rest: the *leaders* are the winner and
    every next-ranked configuration it does not beat decisively, and ``lead_*`` is how far the last of
    them is ahead of the first configuration outside (none: every configuration leads)."""
    rows = []
    if summary.empty:
        return pd.DataFrame()
    for (mode, context, concurrency), candidates in _candidates(summary):
        if len(candidates) < 2:
            continue
        higher = bool(modes.get(mode).primary.higher_is_better)
        # A stable sort: equal p50s keep the config's order.
        ranked = sorted(candidates, key=lambda c: -c["primary_p50"] if higher else c["primary_p50"])
        duel = _duel(samples, mode, context, concurrency, ranked[0], ranked[1])
        leaders = 1
        while leaders < len(ranked):
            behind = _duel(samples, mode, context, concurrency, ranked[0], ranked[leaders])
            if behind["tie"] or behind["factor"] < min_factor:
                leaders += 1
            else:
                break
        lead = None
        if leaders < len(ranked):
            lead = _duel(samples, mode, context, concurrency, ranked[leaders - 1], ranked[leaders])
        rows.append(
            {
                "mode": mode,
                "context": context,
                "concurrency": concurrency,
                "metric": ranked[0]["primary_metric"],
                **duel,
                "ranking": ",".join(c["configuration"] for c in ranked),
                "n_configurations": len(ranked),
                "leaders": ",".join(c["configuration"] for c in ranked[:leaders]),
                "lead_factor": lead["factor"] if lead else None,
                "lead_ci_low": lead["factor_ci_low"] if lead else None,
                "lead_ci_high": lead["factor_ci_high"] if lead else None,
                "lead_kv_limited": bool(lead["kv_limited"]) if lead else None,
            }
        )
    return pd.DataFrame(rows)


def _candidates(summary: pd.DataFrame) -> list[tuple[tuple[str, int, int], list[dict[str, Any]]]]:
    """Per cell group (in the summary's order): its valid cells with a primary p50, as records in the
    summary's (the config's) order. Records, not rows of a frame: a group's cells are read many times."""
    columns = ["configuration", *GROUP_KEYS, "primary_p50", "primary_metric", "kv_limited"]
    usable = summary.loc[summary["valid"].astype(bool) & summary["primary_p50"].notna(), columns]
    keys = zip(summary["mode"], summary["context"].astype(int), summary["concurrency"].astype(int), strict=True)
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {key: [] for key in keys}
    for record in usable.to_dict("records"):
        groups[(record["mode"], int(record["context"]), int(record["concurrency"]))].append(record)
    return list(groups.items())


# ---- the verdict engine: workload classes, each with a winner and a range --------------------


def decisive(group: dict[str, Any], rules: VerdictRules) -> bool:
    """A group that names a winner: not KV-limited, not a tie, and won by at least min_factor."""
    return not group["kv_limited"] and not group["tie"] and group["factor"] >= rules.min_factor


def shared_lead(group: dict[str, Any], rules: VerdictRules) -> bool:
    """A group whose winner ties with others, while these leaders are decisively ahead of the rest."""
    leaders = str(group.get("leaders") or "")
    factor, low = group.get("lead_factor"), group.get("lead_ci_low")
    if factor is None or intervals.missing(factor) or "," not in leaders:
        return False
    if group.get("lead_kv_limited") or group["kv_limited"]:
        return False
    return bool(factor >= rules.min_factor and low is not None and not intervals.missing(low) and low > 1.0)


def classify(comparisons: pd.DataFrame, rules: VerdictRules) -> pd.DataFrame:
    """One row per workload class: its outcome, winner and the range of factors it won by.

    Each group goes to the first class whose rule matches it. Outcomes:
    ``win`` (one configuration wins every decisive group), ``mixed`` (it wins
    most of them), ``shared`` (no group has a single decisive winner, but a set
    of configurations leads the rest decisively: ``winner`` names the set),
    ``tie`` (no decisive group), ``kv_limit`` (every group hit the KV capacity:
    neither wins), ``no_data``.
    """
    groups = comparisons.to_dict("records") if len(comparisons) else []
    assigned: dict[str, list[dict[str, Any]]] = {rule.id: [] for rule in rules.classes}
    for group in groups:
        for rule in rules.classes:
            if rule.matches(group):
                assigned[rule.id].append(group)
                break
    rows = []
    for rule in rules.classes:
        members = assigned[rule.id]
        row: dict[str, Any] = {
            "class_id": rule.id,
            "modes": ",".join(sorted({g["mode"] for g in members})),
            "n_groups": len(members),
            "n_decisive": 0,
            "outcome": "no_data",
            "winner": None,
            "wins": 0,
            "factor_min": None,
            "factor_max": None,
            "factor_min_ci_low": None,
            "factor_max_ci_high": None,
            "range_style": None,
            "min_context": min((g["context"] for g in members), default=None),
            "min_concurrency": min((g["concurrency"] for g in members), default=None),
        }
        wins = [g for g in members if decisive(g, rules)]
        shared = [g for g in members if not decisive(g, rules) and shared_lead(g, rules)]
        row["n_decisive"] = len(wins)
        if members and all(g["kv_limited"] for g in members):
            row["outcome"] = "kv_limit"
        elif members and not wins and shared:
            row.update(_shared_outcome(shared, rules))
        elif members and not wins:
            row["outcome"] = "tie"
        elif wins:
            counts: dict[str, int] = {}
            for g in wins:
                counts[g["winner"]] = counts.get(g["winner"], 0) + 1
            winner = max(counts, key=lambda name: (counts[name], -list(counts).index(name)))
            won = [g for g in wins if g["winner"] == winner]
            lowest = min(won, key=lambda g: g["factor"])
            highest = max(won, key=lambda g: g["factor"])
            row.update(
                outcome="win" if counts[winner] == len(wins) else "mixed",
                winner=winner,
                wins=counts[winner],
                factor_min=float(lowest["factor"]),
                factor_max=float(highest["factor"]),
                factor_min_ci_low=_none_if_nan(lowest.get("factor_ci_low")),
                factor_max_ci_high=_none_if_nan(highest.get("factor_ci_high")),
                range_style="up_to" if highest["factor"] / lowest["factor"] > rules.range_style_ratio else "range",
            )
        rows.append(row)
    return pd.DataFrame(rows)


def _shared_outcome(shared: list[dict[str, Any]], rules: VerdictRules) -> dict[str, Any]:
    """No single configuration wins a group of the class, but a set of them leads together: ``shared``,
    the set most often in the lead (comma-joined, in rank order of its first group) and how far ahead."""
    counts: dict[str, int] = {}
    for g in shared:
        key = ",".join(sorted(g["leaders"].split(",")))
        counts[key] = counts.get(key, 0) + 1
    key = max(counts, key=lambda k: (counts[k], -list(counts).index(k)))
    won = [g for g in shared if ",".join(sorted(g["leaders"].split(","))) == key]
    lowest = min(won, key=lambda g: g["lead_factor"])
    highest = max(won, key=lambda g: g["lead_factor"])
    return {
        "outcome": "shared",
        "winner": won[0]["leaders"],
        "wins": counts[key],
        "n_decisive": len(shared),
        "factor_min": float(lowest["lead_factor"]),
        "factor_max": float(highest["lead_factor"]),
        "factor_min_ci_low": _none_if_nan(lowest.get("lead_ci_low")),
        "factor_max_ci_high": _none_if_nan(highest.get("lead_ci_high")),
        "range_style": "up_to" if highest["lead_factor"] / lowest["lead_factor"] > rules.range_style_ratio else "range",
    }


def duels(summary: pd.DataFrame, samples: CellSamples, order: list[str]) -> pd.DataFrame:
    """Every pair of valid configurations (in ``order``) in every cell group: who is better, by how
    many times, with its 95% interval. With two configurations this is :func:`compare`'s table."""
    rows = []
    if summary.empty:
        return pd.DataFrame()
    rank = {name: i for i, name in enumerate(order)}
    for (mode, context, concurrency), candidates in _candidates(summary):
        candidates = sorted(candidates, key=lambda c: rank.get(c["configuration"], len(rank)))
        for i in range(len(candidates)):
            for j in range(i + 1, len(candidates)):
                duel = _duel(samples, mode, context, concurrency, candidates[i], candidates[j])
                rows.append({"mode": mode, "context": context, "concurrency": concurrency, **duel})
    return pd.DataFrame(rows)


CROSSOVER_COLUMNS = [
    "mode",
    "leader",
    "other",
    "found",
    "context",
    "concurrency",
    "factor",
    "factor_ci_low",
    "factor_ci_high",
    "groups",
    "decisive_groups",
]


def crossovers(pairs: pd.DataFrame, order: list[str], rules: VerdictRules) -> pd.DataFrame:
    """Per mode and pair of configurations (in ``order``), from :func:`duels`: the *leader*, the better
    one in the decisive cell group with the least work asked for (context × concurrency), and the
    lightest decisive group in which the *other* one is better instead: where the lead changes, if it
    does in this grid."""
    rows: list[dict[str, Any]] = []
    if pairs.empty:
        return pd.DataFrame(rows, columns=CROSSOVER_COLUMNS)
    rank = {name: i for i, name in enumerate(order)}
    for mode in dict.fromkeys(pairs["mode"]):
        duels_of_mode = pairs[pairs["mode"] == mode].to_dict("records")
        by_pair: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for duel in duels_of_mode:
            first, second = sorted((duel["winner"], duel["runner_up"]), key=lambda n: rank.get(n, len(rank)))
            by_pair.setdefault((first, second), []).append(duel)
        for pair in sorted(by_pair, key=lambda p: (rank.get(p[0], len(rank)), rank.get(p[1], len(rank)))):
            rows.append(_pair_crossover(mode, by_pair[pair], rules))
    return pd.DataFrame(rows, columns=CROSSOVER_COLUMNS)


def _pair_crossover(mode: str, pair_duels: list[dict[str, Any]], rules: VerdictRules) -> dict[str, Any]:
    ordered = sorted(pair_duels, key=lambda d: (d["context"] * d["concurrency"], d["context"]))
    won = [d for d in ordered if decisive(d, rules)]
    row: dict[str, Any] = dict.fromkeys(CROSSOVER_COLUMNS)
    row.update(mode=mode, found=False, groups=len(ordered), decisive_groups=len(won))
    if not won:
        # No clear lead anywhere: name the pair all the same, so that the report can say so.
        row.update(leader=ordered[0]["winner"], other=ordered[0]["runner_up"])
        return row
    leader, other = won[0]["winner"], won[0]["runner_up"]
    row.update(leader=leader, other=other)
    overtaken = next((d for d in won if d["winner"] != leader), None)
    if overtaken is not None:
        row.update(
            found=True,
            context=int(overtaken["context"]),
            concurrency=int(overtaken["concurrency"]),
            factor=overtaken["factor"],
            factor_ci_low=_none_if_nan(overtaken.get("factor_ci_low")),
            factor_ci_high=_none_if_nan(overtaken.get("factor_ci_high")),
        )
    return row


def _none_if_nan(value: Any) -> float | None:
    return None if intervals.missing(value) else float(value)
