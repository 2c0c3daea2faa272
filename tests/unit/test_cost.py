"""Issue 43, item 3: the price of a million tokens at the highest load a configuration sustains within the objectives
(servegrid.analysis.cost), from the cost: section and the sustained cell's own throughput and energy."""

from __future__ import annotations

import pandas as pd
import pytest

from helpers import with_changes
from servegrid.analysis import cost
from servegrid.config import Experiment
from servegrid.errors import ConfigError


def production(**sustained: int | None) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"mode": "decode", "context": 512, "configuration": name, "sustained_concurrency": level}
            for name, level in sustained.items()
        ]
    )


def summary(rows: list[dict]) -> pd.DataFrame:  # type: ignore[type-arg]
    return pd.DataFrame([{"mode": "decode", "context": 512, **r} for r in rows])


def test_a_million_tokens_cost_the_devices_hour_over_the_tokens_served_at_the_sustained_load(seed_raw):
    raw = with_changes(seed_raw, cost={"device_per_hour": 3.0, "currency": "EUR"})
    experiment = Experiment(raw)
    first, second = list(experiment.configurations)[:2]
    gpus = len(experiment.configurations[first].gpus)
    cells = summary(
        [
            # The sustained level's cell is the one priced, not a lower one.
            {"configuration": first, "concurrency": 4, "input_tps_total": 100.0, "output_tps_total": 50.0},
            {"configuration": first, "concurrency": 8, "input_tps_total": 900.0, "output_tps_total": 300.0},
            {"configuration": second, "concurrency": 4, "input_tps_total": 10.0, "output_tps_total": 5.0},
        ]
    )
    priced = cost.price(production(**{first: 8, second: None}), cells, experiment).set_index("configuration")
    hourly = 3.0 * gpus
    assert priced.loc[first, "devices"] == gpus
    assert priced.loc[first, "cost_per_million_tokens"] == pytest.approx(hourly / (1200 * 3600) * 1e6)
    assert priced.loc[first, "cost_per_million_output_tokens"] == pytest.approx(hourly / (300 * 3600) * 1e6)
    assert priced.loc[first, "currency"] == "EUR"
    assert pd.isna(priced.loc[second, "cost_per_million_tokens"])  # sustains nothing: no price


def test_the_energy_is_priced_where_the_gpus_reported_it(seed_raw):
    raw = with_changes(seed_raw, cost={"device_per_hour": 2.0, "energy_per_kwh": 0.36})
    experiment = Experiment(raw)
    name = next(iter(experiment.configurations))
    gpus = len(experiment.configurations[name].gpus)
    measured = {"configuration": name, "concurrency": 2, "input_tps_total": 0.0, "output_tps_total": 100.0}
    energy = {"joules_per_token": 500.0, "joules_per_output_token": 500.0}
    for joules, extra in ((energy, 0.36 * 500 / 3.6e6 * 1e6), ({}, 0.0)):
        priced = cost.price(production(**{name: 2}), summary([measured | joules]), experiment)
        expected = (2.0 * gpus / (100 * 3600)) * 1e6 + extra
        assert priced["cost_per_million_output_tokens"].iloc[0] == pytest.approx(expected)


def test_a_run_without_prices_still_says_its_throughput(seed_raw):
    experiment = Experiment(seed_raw)
    assert experiment.cost is None
    name = next(iter(experiment.configurations))
    cells = summary([{"configuration": name, "concurrency": 2, "input_tps_total": 7.0, "output_tps_total": 3.0}])
    priced = cost.price(production(**{name: 2}), cells, experiment)
    assert priced["output_tps"].iloc[0] == 3.0 and pd.isna(priced["cost_per_million_tokens"].iloc[0])
    assert list(cost.price(production(), summary([]), experiment).columns)[-len(cost.COST_COLUMNS) :] == (
        cost.COST_COLUMNS
    )


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"device_per_hour": 0}, "device_per_hour"),
        ({"currency": "USD"}, "device_per_hour"),
        ({"device_per_hour": 1, "currency": "dollars"}, "currency"),
    ],
)
def test_a_bad_cost_section_is_refused_naming_the_key(seed_raw, section, named):
    with pytest.raises(ConfigError, match=rf"cost.*{named}|{named}.*cost"):
        Experiment(with_changes(seed_raw, cost=section))


