"""servegrid compare: two runs' shared cells, what moved beyond noise, as text and as a page in each language."""

from __future__ import annotations

import pytest
from test_aggregate_verdict import decode_only, run_aggregate

from helpers import REPO, synthetic_cell
from servegrid.pipeline import cli
from servegrid.reporting import run_comparison


def _run(folder, experiment, ngram_interval_s: float):  # type: ignore[no-untyped-def]
    """A run of two decode cells: prefix caching the same in every run, ngram at the given pace."""
    folder.mkdir()
    for cell in experiment.cells():
        interval = 0.004 if cell.configuration == "prefix_cache" else ngram_interval_s
        synthetic_cell(
            folder / cell.path,
            cell.configuration,
            "decode",
            512,
            1,
            ttft_s=0.1,
            interval_s=interval,
            requests=30,
            interval_spread=0.1,
        )
    (folder / "tables").mkdir()
    run_aggregate(experiment, [str(folder / c.path) for c in experiment.cells()], folder / "tables")


def test_a_changed_configuration_moves_and_the_other_does_not(tmp_path, demo_raw, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    experiment = decode_only(demo_raw)
    _run(tmp_path / "old", experiment, ngram_interval_s=0.002)
    _run(tmp_path / "new", experiment, ngram_interval_s=0.0025)  # ngram 20% slower per token
    frame = run_comparison.compare_runs(tmp_path / "old", tmp_path / "new").set_index("configuration")
    assert list(frame.index) == ["prefix_cache", "ngram"]
    ngram, same = frame.loc["ngram"], frame.loc["prefix_cache"]
    assert ngram["moved"] and ngram["direction"] == "worse"  # decode speed down: worse
    assert ngram["ratio"] == pytest.approx(0.8, rel=0.03) and ngram["ratio_ci_high"] < 1
    assert (
        not same["moved"] and same["ratio"] == pytest.approx(1.0) and same["ratio_ci_low"] < 1 < same["ratio_ci_high"]
    )
    # The command: the text table (moved cells first), and a page per language in the report's words.
    demo = str(REPO / "config" / "cpu-demo.yaml")  # its report languages: pt, hu
    code = cli.main(
        ["compare", str(tmp_path / "old"), str(tmp_path / "new"), "--out", str(tmp_path / "pages"), "--config", demo]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0].startswith("servegrid compare: 2 cells in both runs, 1 moved beyond noise")
    assert out[4].startswith("ngram/decode/ctx512_c1") and "worse" in out[4]
    assert out[5].startswith("prefix_cache/decode/ctx512_c1") and out[5].split()[-1] == "-"
    pt = (tmp_path / "pages" / "compare-pt.html").read_text(encoding="utf-8")
    hu = (tmp_path / "pages" / "compare-hu.html").read_text(encoding="utf-8")
    assert "Duas execuções comparadas" in pt and "1 de 2 células medidas nas duas execuções mudaram" in pt
    assert "pior" in pt and "0,8" in pt
    assert (
        "Két futás összevetése" in hu and "A mindkét futásban mért 2 cellából 1 mozdult el" in hu and "rosszabb" in hu
    )


def test_runs_without_tables_fail_naming_the_folder(tmp_path):
    from servegrid.errors import ConfigError

    with pytest.raises(ConfigError, match=r"nothing: no summary\.parquet and requests\.parquet to compare"):
        run_comparison.compare_runs(tmp_path / "nothing", tmp_path / "nothing")
