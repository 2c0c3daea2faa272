"""Fixtures shared by the unit tests' modules (a fixture imported into two modules is built once per module)."""

from __future__ import annotations

import pytest
import yaml
from test_aggregate_verdict import make_demo_grid, run_aggregate

from helpers import REPO
from servegrid.reporting import document, figures


@pytest.fixture(scope="session")
def rendered(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Both languages rendered once for the tests that only read them, here and in test_report_rendering (about
    25 s of drawing and printing)."""
    tmp_path = tmp_path_factory.mktemp("rendered")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        return render_both(*make_demo_grid(yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text()), tmp_path),
                           tmp_path)  # fmt: skip


def render_both(experiment, cells, tmp_path):  # type: ignore[no-untyped-def]
    run_aggregate(experiment, cells, tmp_path)
    out = {}
    for lang in ("pt", "hu"):
        figures_dir = tmp_path / "figures" / lang
        figures.draw_all(
            experiment,
            str(tmp_path / "summary.parquet"),
            str(tmp_path / "comparisons.parquet"),
            figures_dir,
            lang,
            requests_path=str(tmp_path / "requests.parquet"),
        )
        html, pdf = tmp_path / f"r-{lang}.html", tmp_path / f"r-{lang}.pdf"
        document.render(
            experiment,
            lang,
            summary_path=str(tmp_path / "summary.parquet"),
            comparisons_path=str(tmp_path / "comparisons.parquet"),
            servers_path=str(tmp_path / "servers.parquet"),
            figures_dir=figures_dir,
            html_out=str(html),
            pdf_out=str(pdf),
            verdict_path=str(tmp_path / "verdict.parquet"),
            crossovers_path=str(tmp_path / "crossovers.parquet"),
            production_path=str(tmp_path / "production.parquet"),
        )
        out[lang] = (html.read_text(encoding="utf-8"), pdf)
    return experiment, out
