"""Any number of configurations (1 to 8): the verdict ranks them all, crossovers come per pair, the
figures and the report carry every one, labels come in each report language."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from helpers import synthetic_cell, with_changes
from servegrid import modes
from servegrid.analysis import aggregation
from servegrid.config import Experiment
from servegrid.errors import ConfigError
from servegrid.paths import RunTables
from servegrid.reporting import figure_files, figures

# Decode tokens/s per session follow from the interval between tokens: smaller is faster.
INTERVALS = {"a": 0.010, "b": 0.005, "c": 0.004, "d": 0.0098, "e": 0.020, "f": 0.006, "g": 0.007, "h": 0.008}


def experiment_of(demo_raw, names: list[str], **changes) -> Experiment:  # type: ignore[no-untyped-def]
    template = demo_raw["configurations"]["prefix_cache"]
    raw = with_changes(demo_raw, **changes)
    raw["configurations"] = {n: {**template, "label": f"config {n}"} for n in names}
    raw["workloads"] = {"decode": {**demo_raw["workloads"]["decode"], "contexts": [512], "concurrency": [1, 4]}}
    return Experiment(raw)


def measured(tmp_path, experiment: Experiment, skip: set[tuple[str, int]] = frozenset(), **interval_at):  # type: ignore[no-untyped-def]
    """Synthetic decode cells for every configuration; ``skip`` (configuration, concurrency) pairs are absent."""
    paths = []
    for cell in experiment.cells():
        if (cell.configuration, cell.sessions) in skip:
            continue
        interval = interval_at.get(f"{cell.configuration}{cell.sessions}", INTERVALS[cell.configuration])
        path = tmp_path / cell.path
        synthetic_cell(
            path,
            cell.configuration,
            "decode",
            cell.context,
            cell.sessions,
            ttft_s=0.05,
            interval_s=interval,
            requests=30,
            hit_rate=0.0,
            interval_spread=0.05,
        )
        paths.append(str(path))
    out = RunTables.under(tmp_path)
    aggregation.aggregate(experiment, paths, out)
    return {name: pd.read_parquet(path) for name, path in out.named().items()}


def test_one_configuration_compares_nothing_and_says_so(demo_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tables = measured(tmp_path, experiment_of(demo_raw, ["a"]))
    assert tables["comparisons"].empty and tables["crossovers"].empty
    assert set(tables["verdict"]["outcome"]) == {"no_data"}


@pytest.mark.parametrize("names", [["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]])
def test_every_configuration_is_ranked_and_the_winner_is_measured_against_the_runner_up(
    demo_raw, tmp_path, monkeypatch, names
):
    monkeypatch.chdir(tmp_path)
    tables = measured(tmp_path, experiment_of(demo_raw, names))
    expected = sorted(names, key=lambda n: INTERVALS[n])  # the shortest interval decodes fastest
    for _, group in tables["comparisons"].iterrows():
        assert group["ranking"].split(",") == expected and group["n_configurations"] == len(names)
        assert (group["winner"], group["runner_up"]) == (expected[0], expected[1])
        assert group["factor"] == pytest.approx(INTERVALS[expected[1]] / INTERVALS[expected[0]], rel=0.05)
    decode = tables["verdict"].set_index("class_id").loc["decode"]
    if len(names) == 4:  # c beats b by 1.25×: decisive
        assert decode["winner"] == "c" and decode["outcome"] == "win"
    # One crossover row per mode and pair, in the config's order.
    pairs = [tuple(sorted((r["leader"], r["other"]))) for _, r in tables["crossovers"].iterrows()]
    assert sorted(pairs) == sorted((x, y) for i, x in enumerate(names) for y in names[i + 1 :])


def test_a_near_tie_names_no_winner_and_a_missing_configuration_is_ranked_where_it_ran(demo_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a and d differ by 2%: below verdict.min_factor (1.05), whatever the interval; c did not run at 4 sessions.
    tables = measured(tmp_path, experiment_of(demo_raw, ["a", "d", "c"]), skip={("c", 4)})
    groups = tables["comparisons"].set_index("concurrency")
    assert groups.loc[1, "ranking"] == "c,d,a" and groups.loc[4, "ranking"] == "d,a"
    assert groups.loc[4, "factor"] == pytest.approx(1.02, abs=0.02)
    cross = {tuple(sorted((r["leader"], r["other"]))): r for r in tables["crossovers"].to_dict("records")}
    assert cross[("a", "d")]["decisive_groups"] == 0 and not cross[("a", "d")]["found"]  # no clear lead
    assert cross[("c", "d")]["groups"] == 1  # only where both ran


def test_the_production_table_covers_every_configuration_where_it_ran(demo_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # TPOT = the interval: a (10 ms) and d (9.8 ms) miss 6 ms, c (4 ms) and b (5 ms) meet it; c skipped 4 sessions.
    experiment = experiment_of(demo_raw, ["a", "b", "c", "d"], **{"slo": {"decode": {"tpot_p90_ms": 6}}})
    tables = measured(tmp_path, experiment, skip={("c", 4)})
    production = tables["production"].set_index("configuration")
    assert list(production.index) == ["a", "b", "c", "d"]  # the config's order
    assert production["sustained_concurrency"].to_dict() == pytest.approx(
        {"a": np.nan, "b": 4, "c": 1, "d": np.nan}, nan_ok=True
    )
    assert production.loc["c", "measured"] == "1" and production.loc["b", "winner"]
    assert production["winner"].sum() == 1


def test_two_configurations_tied_in_the_lead_share_the_verdict(demo_raw, tmp_path, monkeypatch):
    """b and d are within 2% of each other, both twice as fast as a: no single winner, a shared lead."""
    monkeypatch.chdir(tmp_path)
    tables = measured(tmp_path, experiment_of(demo_raw, ["a", "b", "d"]), d1=0.0051, d4=0.0051)
    for _, group in tables["comparisons"].iterrows():
        assert sorted(group["leaders"].split(",")) == ["b", "d"]
        assert bool(group["tie"]) or group["factor"] < 1.05  # why d is among the leaders
        assert group["lead_factor"] == pytest.approx(0.010 / 0.0051, rel=0.08) and group["lead_ci_low"] > 1
    decode = tables["verdict"].set_index("class_id").loc["decode"]
    assert decode["outcome"] == "shared" and sorted(decode["winner"].split(",")) == ["b", "d"]
    assert decode["wins"] == 2 and decode["factor_min"] == pytest.approx(1.96, rel=0.08)


def test_the_lead_changes_where_the_data_says(demo_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # b leads at 1 session; a is twice as fast at 4 (its interval halves there).
    tables = measured(tmp_path, experiment_of(demo_raw, ["a", "b"]), a4=0.0025)
    (row,) = tables["crossovers"].to_dict("records")
    assert (row["leader"], row["other"], row["found"]) == ("b", "a", True)
    assert (row["context"], row["concurrency"]) == (512, 4) and row["factor"] == pytest.approx(2.0, rel=0.05)


@pytest.mark.parametrize("names", [["a"], ["a", "b", "c", "d", "e"]])
def test_figures_render_for_one_and_for_five_configurations(demo_raw, tmp_path, monkeypatch, names):
    monkeypatch.chdir(tmp_path)
    experiment = experiment_of(demo_raw, names, **{"report.baseline": names[-1]})
    measured(tmp_path, experiment)
    written = figures.draw_all(experiment, RunTables.under(tmp_path), tmp_path / "figures", "pt")
    assert len(written) == len(figure_files.figure_paths(experiment, "x"))
    assert all(path.stat().st_size > 5_000 for path in written)


def test_multi_turn_figures_draw_each_of_five_configurations_with_its_own_line_and_legend(
    demo_raw, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    names = ["a", "b", "c", "d", "e"]
    raw = with_changes(demo_raw)
    raw["configurations"] = {n: {**demo_raw["configurations"]["prefix_cache"], "label": f"config {n}"} for n in names}
    raw["workloads"] = {
        "multi_turn": {**demo_raw["workloads"]["multi_turn"], "contexts": [1024, 2048], "concurrency": [1, 4]}
    }
    experiment = Experiment(raw)
    paths = []
    for cell in experiment.cells():
        path = tmp_path / cell.path
        synthetic_cell(
            path,
            cell.configuration,
            "multi_turn",
            cell.context,
            cell.sessions,
            turns=3,
            ttft_s=0.1 * (1 + names.index(cell.configuration)),
            interval_s=0.005,
            hit_rate=0.7,
        )
        paths.append(str(path))
    out = RunTables.under(tmp_path)
    aggregation.aggregate(experiment, paths, out)
    painter = figures.Painter(
        experiment,
        pd.read_parquet(out.summary),
        pd.read_parquet(out.comparisons),
        str,
        "pt",
        "pt",
        pd.read_parquet(out.requests),
    )
    labels = [f"config {n}" for n in names]
    for spec in modes.get("multi_turn").figures:
        fig = painter.draw("multi_turn", spec)
        drawn = [ax for ax in fig.axes if ax.axison]
        (legend,) = fig.legends
        if spec.kind == "primary_by_concurrency":  # one panel per context, one line per configuration
            assert len(drawn) == 2
            assert all(sorted(line.get_label() for line in ax.get_lines()) == labels for ax in drawn)
            assert [t.get_text() for t in legend.get_texts()] == labels
        else:  # each configuration alone in its panel (3 to a row: 2 rows, one panel left blank)
            assert spec.kind == "each_configuration_by_context"
            assert [ax.get_title() for ax in drawn] == labels and len(fig.axes) == 6
            assert all(len(ax.get_lines()) == 2 for ax in drawn)  # one line per context
            assert len(legend.get_texts()) == 2
        markers = {line.get_marker() for ax in drawn for line in ax.get_lines()}
        assert len(markers) == 5  # one marker per configuration, whatever the panels


@pytest.mark.parametrize("lang", ["pt", "hu"])
def test_the_printed_report_fits_the_page_with_eight_long_labels(demo_raw, tmp_path, monkeypatch, lang):
    """Every mode (two prefix lengths for single-turn), objectives on each, eight configurations with labels
    as long as the demo's: each table fits the page, in numbered columns with their key, and no page is half
    empty."""
    from test_report_rendering import page_problems

    from servegrid.reporting import document

    monkeypatch.chdir(tmp_path)
    names = list("abcdefgh")
    raw = with_changes(
        demo_raw,
        slo={"decode": {"tpot_p90_ms": 6}, "single_turn": {"ttft_p90_ms": 400}, "multi_turn": {"ttft_p90_ms": 400}},
    )
    raw["configurations"] = {
        n: {
            **demo_raw["configurations"]["ngram"],
            "label": {
                "pt": f"configuração {n}: especulação ngram (3 tokens), sem prefix caching",
                "hu": f"{n} konfiguráció: ngram spekuláció (3 token), prefix caching nélkül",
            },
        }
        for n in names
    }
    for mode, contexts in (("decode", [512]), ("single_turn", [1024, 2048]), ("multi_turn", [1024])):
        raw["workloads"][mode].update(contexts=contexts, concurrency=[1, 4])
    experiment = Experiment(raw)
    paths = []
    for cell in experiment.cells():
        rank = names.index(cell.configuration)
        extra = {"turns": 3} if cell.mode == "multi_turn" else {}  # no prefix caching: no hits
        synthetic_cell(
            tmp_path / cell.path,
            cell.configuration,
            cell.mode,
            cell.context,
            cell.sessions,
            ttft_s=0.05 * (1 + rank),
            interval_s=INTERVALS[cell.configuration],
            hit_rate=0.0,
            **extra,
        )
        paths.append(str(tmp_path / cell.path))
    out = RunTables.under(tmp_path)
    aggregation.aggregate(experiment, paths, out)
    figures.draw_all(experiment, out, tmp_path / "figures", lang)
    pdf, html = tmp_path / "report.pdf", tmp_path / "report.html"
    document.render(experiment, lang, out, tmp_path / "figures", str(html), str(pdf))
    text = html.read_text(encoding="utf-8")
    assert text.count('src="data:image/png;base64,') == len(figure_files.figure_specs(experiment))  # every figure
    # A key above each table with a column per configuration: 4 modes' tables (2 in single-turn), 3 production,
    # 3 attainment; the setup table numbers the configurations too.
    assert text.count('<p class="key">') == 3 + 1 + 3 + 3
    assert "<strong>8</strong> configura" in text or "<strong>8</strong> h konfig" in text
    assert not page_problems(pdf, tmp_path)


def test_labels_and_title_come_in_each_report_language(demo_raw):
    labels = {"pt": "especulação", "hu": "spekuláció"}
    title = {"pt": "Título", "hu": "Cím"}
    raw = with_changes(
        demo_raw,
        **{"experiment.title": title, "configurations.ngram.label": labels, "configurations.prefix_cache.label": "pc"},
    )
    experiment = Experiment(raw)
    assert (experiment.title("pt"), experiment.title("hu")) == ("Título", "Cím")
    assert (experiment.label("ngram", "pt"), experiment.label("ngram", "hu")) == ("especulação", "spekuláció")
    assert experiment.label("prefix_cache", "pt") == experiment.label("prefix_cache", "hu") == "pc"  # one for all
    only_pt = with_changes(demo_raw, **{"configurations.ngram.label": {"pt": "especulação"}})
    with pytest.raises(ConfigError, match=r"configurations\.ngram\.label: no text for hu \(report\.languages\)"):
        Experiment(only_pt)


def test_the_baseline_must_be_a_configuration(demo_raw):
    with pytest.raises(ConfigError, match=r"report\.baseline: 'nope' is not a configuration \(known: prefix_cache"):
        Experiment(with_changes(demo_raw, **{"report.baseline": "nope"}))
    assert Experiment(demo_raw).baseline() == "prefix_cache"
    assert Experiment(with_changes(demo_raw, **{"report.baseline": "ngram"})).baseline() == "ngram"


def test_a_cell_too_small_for_a_median_is_marked_on_the_axis_not_drawn(demo_raw, tmp_path, monkeypatch):
    """A cell with fewer than 6 samples has no median (servegrid.stats.sampling): no point on its line, a hollow
    marker of its configuration at the foot of the panel, and "n too small" once in the legend."""
    monkeypatch.chdir(tmp_path)
    raw = with_changes(demo_raw)
    raw["configurations"] = {n: {**demo_raw["configurations"]["prefix_cache"], "label": f"config {n}"} for n in "ab"}
    raw["workloads"] = {
        "multi_turn": {**demo_raw["workloads"]["multi_turn"], "contexts": [1024], "concurrency": [1, 4]}
    }
    experiment = Experiment(raw)
    paths = []
    for cell in experiment.cells():
        path = tmp_path / cell.path
        few = cell.configuration == "a" and cell.sessions == 1
        synthetic_cell(
            path,
            cell.configuration,
            "multi_turn",
            cell.context,
            cell.sessions,
            turns=3,
            requests=4 if few else 6,
            ttft_s=0.1,
            interval_s=0.005,
            hit_rate=0.7,
        )
        paths.append(str(path))
    out = RunTables.under(tmp_path)
    aggregation.aggregate(experiment, paths, out)
    summary = pd.read_parquet(out.summary)
    assert pd.isna(summary.set_index("cell_id").loc["a/multi_turn/ctx1024_c1", "primary_p50"])  # 4 samples
    painter = figures.Painter(
        experiment, summary, pd.read_parquet(out.comparisons), str, "pt", "pt", pd.read_parquet(out.requests)
    )
    spec = next(s for s in modes.get("multi_turn").figures if s.kind == "primary_by_concurrency")
    fig = painter.draw("multi_turn", spec)
    (ax,) = [axis for axis in fig.axes if axis.axison]
    line_a = next(line for line in ax.get_lines() if line.get_label() == "config a")
    assert np.isnan(line_a.get_ydata()[0]) and not np.isnan(line_a.get_ydata()[1])  # no point at 1 session
    hollow = [c for c in ax.collections if len(c.get_offsets()) and c.get_transform() != ax.transData]
    assert len(hollow) == 1 and list(hollow[0].get_offsets()[:, 0]) == [1.0]
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()].count("n too small") == 1
