"""Fixtures shared by the unit tests' modules (a fixture imported into two modules is built once per module)."""

from __future__ import annotations

import pytest
import yaml
from test_aggregate_verdict import make_demo_grid, run_aggregate

from helpers import REPO
from servegrid.paths import RunTables
from servegrid.reporting import document, figures


@pytest.fixture(scope="session")
def rendered(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Both languages rendered once for the tests that only read them, here and in test_report_rendering (about
    25 s of drawing and printing)."""
    tmp_path = tmp_path_factory.mktemp("rendered")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        return render_both(
            *make_demo_grid(yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text()), tmp_path), tmp_path
        )


def render_both(experiment, cells, tmp_path):  # type: ignore[no-untyped-def]
    run_aggregate(experiment, cells, tmp_path)
    out = {}
    for lang in ("pt", "hu"):
        figures_dir = tmp_path / "figures" / lang
        tables = RunTables.under(tmp_path)
        figures.draw_all(experiment, tables, figures_dir, lang)
        html, pdf = tmp_path / f"r-{lang}.html", tmp_path / f"r-{lang}.pdf"
        document.render(experiment, lang, tables, figures_dir, str(html), str(pdf))
        out[lang] = (html.read_text(encoding="utf-8"), pdf)
    return experiment, out
