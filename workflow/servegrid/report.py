"""The bilingual report: one jinja2 template, one gettext catalogue per language.

Every number in the document comes from this run's tables and is formatted
with Babel for the report's locale (decimal comma, the locale's thousands
separator, "1,9×"). The HTML is self-contained (figures embedded as data
URIs, no external fetches); the PDF is the same document rendered by
WeasyPrint, with vector figures and fonts shipped with matplotlib so that
ő, ű, ã and ç render on any machine.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import jinja2
import matplotlib
import numpy as np
import pandas as pd
from babel import Locale
from babel.dates import format_date, format_datetime

from servegrid import atomic, engines, modes, stats
from servegrid.catalogues import REPORT_ROOT, format_number, load_catalog
from servegrid.config import Experiment, canonical_json
from servegrid.errors import ReportError
from servegrid.figure_list import FORMATS, RUN_FIGURES, figure_specs
from servegrid.modes.base import FigureSpec, Mode

TEMPLATES = REPORT_ROOT / "templates"


@dataclass
class Formatter:
    """Locale-aware number formatting for the template's filters."""

    locale: Locale

    def num(self, value: Any, digits: int = 1) -> str:
        return "–" if stats.missing(value) else format_number(value, digits, self.locale)

    def integer(self, value: Any) -> str:
        return self.num(value, 0)

    def ratio(self, value: Any, digits: int = 1) -> str:
        text = self.num(value, digits)
        return text if text == "–" else f"{text}×"

    def seconds(self, value: Any) -> str:
        if stats.missing(value):
            return "–"
        digits = 2 if abs(value) < 10 else 1
        return f"{self.num(value, digits)} s"

    def ms(self, value: Any) -> str:
        if stats.missing(value):
            return "–"
        return f"{self.num(value * 1000, 1)} ms"

    def percent(self, value: Any) -> str:
        if stats.missing(value):
            return "–"
        return f"{self.num(value * 100, 0)} %" if self.locale.language == "hu" else f"{self.num(value * 100, 0)}%"

    def date(self, value: datetime | None) -> str:
        return "–" if value is None else format_date(value, format="long", locale=self.locale)

    def datetime(self, value: datetime | None) -> str:
        return "–" if value is None else format_datetime(value, format="medium", locale=self.locale)


