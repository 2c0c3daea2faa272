"""What every section of the report reads: the run's tables, the configurations as the report names them, the
grid's rows per mode, and the locale's formats. Each section's own contents are a module beside this one.

The tables hold configuration names; labels, titles and settings come from the
:class:`~servegrid.config.Experiment` (declared as the report rule's params), so a
label edit reruns only the reports.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd
from babel import Locale

from servegrid import modes, redact
from servegrid.analysis.aggregation import refused_configurations
from servegrid.config import Experiment, canonical_json
from servegrid.modes.base import Mode
from servegrid.reporting.catalogues import Formatter
from servegrid.reporting.contents.gateway import GatewayView
from servegrid.reporting.contents.open_loop import OpenLoopView
from servegrid.stats import intervals


class Contents:
    """The tables and the configurations every section shows (see the module docstring)."""

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
            None  # the section "through the gateway" (servegrid.reporting.contents.gateway)
        )
        self.open_loop: OpenLoopView | None = None  # the section "open loop" (servegrid.reporting.contents.open_loop)
        # Every cell, open loop included: what the provenance table counts (the sections above compare sessions).
        self.every_cell: pd.DataFrame = summary

    @staticmethod
    def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
        """Rows as dicts with NaN turned into None, so templates can test ``is none``."""
        if frame.empty:
            return []
        return [
            {k: (None if intervals.missing(v) else v) for k, v in _plain(row).items()}
            for row in frame.to_dict("records")
        ]

    def labels(self, names: str | None) -> str:
        """Comma-joined configurations (a shared lead) as their labels joined by ≈; one name: its label."""
        return " ≈ ".join(self.label(n) for n in (names or "").split(",") if n)

    def goodput_share(self) -> float:
        """The share of the offered rate an open-loop cell must answer within the objectives (verdict.goodput_share)."""
        return self.experiment.verdict.goodput_share

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

    @staticmethod
    def mode(name: str) -> Mode:
        return modes.get(name)

    def class_mode(self, class_id: str) -> Mode | None:
        """The mode a verdict class is named after, if it is."""
        return modes.get(class_id) if class_id in modes.names() else None

    def format_value(self, value: Any) -> str:
        """A setting as the description shows it: numbers in the locale's format, lists joined."""
        if isinstance(value, list | tuple):
            return ", ".join(self.format_value(v) for v in value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return str(value)
        return self.formatter.integer(value) if float(value).is_integer() else self.formatter.num(value, 2)

    @cached_property
    def _cell_records(self) -> list[dict[str, Any]]:
        return self.records(self.summary)

    def cells(self) -> list[dict[str, Any]]:
        return self._cell_records  # asked for by both media's renderings: made once

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
    def _refused(self) -> dict[str, str]:
        return refused_configurations(self.servers)

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
                    "refused": self._refused.get(name),  # its engine died at its first request
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


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """Parquet list columns arrive as numpy arrays, templates want lists; a missing number arrives as NaN, which a
    template would take for a value (a refused server has no KV pool): None."""
    return {
        k: v.tolist() if isinstance(v, np.ndarray) else None if isinstance(v, float) and np.isnan(v) else v
        for k, v in row.items()
    }
