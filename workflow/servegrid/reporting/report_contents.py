"""Everything the report template shows, derived from the run's tables and the configuration.

The tables hold configuration names; labels, titles and settings come from the
:class:`~servegrid.config.Experiment` (declared as the report rule's params), so a
label edit reruns only the reports.

It runs over 300 lines: every table and sentence the template shows is shaped
here, so that the template holds layout and words, never logic.
"""

from __future__ import annotations

from datetime import datetime
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd
from babel import Locale

from servegrid import engines, modes, redact
from servegrid.config import Experiment, canonical_json
from servegrid.modes.base import FigureSpec, Mode
from servegrid.reporting.catalogues import Formatter
from servegrid.reporting.figure_files import (
    GATEWAY_FIGURE,
    GOODPUT_FIGURE,
    MAX_CONTEXT_PANELS,
    PANEL_KINDS,
    run_figures,
    shown_contexts,
)
from servegrid.reporting.gateway_section import GatewayView
from servegrid.stats import intervals

# Up to this many cells the PDF's details list every cell, as the HTML's always do. A larger grid's would run
# to hundreds of pages (287 at 2,028 cells, most of the PDF's time: docs/scale.md) that nobody reads on paper:
# the PDF then lists the cells that need a look, and says where the rest are.
PRINT_EVERY_CELL_UP_TO = 400


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
        production: pd.DataFrame | None = None,
        formatter: Formatter | None = None,
        gettext: Any = None,
    ) -> None:
        self.experiment = experiment
        self.lang = experiment.languages[0]  # which language's labels: set per rendering (report.render_html)
        self.formatter = formatter or Formatter(Locale.parse("en"))
        self.gettext = gettext or (lambda message: message)
        self.summary = summary
        self.comparisons = comparisons
        self.servers = servers
        self.verdict = verdict if verdict is not None else pd.DataFrame()
        self.crossovers = crossovers if crossovers is not None else pd.DataFrame()
        self.production = production if production is not None else pd.DataFrame()
        self.gateway: GatewayView | None = (
            None  # the section "through the gateway" (servegrid.reporting.gateway_section)
        )

    @staticmethod
    def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
        """Rows as dicts with NaN turned into None, so templates can test ``is none``."""
        if frame.empty:
            return []
        return [
            {k: (None if intervals.missing(v) else v) for k, v in _plain(row).items()}
            for row in frame.to_dict("records")
        ]

    def verdict_classes(self) -> list[dict[str, Any]]:
        """The verdict table: classes that have data, each with its winner's label; a KV-limit class also
        with the capacity it ran into (as the seed explains its third row)."""
        return [
            row
            | {"winner_label": self.labels(row["winner"])}
            | (self.kv_capacity() if row["outcome"] == "kv_limit" else {})
            for row in self.records(self.verdict)
            if row["outcome"] != "no_data"
        ]

    def kv_capacity(self) -> dict[str, Any]:
        """Over the KV-limited cells of the KV-limited cell groups (the verdict's KV corner): the smallest pool
        they had (the servers' own figure, in tokens) and the most tokens one of them could hold at once
        (sessions × its longest request, prompt and output: the live KV estimate)."""
        summary, groups = self.summary, self.comparisons
        if summary.empty or groups.empty or "kv_limited" not in summary:
            return {"kv_pool_tokens": None, "kv_asked_tokens": None}
        keys = ["mode", "context", "concurrency"]
        corner = groups.loc[groups["kv_limited"].astype(bool), keys]
        limited = summary[summary["kv_limited"].astype(bool)].merge(corner, on=keys)
        pool = pd.to_numeric(limited["kv_cache_tokens"], errors="coerce").min() if len(limited) else np.nan
        asked = pd.to_numeric(limited["peak_tokens_asked"], errors="coerce").max() if len(limited) else np.nan
        return {
            "kv_pool_tokens": None if intervals.missing(pool) else int(pool),
            "kv_asked_tokens": None if intervals.missing(asked) else int(asked),
        }

    def labels(self, names: str | None) -> str:
        """Comma-joined configurations (a shared lead) as their labels joined by ≈; one name: its label."""
        return " ≈ ".join(self.label(n) for n in (names or "").split(",") if n)

    def crossover_rows(self) -> list[dict[str, Any]]:
        """Per mode and pair: where the lead changes, with both labels."""
        return [
            row | {"leader_label": self.label(row["leader"]), "other_label": self.label(row["other"])}
            for row in self.records(self.crossovers)
        ]

    def production_sections(self) -> list[dict[str, Any]]:
        """Per mode with service-level objectives: the objectives as the reader reads them, and per context
        each configuration's highest sustained concurrency (the production table) with the winner's label."""
        sections = []
        table = self.production
        for name in self.experiment.modes():
            goals = self.experiment.slo.get(name)
            if not goals:
                continue
            mine = table[table["mode"] == name] if len(table) else table
            rows = []
            for context in sorted(mine["context"].unique()) if len(mine) else []:
                at = self.records(mine[mine["context"] == context])
                winners = [r["configuration"] for r in at if r["winner"]]
                rows.append(
                    {
                        "context": int(context),
                        "cells": {r["configuration"]: r for r in at},
                        "winners": winners,
                        # Goodputs within verdict.min_factor of each other: a tie, every one named.
                        "winner_label": " ≈ ".join(self.label(w) for w in winners) if winners else None,
                    }
                )
            sections.append(
                {
                    "mode": modes.get(name),
                    "objectives": self.objectives_text(goals),
                    "rows": rows,
                    "attainment": self.mode_rows(name),  # per cell: the share of requests within the objectives
                }
            )
        return sections

    def production_marks(self) -> dict[str, bool]:
        """Which footnotes the production tables need: a level met again after a failure, an invalid cell."""
        table = self.production
        if table.empty:
            return {"non_monotone": False, "invalid": False, "too_few": False}
        return {
            "non_monotone": bool(table["non_monotone"].astype(bool).any()),
            "invalid": bool((table["stopped_by"] == "invalid").any()),
            "too_few": bool((table["stopped_by"] == "too_few").any()),
        }

    def sampling_rows(self) -> list[dict[str, Any]]:
        """Per mode measured: how its cells were sampled (its rule, or its fixed count) and how they ended."""
        rows = []
        for mode in self.experiment.modes():
            cells = self.summary[self.summary["mode"] == mode] if len(self.summary) else self.summary
            if cells.empty:
                continue
            reasons = cells["sampling_reason"].value_counts() if "sampling_reason" in cells else pd.Series()
            samples = cells["primary_n"].astype(int)
            rows.append(
                {
                    "mode": modes.get(mode),
                    "rule": self.experiment.sampling_rules.get(mode),
                    "per_session": self.experiment.workload(mode).settings.get("requests_per_session"),
                    "cells": len(cells),
                    **{reason: int(reasons.get(reason, 0)) for reason in ("precise", "max_samples", "max_duration")},
                    "n_min": int(samples.min()),
                    "n_max": int(samples.max()),
                }
            )
        return rows

    def production_leaders(self) -> list[dict[str, Any]]:
        """Who wins the production table most often: per configuration, the mode × context rows it wins
        (ties count for each), most first; with how many rows there are."""
        table = self.production
        if table.empty:
            return []
        rows = table.groupby(["mode", "context"]).ngroups
        wins = table[table["winner"].astype(bool)].groupby("configuration").size()
        order = list(self.experiment.configurations)
        ranked = sorted(wins.items(), key=lambda item: (-item[1], order.index(item[0])))
        return [{"label": self.label(name), "wins": int(count), "rows": rows} for name, count in ranked]

    def objectives_text(self, goals: Any) -> str:
        """``TPOT p90 ≤ 50 ms; TTFT p99 ≤ 2 s`` in the locale's number format."""
        parts = []
        for goal in goals:
            in_ms = goal.key.endswith("_ms")
            limit = goal.limit_s * 1000 if in_ms else goal.limit_s
            number = self.format_value(round(limit, 6))
            parts.append(f"{goal.metric.upper() if goal.metric != 'e2e' else 'e2e'} p{goal.percentile} ≤ {number} "
                         f"{'ms' if in_ms else 's'}")  # fmt: skip
        return "; ".join(parts)

    def label(self, configuration: str | None) -> str:
        """A configuration's label in the report's language, from the config (a declared input of the
        report rule), not from the tables."""
        if configuration is None or configuration not in self.experiment.configurations:
            return configuration or ""
        return self.experiment.label(configuration, self.lang)

    def title(self) -> str:
        return self.experiment.title(self.lang)

    def ranking(self, names: str | None) -> str:
        """A comma-joined ranking of configurations as labels, best first."""
        return " › ".join(self.label(n) for n in (names or "").split(",") if n)

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
            mode, workload = modes.get(name), self.experiment.workload_view(name)
            params = {key: self.format_value(value) for key, value in mode.describe(workload).items()}
            sections.append(
                {"mode": mode, "params": params, "rows": self.mode_rows(name), "concurrency": workload["concurrency"]}
            )
        return sections

    def format_value(self, value: Any) -> str:
        """A setting as the description shows it: numbers in the locale's format, lists joined."""
        if isinstance(value, list | tuple):
            return ", ".join(self.format_value(v) for v in value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return str(value)
        return self.formatter.integer(value) if float(value).is_integer() else self.formatter.num(value, 2)

    def grid_figures(self) -> tuple[FigureSpec, ...]:
        """The run's figures shown across the grid: every run figure but goodput (the production section's)."""
        shown_elsewhere = (GOODPUT_FIGURE, GATEWAY_FIGURE)  # the production section's, the gateway section's
        return tuple(spec for spec in run_figures(self.experiment) if spec not in shown_elsewhere)

    def gateway_figure(self) -> FigureSpec:
        """The figure of the section "through the gateway" (report/templates/gateway.html.j2)."""
        return GATEWAY_FIGURE

    def panels_shown(self, mode: str, spec: FigureSpec) -> dict[str, str] | None:
        """For a figure of one panel per context that shows only some of them (figure_list.shown_contexts):
        which ones, and of how many (formatted), said after its caption; None when it shows every one."""
        measured = self.summary.loc[self.summary["mode"] == mode, "context"].unique()
        shown = shown_contexts(measured)
        if spec.kind not in PANEL_KINDS or len(shown) == len(measured):
            return None
        return {
            "shown": ", ".join(self.formatter.integer(c) for c in shown),
            "total": self.formatter.integer(len(measured)),
        }

    def goodput_panels_left_out(self) -> bool:
        """Whether the goodput figure (a panel per workload with objectives and context) leaves contexts out."""
        contexts = self.summary.groupby("mode")["context"].nunique() if len(self.summary) else pd.Series()
        return any(contexts.get(mode, 0) > MAX_CONTEXT_PANELS for mode in self.experiment.slo)

    @staticmethod
    def max_context_panels() -> int:
        return MAX_CONTEXT_PANELS

    def goodput_figure(self) -> FigureSpec | None:
        return GOODPUT_FIGURE if GOODPUT_FIGURE in run_figures(self.experiment) else None

    def shared_args(self) -> str:
        """engine.args as the report prints them: secrets masked."""
        return " ".join(redact.argv(self.experiment.engine.args))

    def engine_name(self) -> str:
        return engines.get(self.experiment.engine.kind).display_name

    @cached_property
    def _cell_records(self) -> list[dict[str, Any]]:
        return self.records(self.summary)

    def cells(self) -> list[dict[str, Any]]:
        return self._cell_records  # asked for by both media's renderings: made once

    # ---- the details: every cell, or in a large grid's PDF those that need a look -------------------------
    def details_abridged(self, medium: str) -> bool:
        return medium == "print" and len(self.summary) > PRINT_EVERY_CELL_UP_TO

    @staticmethod
    def needs_a_look(cell: dict[str, Any]) -> bool:
        """Invalid, imprecise (a ceiling reached first), at the KV limit, or too few samples for a median."""
        precise = cell.get("precise")  # None (or NaN from Parquet): a fixed count, no target to reach
        return (
            not bool(cell.get("valid"))
            or (not intervals.missing(precise) and not bool(precise))
            or bool(cell.get("kv_limited"))
            or intervals.missing(cell.get("primary_p50"))
        )

    def detail_cells(self, medium: str) -> list[dict[str, Any]]:
        cells = self.cells()
        return [c for c in cells if self.needs_a_look(c)] if self.details_abridged(medium) else cells

    def detail_rows(self, rows: list[dict[str, Any]], medium: str) -> list[dict[str, Any]]:
        """A mode's rows (:meth:`mode_rows`) as the details show them."""
        if not self.details_abridged(medium):
            return rows
        kept = ({**row, "cells": {k: c for k, c in row["cells"].items() if self.needs_a_look(c)}} for row in rows)
        return [row for row in kept if row["cells"]]

    def run_dates(self) -> tuple[datetime | None, datetime | None]:
        if self.summary.empty:
            return None, None
        starts = pd.to_datetime(self.summary["started_at"], utc=True, format="ISO8601")
        return starts.min().to_pydatetime(), starts.max().to_pydatetime()

    # Up to this many configurations, tables with a column per configuration head it with its label; beyond,
    # with its colour and number (and a key above the table), so that eight fit an A4 page in either language.
    LABELLED_COLUMNS = 4

    def compact_columns(self) -> bool:
        return len(self.experiment.configurations) > self.LABELLED_COLUMNS

    def conf_index(self, name: str) -> int:
        """A configuration's number in the report (config order, from 1), as compact columns show it."""
        return list(self.experiment.configurations).index(name) + 1

    def configurations(self) -> list[dict[str, Any]]:
        return self._configurations  # asked for in every row of every table: made once

    @cached_property
    def _configurations(self) -> list[dict[str, Any]]:
        out = []
        for index, (name, conf) in enumerate(self.experiment.configurations.items(), 1):
            sessions = self.servers[self.servers["configuration"] == name] if len(self.servers) else self.servers
            latest = _plain(sessions.iloc[-1].to_dict()) if len(sessions) else {}
            out.append(
                {
                    "name": name,
                    "index": index,
                    "label": self.label(name),
                    "prefix_caching": conf.prefix_caching,
                    "speculative": canonical_json(conf.speculative) if conf.speculative else None,
                    "flags": " ".join(redact.argv(self.experiment.configuration_flags(name))),
                    "server": latest,
                    "sessions": len(sessions),
                }
            )
        return out

    def mode_rows(self, mode: str) -> list[dict[str, Any]]:
        """Rows of (context, concurrency) with each configuration's cell and the comparison."""
        rows = []
        for (context, concurrency), by_conf in self._cells_by_group.get(mode, {}).items():
            comp = self._comparison_by_group.get((mode, context, concurrency))
            comp = comp | {"winner_label": self.label(comp["winner"])} if comp is not None else None
            rows.append({"context": context, "concurrency": concurrency, "cells": by_conf, "comparison": comp})
        return rows

    # The template asks for a mode's rows several times (its section, the details, the objectives) and in both
    # media: the tables are turned into rows once (a filter per row grew with the square of the grid).
    @cached_property
    def _cells_by_group(self) -> dict[str, dict[tuple[int, int], dict[str, dict[str, Any]]]]:
        """mode → (context, concurrency) in order → configuration → its summary row."""
        grouped: dict[str, dict[tuple[int, int], dict[str, dict[str, Any]]]] = {}
        if self.summary.empty:
            return grouped
        for row in self.summary.sort_values(["context", "concurrency"], kind="stable").to_dict("records"):
            key = (int(row["context"]), int(row["concurrency"]))
            grouped.setdefault(row["mode"], {}).setdefault(key, {})[row["configuration"]] = row
        return grouped

    @cached_property
    def _comparison_by_group(self) -> dict[tuple[str, int, int], dict[str, Any]]:
        """(mode, context, concurrency) → the group's comparison row."""
        found: dict[tuple[str, int, int], dict[str, Any]] = {}
        for row in self.comparisons.to_dict("records") if len(self.comparisons) else []:
            found.setdefault((row["mode"], int(row["context"]), int(row["concurrency"])), row)  # the first, as before
        return found

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