class ReportData:
    """Everything the template shows, derived from the run's tables."""

    def __init__(
        self,
        experiment: Experiment,
        summary: pd.DataFrame,
        comparisons: pd.DataFrame,
        servers: pd.DataFrame,
        verdict: pd.DataFrame | None = None,
        crossovers: pd.DataFrame | None = None,
        formatter: Formatter | None = None,
        gettext: Any = None,
    ) -> None:
        self.experiment = experiment
        self.formatter = formatter or Formatter(Locale.parse("en"))
        self.gettext = gettext or (lambda message: message)
        self.summary = summary
        self.comparisons = comparisons
        self.servers = servers
        self.verdict = verdict if verdict is not None else pd.DataFrame()
        self.crossovers = crossovers if crossovers is not None else pd.DataFrame()

    @staticmethod
    def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
        """Rows as dicts with NaN turned into None, so templates can test ``is none``."""
        if frame.empty:
            return []
        return [
            {k: (None if stats.missing(v) else v) for k, v in _plain(row).items()} for row in frame.to_dict("records")
        ]

    def verdict_classes(self) -> list[dict[str, Any]]:
        """The verdict table: classes that have data, each with its winner's label."""
        return [
            row | {"winner_label": self.label(row["winner"])}
            for row in self.records(self.verdict)
            if row["outcome"] != "no_data"
        ]

    def crossover_rows(self) -> list[dict[str, Any]]:
        return self.records(self.crossovers)

    def label(self, configuration: str | None) -> str:
        """A configuration's label from the config (a declared input of the report rule), not from the tables."""
        if configuration is None or configuration not in self.experiment.configurations:
            return configuration or ""
        return self.experiment.configurations[configuration].label

    # ---- modes --------------------------------------------------------------------------------
    @staticmethod
    def mode(name: str) -> Mode:
        return modes.get(name)

    def class_mode(self, class_id: str) -> Mode | None:
        """The mode a verdict class is named after, if it is."""
        return modes.get(class_id) if class_id in modes.names() else None

    def class_title(self, class_id: str) -> str:
        mode = self.class_mode(class_id)
        return self.gettext(mode.class_title) if mode else class_id

    def verdict_word(self, class_modes: str) -> str:
        """What a class's factors measure ("decode", "TTFT"): its modes' word, when they share one."""
        words = {modes.get(m).primary.verdict_word for m in class_modes.split(",") if m}
        return self.gettext(words.pop()) if len(words) == 1 else ""

    def mode_sections(self) -> list[dict[str, Any]]:
        """One report section per enabled mode: the mode, its description's values (formatted) and its rows."""
        sections = []
        for name in self.experiment.modes():
            mode, workload = modes.get(name), self.experiment.workload(name)
            params = {key: self.format_value(value) for key, value in mode.describe(workload.settings | {
                "contexts": workload.contexts, "concurrency": workload.concurrency}).items()}  # fmt: skip
            sections.append(
                {"mode": mode, "params": params, "rows": self.mode_rows(name), "concurrency": workload.concurrency}
            )
        return sections

    def format_value(self, value: Any) -> str:
        """A setting as the description shows it: numbers in the locale's format, lists joined."""
        if isinstance(value, list | tuple):
            return ", ".join(self.format_value(v) for v in value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return str(value)
        return self.formatter.integer(value) if float(value).is_integer() else self.formatter.num(value, 2)

    @staticmethod
    def run_figures() -> tuple[FigureSpec, ...]:
        return RUN_FIGURES

    def engine_name(self) -> str:
        return engines.get(self.experiment.engine.kind).display_name

    def role_label(self, role: str) -> str:
        names = [n for n, r in self.experiment.roles().items() if r == role]
        return self.label(names[0]) if names else ""

    def cells(self) -> list[dict[str, Any]]:
        return self.records(self.summary)

    def run_dates(self) -> tuple[datetime | None, datetime | None]:
        if self.summary.empty:
            return None, None
        starts = pd.to_datetime(self.summary["started_at"], utc=True, format="ISO8601")
        return starts.min().to_pydatetime(), starts.max().to_pydatetime()

    def configurations(self) -> list[dict[str, Any]]:
        out = []
        for name, conf in self.experiment.configurations.items():
            sessions = self.servers[self.servers["configuration"] == name] if len(self.servers) else self.servers
            latest = _plain(sessions.iloc[-1].to_dict()) if len(sessions) else {}
            out.append(
                {
                    "name": name,
                    "label": conf.label,
                    "prefix_caching": conf.prefix_caching,
                    "speculative": canonical_json(conf.speculative) if conf.speculative else None,
                    "flags": " ".join(self.experiment.configuration_flags(name)),
                    "gpus": list(conf.gpus),
                    "server": latest,
                    "sessions": len(sessions),
                }
            )
        return out

    def mode_rows(self, mode: str) -> list[dict[str, Any]]:
        """Rows of (context, concurrency) with each configuration's cell and the comparison."""
        cells = self.summary[self.summary["mode"] == mode]
        comps = self.comparisons
        rows = []
        for (context, concurrency), group in cells.groupby(["context", "concurrency"], sort=True):
            by_conf = {r["configuration"]: r for r in group.to_dict("records")}
            comp = None
            if len(comps):
                match = comps[
                    (comps["mode"] == mode) & (comps["context"] == context) & (comps["concurrency"] == concurrency)
                ]
                comp = (
                    match.iloc[0].to_dict() | {"winner_label": self.label(match.iloc[0]["winner"])}
                    if len(match)
                    else None
                )
            rows.append(
                {"context": int(context), "concurrency": int(concurrency), "cells": by_conf, "comparison": comp}
            )
        return rows

    def verdict_rows(self) -> list[dict[str, Any]]:
        return [row | {"winner_label": self.label(row["winner"])} for row in self.records(self.comparisons)]

    def invalid_cells(self) -> list[dict[str, Any]]:
        if self.summary.empty:
            return []
        return self.summary[~self.summary["valid"].astype(bool)].to_dict("records")

    def engine_versions(self) -> list[str]:
        if self.servers.empty:
            return []
        return sorted({str(v) for v in self.servers["engine_version"].dropna()})

    def hardware(self) -> str:
        if self.experiment.info.hardware:
            return self.experiment.info.hardware
        if self.servers.empty:
            return ""
        row = self.servers.iloc[0]
        described = f"{row['host_cpu']} ({row['host_cpu_count']} CPU, {row['host_memory_gib']} GiB)"
        gpus = row.get("host_gpus") or ""
        return f"{described}; {gpus}" if gpus else described

    def cpu_placement(self) -> dict[str, str] | None:
        """The cores servers and client were confined to, when either was ("" = not confined)."""
        servers = sorted({",".join(map(str, c)) for c in self.servers["cpus"]}) if "cpus" in self.servers else []
        clients = sorted(set(self.summary["client_cpus"])) if "client_cpus" in self.summary else []
        confined_servers = [s for s in servers if s]
        if not confined_servers and not self.experiment.operations.client_cpus:
            return None
        return {"server": " / ".join(servers), "client": " / ".join(clients)}


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """Parquet list columns arrive as numpy arrays; templates want lists."""
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()}


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
        return pd.read_parquet(path)
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}: cannot read the table ({exc}); run the aggregate step first") from exc


