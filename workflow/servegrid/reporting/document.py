"""The bilingual report: one jinja2 template, one gettext catalogue per language.

Every number in the document comes from this run's tables and is formatted
with Babel for the report's locale (decimal comma, the locale's thousands
separator, "1,9×"). The HTML is self-contained (figures embedded as data
URIs, no external fetches); the PDF is the same document rendered by
WeasyPrint, with the same figures (PNG, see :data:`servegrid.reporting.figure_files.FORMATS`)
and fonts shipped with matplotlib so that ő, ű, ã and ç render on any machine.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import jinja2
import matplotlib
import pandas as pd

from servegrid import atomic
from servegrid.analysis.requests_table import closed_loop
from servegrid.config import Experiment, canonical_json
from servegrid.errors import ReportError
from servegrid.languages import REPORT_ROOT
from servegrid.paths import RunTables
from servegrid.records import table_format
from servegrid.reporting.catalogues import Formatter, load_catalog
from servegrid.reporting.contents import ReportContents
from servegrid.reporting.contents.gateway import gateway_view
from servegrid.reporting.contents.open_loop import open_loop_view
from servegrid.reporting.figure_files import FIGURE_DPI, FORMATS, figure_specs

TEMPLATES = REPORT_ROOT / "templates"


def provenance(experiment: Experiment) -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, False
    return {
        "servegrid_version": metadata.version("servegrid"),
        "git_commit": commit,
        "git_dirty": dirty,
        "config_hash": hashlib.sha256(canonical_json(experiment.raw).encode()).hexdigest()[:12],
        "generated_at": datetime.now(UTC),
    }


def read_table(path: str) -> pd.DataFrame:
    """One of the run's Parquet tables; a missing or damaged one is a :class:`ReportError` naming it."""
    try:
        return table_format.read(path)
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}: cannot read the table ({exc}); run the aggregate step first") from exc


def _figure_uri(path: Path) -> str:
    return f"data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"


# The print stylesheet caps a figure at 66 mm high; one drawn taller than this (several rows of panels: the
# CDFs, a heatmap of many configurations) would print below half its size there, its lettering a few points
# high, so it is marked tall and gets the higher cap.
TALL_PT = 2 * 66 / 25.4 * 72


def _is_tall(png: Path) -> bool:
    """Whether the figure's own height (in pt, at the dpi it was drawn at) is over :data:`TALL_PT`."""
    with png.open("rb") as handle:  # a PNG's size is in its header chunk: no need to read the whole figure
        head = handle.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ReportError(f"{png}: not a PNG figure; run the figures step again")
    (height_px,) = struct.unpack(">I", head[20:24])
    return bool(height_px / FIGURE_DPI * 72 > TALL_PT)


def environment(lang: str) -> tuple[jinja2.Environment, Formatter, Any]:
    """The template environment of ``lang``, its number formatter and its translations."""
    translations, locale = load_catalog(lang)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        extensions=["jinja2.ext.i18n"],
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.install_gettext_translations(translations, newstyle=True)  # type: ignore[attr-defined]
    fmt = Formatter(locale)
    env.filters.update(
        num=fmt.num,
        integer=fmt.integer,
        ratio=fmt.ratio,
        seconds=fmt.seconds,
        whole_seconds=fmt.whole_seconds,
        whole_number=fmt.whole_number,
        ms=fmt.ms,
        percent=fmt.percent,
        money=fmt.money,
        date=fmt.date,
        datetime=fmt.datetime,
    )
    return env, fmt, translations


def render_html(
    experiment: Experiment, lang: str, data: ReportContents, figures_dir: Path, medium: str, prov: dict[str, Any]
) -> str:
    env, fmt, translations = environment(lang)
    data.formatter, data.gettext, data.lang = fmt, translations.gettext, lang
    (ext,) = FORMATS
    figures = {
        spec.name: {"uri": _figure_uri(path), "tall": _is_tall(path)}
        for _, spec in figure_specs(experiment)
        if (path := figures_dir / f"{spec.name}.{ext}").exists()
    }
    font_dir = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    return env.get_template("report.html.j2").render(
        lang=lang,
        html_lang=str(fmt.locale).replace("_", "-"),
        medium=medium,
        font_dir=font_dir.as_uri() if medium == "print" else None,
        css=(TEMPLATES / "style.css").read_text(encoding="utf-8"),
        experiment=experiment,
        data=data,
        figures=figures,
        prov=prov,
    )


# The tables the report shows: the report rules declare these as their inputs (with the figures and templates).
TABLES_READ = (
    "summary",
    "comparisons",
    "servers",
    "verdict",
    "crossovers",
    "production",
    "gateway",
    "gateway_verdict",
    "rates",
)


def render(
    experiment: Experiment,
    lang: str,
    tables: RunTables,
    figures_dir: Path,
    html_out: str | None = None,
    pdf_out: str | None = None,
) -> None:
    """The report in ``lang``: the HTML page to ``html_out`` and/or the PDF to ``pdf_out`` (each its own job)."""
    HTML = _pdf_engine() if pdf_out else None  # first: a host without the PDF stack fails before any work
    # The report's sections compare sessions: closed-loop cells; the open-loop ones have a section of their own.
    everything = {name: read_table(path) for name, path in tables.named(TABLES_READ).items()}
    read = {name: closed_loop(frame) for name, frame in everything.items()}
    data = ReportContents(
        experiment,
        read["summary"],
        read["comparisons"],
        read["servers"],
        verdict=read["verdict"],
        crossovers=read["crossovers"],
        production=read["production"],
    )
    data.gateway = gateway_view(experiment, read["gateway"], read["gateway_verdict"])
    data.open_loop = open_loop_view(experiment, everything["summary"], everything["rates"])
    data.every_cell = everything["summary"]
    prov = provenance(experiment)
    if html_out:
        atomic.write_text(html_out, render_html(experiment, lang, data, figures_dir, "screen", prov))
    if pdf_out and HTML is not None:
        printable = render_html(experiment, lang, data, figures_dir, "print", prov)
        with atomic.atomic_path(pdf_out) as tmp:
            HTML(string=printable, base_url=str(REPORT_ROOT)).write_pdf(tmp)


def _pdf_engine() -> Any:
    """WeasyPrint's HTML class, imported only for a PDF: it is slow to import and needs Pango, which a host
    that only wants the HTML report may lack (report.formats: [html])."""
    try:
        from weasyprint import HTML
    except (ImportError, OSError) as exc:  # OSError: WeasyPrint found no Pango
        raise ReportError(
            f"the PDF report needs WeasyPrint and its system libraries (Pango): {exc}. The HTML report does not; "
            "set report.formats: [html] to build it alone"
        ) from exc
    return HTML
