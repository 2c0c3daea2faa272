"""Service-level objectives: attainment, goodput and the production table, on hand-computed examples."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from helpers import with_changes
from servegrid.analysis import slo
from servegrid.config import Experiment
from servegrid.config.sections import objectives
from servegrid.errors import ConfigError


def requests(ttft: list[float], tpot: list[float], errors: set[int] = frozenset()) -> pd.DataFrame:  # type: ignore[assignment]
    return pd.DataFrame(
        {
            "ttft_s": ttft,
            "tpot_s": tpot,
            "e2e_s": [a + 10 * b for a, b in zip(ttft, tpot, strict=True)],
            "error": [("HTTP 500" if i in errors else None) for i in range(len(ttft))],
        }
    )


def test_objectives_are_read_as_written_and_kept_in_seconds():
    (tpot,) = objectives({"tpot_p90_ms": 50})
    assert (tpot.metric, tpot.percentile, tpot.limit_s) == ("tpot", 90, pytest.approx(0.05))
    (ttft,) = objectives({"ttft_p99_s": 2})
    assert (ttft.metric, ttft.percentile, ttft.limit_s) == ("ttft", 99, 2.0)


def thrice(values: list[float]) -> list[float]:
    """Each value three times: 30 requests, the fewest a p90 objective is judged from."""
    return [v for v in values for _ in range(3)]


def test_attainment_goodput_and_whether_the_cell_meets_them():
    ttft = thrice([0.1 * i for i in range(1, 11)])  # 0.1 … 1.0 s
    frame = requests(ttft, [0.01] * 30)
    columns = slo.cell_columns(frame, objectives({"ttft_p90_s": 0.85}), duration_s=12.0)
    # 24 of 30 requests within 0.85 s, not 27: the cell does not meet a p90 objective, but a p80 one.
    assert columns["slo_attainment"] == pytest.approx(0.8) and columns["goodput_rps"] == pytest.approx(2.0)
    assert columns["slo_met"] is False
    assert columns["slo_attainment_ci_low"] < 0.8 < columns["slo_attainment_ci_high"]  # Wilson interval
    assert slo.cell_columns(frame, objectives({"ttft_p80_s": 0.85}), 12.0)["slo_met"] is True


def test_a_failed_request_meets_no_objective_and_every_objective_must_hold():
    frame = requests([0.1] * 30, thrice([0.01] * 9 + [0.2]), errors={0, 1, 2})
    columns = slo.cell_columns(frame, objectives({"ttft_p90_s": 0.5, "tpot_p80_ms": 50}), duration_s=6.0)
    # 3 requests failed, 3 are too slow per token: 24 of 30 meet both; 27 of 30 the TTFT objective
    assert columns["slo_attainment"] == pytest.approx(0.8) and columns["goodput_rps"] == pytest.approx(4.0)
    assert columns["slo_met"] is True
    assert slo.cell_columns(frame, objectives({"tpot_p90_ms": 50}), 6.0)["slo_met"] is False
    three_more = requests([0.1] * 30, thrice([0.01] * 9 + [0.2]), errors=set(range(6)))
    assert slo.cell_columns(three_more, objectives({"ttft_p90_s": 0.5}), 6.0)["slo_met"] is False


def test_a_cell_meets_a_percentile_objective_when_that_share_of_requests_is_within_it():
    """The inverted-CDF percentile: 27 of 30 within 50 ms meets p90 ≤ 50 ms, although numpy's interpolated p90
    (the summary's column) of these values is above 50 ms."""
    frame = requests([0.1] * 30, thrice([0.010] * 8 + [0.049, 0.200]))
    assert np.percentile(frame["tpot_s"], 90) > 0.050
    assert slo.cell_columns(frame, objectives({"tpot_p90_ms": 50}), 1.0)["slo_met"] is True
    sixty = pd.concat([frame, frame], ignore_index=True)  # a p95 objective is judged from 60 requests
    assert slo.cell_columns(sixty, objectives({"tpot_p95_ms": 50}), 1.0)["slo_met"] is False


def test_an_objective_is_not_judged_from_fewer_requests_than_its_percentile_needs():
    """p90 from 30 requests, p95 from 60 (servegrid.stats.sampling.MIN_SAMPLES_FOR): below, slo_met is None, while
    the attainment (a share with its interval) is still reported."""
    frame = requests([0.1] * 29, [0.01] * 29)
    columns = slo.cell_columns(frame, objectives({"ttft_p90_s": 0.5}), 1.0)
    assert columns["slo_met"] is None and columns["slo_attainment"] == 1.0
    assert columns["slo_attainment_ci_low"] < 1.0
    full = requests([0.1] * 30, [0.01] * 30)
    assert slo.cell_columns(full, objectives({"ttft_p90_s": 0.5}), 1.0)["slo_met"] is True
    assert slo.cell_columns(full, objectives({"ttft_p90_s": 0.5, "tpot_p95_ms": 50}), 1.0)["slo_met"] is None
    assert slo.cell_columns(requests([0.1] * 6, [0.01] * 6), objectives({"ttft_p50_s": 0.5}), 1.0)["slo_met"]


def test_no_objectives_no_columns():
    assert set(slo.cell_columns(requests([0.1], [0.01]), (), 1.0).values()) == {None}


def summary(rows: list[tuple[str, int, bool, float]]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "mode": "decode",
                "context": 512,
                "configuration": name,
                "concurrency": c,
                "valid": True,
                "slo_met": met,
                "goodput_rps": goodput,
            }
            for name, c, met, goodput in rows
        ]
    )