def _figure_uri(path: Path, ext: str) -> str:
    mime = {"png": "image/png", "svg": "image/svg+xml"}[ext]
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


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
        ms=fmt.ms,
        percent=fmt.percent,
        date=fmt.date,
        datetime=fmt.datetime,
    )
    return env, fmt, translations


def render_html(
    experiment: Experiment, lang: str, data: ReportData, figures_dir: Path, medium: str, prov: dict[str, Any]
) -> str:
    env, fmt, translations = environment(lang)
    data.formatter, data.gettext = fmt, translations.gettext
    ext = "png" if medium == "screen" else "svg"
    assert ext in FORMATS
    figures = {
        spec.name: _figure_uri(figures_dir / f"{spec.name}.{ext}", ext)
        for _, spec in figure_specs(experiment)
        if (figures_dir / f"{spec.name}.{ext}").exists()
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


def render(
    experiment: Experiment,
    lang: str,
    summary_path: str,
    comparisons_path: str,
    servers_path: str,
    figures_dir: Path,
    html_out: str,
    pdf_out: str,
    verdict_path: str | None = None,
    crossovers_path: str | None = None,
) -> None:
    try:
        from weasyprint import HTML  # imported late: it is slow to import and only this step needs it
    except (ImportError, OSError) as exc:  # OSError: WeasyPrint found no Pango
        raise ReportError(f"the PDF report needs WeasyPrint and its system libraries (Pango): {exc}") from exc

    data = ReportData(
        experiment,
        read_table(summary_path),
        read_table(comparisons_path),
        read_table(servers_path),
        verdict=read_table(verdict_path) if verdict_path else None,
        crossovers=read_table(crossovers_path) if crossovers_path else None,
    )
    prov = provenance(experiment)
    atomic.write_text(html_out, render_html(experiment, lang, data, figures_dir, "screen", prov))
    printable = render_html(experiment, lang, data, figures_dir, "print", prov)
    with atomic.atomic_path(pdf_out) as tmp:
        HTML(string=printable, base_url=str(REPORT_ROOT)).write_pdf(tmp)
