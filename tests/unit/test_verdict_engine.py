"""The verdict engine: classes and crossovers, and the seed write-ups' own figures as input."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from helpers import REPO, with_changes
from servegrid.analysis import verdict
from servegrid.config import Experiment

SEED = yaml.safe_load((REPO / "tests" / "data" / "seed-findings.yaml").read_text())
ORDER = ["prefix_cache", "mtp"]  # config.yaml's order


def group(mode: str, context: int, concurrency: int, winner: str, factor: float, kv_limited: bool = False) -> dict:
    runner_up = "prefix_cache" if winner == "mtp" else "mtp"
    return {
        "mode": mode,
        "context": context,
        "concurrency": concurrency,
        "winner": winner,
        "runner_up": runner_up,
        "factor": factor,
        "factor_ci_low": None,
        "factor_ci_high": None,
        "tie": False,
        "kv_limited": kv_limited,
    }


def seed_comparisons() -> pd.DataFrame:
    """The seed's published points as the engine's input table (one row per cell group).

    Where the seed gives both TTFTs, winner and factor follow from them; where it
    gives only a ratio, the ratio and the text's winner. Multi-turn at 32K × 8
    gives MTP's 28.6 s only; the caching side is the text's "flat, 1.4-5.5 s up
    to 8 sessions", so its upper end is used (the least favourable to caching).
    """
    rows = []
    for p in SEED["decode"]["points"]:
        factor = p["mtp"] / p["prefix_cache"] if "mtp" in p else p["ratio"]
        rows.append(group("decode", 1024, p["concurrency"], "mtp", factor))
    for p in SEED["single_turn_shared_prefix"]["points"]:
        mtp, cache = p["mtp"], p["prefix_cache"]
        winner = "prefix_cache" if cache < mtp else "mtp"
        rows.append(group("single_turn", p["prefix"], p["concurrency"], winner, max(mtp, cache) / min(mtp, cache)))
    flat_high = SEED["multi_turn"]["prefix_cache_flat_range"][1]
    for p in SEED["multi_turn"]["points"]:
        if p.get("kv_limited"):
            rows.append(group("multi_turn", p["context"], p["concurrency"], "mtp", p["prefix_cache"] / p["mtp"], True))
        elif "ratio" in p:
            rows.append(group("multi_turn", p["context"], p["concurrency"], "prefix_cache", p["ratio"]))
        else:
            rows.append(group("multi_turn", p["context"], p["concurrency"], "prefix_cache", p["mtp"] / flat_high))
    return pd.DataFrame(rows)


@pytest.fixture
def rules(seed_raw) -> verdict.VerdictRules:
    return Experiment(seed_raw).verdict


def test_the_seed_figures_reproduce_the_seed_verdict(rules):
    classes = verdict.classify(seed_comparisons(), rules).set_index("class_id")
    # "Single session, long generations, cold prompts: MTP (1.3-2.2x decode)"
    decode = classes.loc["decode"]
    assert decode["outcome"] == "win" and decode["winner"] == "mtp"
    assert decode["factor_min"] == pytest.approx(1.28) and decode["factor_max"] == pytest.approx(94.9 / 49.9)
    assert decode["range_style"] == "range"
    # "Multi-turn, concurrent sessions, growing context: prefix caching (up to 17x TTFT)"
    multi = classes.loc["multi_turn"]
    assert multi["outcome"] == "win" and multi["winner"] == "prefix_cache"
    assert multi["factor_max"] == pytest.approx(16.8) and multi["range_style"] == "up_to"
    # "64K+ context with 16+ concurrent sessions: none - KV limit"
    kv = classes.loc["kv_limit"]
    assert kv["outcome"] == "kv_limit" and pd.isna(kv["winner"])
    assert (kv["min_context"], kv["min_concurrency"]) == (65536, 16)
    # Single-turn has no row in the seed's table; the engine calls it: caching in 2 of 3 groups.
    single = classes.loc["single_turn"]
    assert single["outcome"] == "mixed" and single["winner"] == "prefix_cache"
    assert (single["wins"], single["n_decisive"]) == (2, 3)
    assert single["factor_min"] == pytest.approx(2.6, abs=0.01) and single["factor_max"] == pytest.approx(7.98, 0.01)


def test_the_seed_figures_give_their_crossovers(rules):
    cross = verdict.crossovers(seed_comparisons(), ORDER, rules).set_index("mode")
    # MTP leads decode at every concurrency: no crossover.
    assert cross.loc["decode", "leader"] == "mtp" and not cross.loc["decode", "found"]
    # Single-turn: MTP leads at 4K × 1 (0.85 vs 1.02 s); prefix caching takes over at 4K × 32.
    single = cross.loc["single_turn"]
    assert (single["leader"], single["other"], single["found"]) == ("mtp", "prefix_cache", True)
    assert (single["context"], single["concurrency"]) == (4096, 32) and single["factor"] == pytest.approx(2.6, 0.01)
    # Multi-turn: prefix caching leads wherever a group is decisive (the 64K × 16 corner is KV-limited).
    multi = cross.loc["multi_turn"]
    assert (multi["leader"], multi["found"], multi["decisive_groups"], multi["groups"]) == ("prefix_cache", False, 2, 3)


def test_near_ties_and_ci_ties_name_no_winner(rules):
    table = pd.DataFrame([group("decode", 512, 1, "mtp", 1.02), {**group("decode", 512, 2, "mtp", 1.5), "tie": True}])
    row = verdict.classify(table, rules).set_index("class_id").loc["decode"]
    assert row["outcome"] == "tie" and pd.isna(row["winner"]) and row["n_groups"] == 2


def test_rules_are_data(seed_raw):
    raw = with_changes(seed_raw, **{"verdict.classes": [{"id": "low", "max_concurrency": 8}, {"id": "high"}]})
    rules = Experiment(raw).verdict
    classes = verdict.classify(seed_comparisons(), rules).set_index("class_id")
    assert classes.loc["low", "n_groups"] + classes.loc["high", "n_groups"] == len(seed_comparisons())
    assert classes.loc["high", "min_concurrency"] == 16


def test_empty_classes_report_no_data(rules):
    classes = verdict.classify(pd.DataFrame(), rules)
    assert set(classes["outcome"]) == {"no_data"}
    assert verdict.crossovers(pd.DataFrame(), ORDER, rules).empty