def test_the_production_table_names_the_highest_sustained_concurrency_and_the_winner():
    table = slo.production(
        summary(
            [
                ("a", 1, True, 1.0),
                ("a", 2, False, 0.5),
                ("a", 4, True, 3.0),  # non-monotone: sustains 1
                ("b", 1, True, 1.0),
                ("b", 2, True, 1.9),
                ("b", 4, True, 3.5),  # sustains 4
                ("c", 1, False, 0.0),
                ("c", 2, False, 0.0),
                ("c", 4, False, 0.0),  # nowhere
            ]
        ),
        ["a", "b", "c"],
        ["decode"],
    ).set_index("configuration")
    assert table.loc["a", "sustained_concurrency"] == 1 and table.loc["a", "non_monotone"]
    assert table.loc["a", "met"] == "1,4" and table.loc["a", "measured"] == "1,2,4"
    assert table.loc["b", "sustained_concurrency"] == 4 and not table.loc["b", "non_monotone"]
    assert table.loc["b", "goodput_rps"] == pytest.approx(3.5)
    assert np.isnan(table.loc["c", "sustained_concurrency"]) and pd.isna(table.loc["c", "goodput_rps"])
    assert list(table["winner"]) == [False, True, False]


def test_an_invalid_cell_ends_the_run_of_levels_without_counting_as_a_failure():
    rows = summary([("a", 1, True, 1.0), ("a", 2, True, 1.5), ("a", 4, True, 2.0)])
    rows.loc[rows["concurrency"] == 2, "valid"] = False
    (row,) = slo.production(rows, ["a"], ["decode"]).to_dict("records")
    assert (row["sustained_concurrency"], row["stopped_by"], row["non_monotone"]) == (1, "invalid", False)
    rows.loc[rows["concurrency"] == 2, ["valid", "slo_met"]] = [True, False]
    (row,) = slo.production(rows, ["a"], ["decode"]).to_dict("records")
    assert (row["sustained_concurrency"], row["stopped_by"], row["non_monotone"]) == (1, "objectives", True)


def test_a_cell_with_too_few_requests_for_the_objectives_ends_the_run_of_levels_unjudged():
    rows = summary([("a", 1, True, 1.0), ("a", 2, True, 1.5), ("a", 4, True, 2.0)])
    rows["slo_met"] = rows["slo_met"].astype(object)
    rows.loc[rows["concurrency"] == 2, "slo_met"] = None
    (row,) = slo.production(rows, ["a"], ["decode"]).to_dict("records")
    assert (row["sustained_concurrency"], row["stopped_by"], row["met"]) == (1, "too_few", "1,4")


def test_equal_sustained_concurrency_goes_to_the_higher_goodput_and_invalid_cells_never_count():
    rows = summary([("a", 1, True, 1.0), ("a", 2, True, 1.5), ("b", 1, True, 1.0), ("b", 2, True, 1.8)])
    table = slo.production(rows, ["a", "b"], ["decode"]).set_index("configuration")
    assert table.loc["b", "winner"] and not table.loc["a", "winner"]
    close = summary([("a", 1, True, 1.0), ("a", 2, True, 1.76), ("b", 1, True, 1.0), ("b", 2, True, 1.8)])
    assert slo.production(close, ["a", "b"], ["decode"])["winner"].tolist() == [True, True]  # within 5%: a tie
    rows.loc[(rows["configuration"] == "b") & (rows["concurrency"] == 2), "valid"] = False
    table = slo.production(rows, ["a", "b"], ["decode"]).set_index("configuration")
    assert table.loc["a", "winner"] and table.loc["b", "sustained_concurrency"] == 1


def test_objectives_must_name_an_enabled_mode_and_a_known_figure(demo_raw):
    raw = with_changes(demo_raw, **{"slo.decode": {"tpot_p90_ms": 50}})
    assert Experiment(raw).slo["decode"][0].limit_s == pytest.approx(0.05)
    with pytest.raises(
        ConfigError,
        match=r"slo\.decode: 'tpot_p90_min' does not match any of the regexes|"
        r"slo\.decode: Additional properties",
    ):
        Experiment(with_changes(demo_raw, **{"slo.decode": {"tpot_p90_min": 50}}))
    # A disabled mode keeps its objectives in the file, unused until it is enabled again.
    disabled = with_changes(demo_raw, **{"workloads.decode.enabled": False, "slo.decode": {"tpot_p90_ms": 50}})
    assert "decode" not in Experiment(disabled).slo