def test_the_runs_device_hours_are_its_cell_jobs_wall_clock_times_the_devices(seed_raw):
    raw = with_changes(seed_raw, cost={"device_per_hour": 2.0})
    experiment = Experiment(raw)
    first, second = list(experiment.configurations)[:2]
    gpus = {name: len(experiment.configurations[name].gpus) for name in (first, second)}
    cells = pd.DataFrame(
        [
            {"configuration": first, "mode": "decode", "cell_wall_s": 1800.0, "duration_s": 60.0},
            {"configuration": first, "mode": "decode", "cell_wall_s": 1800.0, "duration_s": 60.0},
            {"configuration": first, "mode": "single_turn", "cell_wall_s": 360.0, "duration_s": 30.0},
            {"configuration": second, "mode": "decode", "cell_wall_s": 7200.0, "duration_s": 90.0},
        ]
    )
    spent = cost.spent(cells, experiment).set_index(["configuration", "mode"])
    assert spent.loc[(first, "decode"), "device_hours"] == pytest.approx(1.0 * gpus[first])
    assert spent.loc[(first, "decode"), "cells"] == 2 and spent.loc[(first, "decode"), "measuring_s"] == 120.0
    assert spent.loc[(first, "single_turn"), "device_hours"] == pytest.approx(0.1 * gpus[first])
    assert spent.loc[(second, "decode"), "cost"] == pytest.approx(2.0 * 2.0 * gpus[second])
    assert cost.spent(cells, Experiment(seed_raw))["cost"].isna().all()  # not priced


def test_ranked_by_cost_the_cheapest_million_tokens_wins_and_near_prices_tie():
    table = pd.DataFrame(
        [
            # Sustains the most, but its tokens cost the most: the capacity winner, not the price winner.
            {"mode": "decode", "context": 512, "configuration": "big", "winner": True, "cost_per_million_tokens": 9.0},
            {
                "mode": "decode",
                "context": 512,
                "configuration": "lean",
                "winner": False,
                "cost_per_million_tokens": 4.0,
            },
            {
                "mode": "decode",
                "context": 512,
                "configuration": "near",
                "winner": False,
                "cost_per_million_tokens": 4.1,
            },
            {
                "mode": "decode",
                "context": 512,
                "configuration": "none",
                "winner": False,
                "cost_per_million_tokens": None,
            },
            # A context where nothing is priced keeps no winner.
            {
                "mode": "decode",
                "context": 1024,
                "configuration": "big",
                "winner": True,
                "cost_per_million_tokens": None,
            },
        ]
    )
    ranked = cost.rerank(table, min_factor=1.05)
    winners = ranked[ranked["winner"]][["context", "configuration"]].values.tolist()
    assert winners == [[512, "lean"], [512, "near"]]  # 4.1 is within 5% of 4.0: a tie


def test_the_price_ranking_is_a_setting_of_the_cost_section(seed_raw):
    assert Experiment(with_changes(seed_raw, cost={"device_per_hour": 1.0})).cost.rank_by == "capacity"
    ranked = Experiment(with_changes(seed_raw, cost={"device_per_hour": 1.0, "rank_by": "cost"}))
    assert ranked.cost is not None and ranked.cost.rank_by == "cost"
    with pytest.raises(ConfigError, match="rank_by"):
        Experiment(with_changes(seed_raw, cost={"device_per_hour": 1.0, "rank_by": "speed"}))


def test_the_aggregation_writes_the_production_table_priced_and_ranked_by_cost(demo_raw, tmp_path, monkeypatch):
    """The aggregation's wiring: the production table it writes is priced in the section's currency. In this grid one
    configuration sustains each row, so its winners would be the same by capacity: the ranking itself is tested on
    its own above (test_ranked_by_cost_the_cheapest_million_tokens_wins_and_near_prices_tie)."""
    from test_aggregate_verdict import make_demo_grid, run_aggregate

    monkeypatch.chdir(tmp_path)
    raw = with_changes(demo_raw, cost={"device_per_hour": 0.5, "currency": "EUR", "rank_by": "cost"})
    experiment, cells = make_demo_grid(raw, tmp_path)
    production = run_aggregate(experiment, cells, tmp_path)["production"]
    priced = production.dropna(subset=["cost_per_million_tokens"])
    assert len(priced) > 0 and (priced["currency"] == "EUR").all()
    for _, group in production.groupby(["mode", "context"]):
        lowest = group["cost_per_million_tokens"].min()
        expected = set(
            group[group["cost_per_million_tokens"] <= lowest * experiment.verdict.min_factor]["configuration"]
        )
        assert set(group[group["winner"].astype(bool)]["configuration"]) == expected
