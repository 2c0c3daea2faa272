"""Everything the report template shows, derived from the run's tables and the configuration: one module per
section of the report, composed into :class:`ReportContents`, so that the template holds layout and words and
never logic."""

from __future__ import annotations

from servegrid.reporting.contents.details import DetailsContents
from servegrid.reporting.contents.method import MethodContents
from servegrid.reporting.contents.modes import ModeContents
from servegrid.reporting.contents.production import ProductionContents
from servegrid.reporting.contents.setup import SetupContents
from servegrid.reporting.contents.verdict import VerdictContents

__all__ = ["ReportContents"]


class ReportContents(VerdictContents, ProductionContents, SetupContents, ModeContents, MethodContents, DetailsContents):
    """What the template reads as ``data``: every section's contents over one set of tables."""
