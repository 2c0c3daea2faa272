"""A cell's facts, typed: what a cell file's footer holds, however old the file (:mod:`servegrid.records.cell_format`
upgrades it first), read through attributes everywhere downstream.

The footer's keys are data (GPU hours live in those files): :meth:`CellRecord.facts` writes them as they always were
and :meth:`CellRecord.from_facts` reads them back, in this module alone. A key this servegrid does not know (a
footer of a format it reads but whose extras it has no field for) is kept in ``extra`` and written back as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from typing import Any

from servegrid.records import cell_format
from servegrid.records.cell_settings import CellSettings
from servegrid.records.cell_spec import CellSpec


@dataclass(frozen=True)
class CellRecord:
    """One cell as measured (or refused): its spec and settings (its identity), its server, what its measured phase
    found. A cell measured by several routes is one record per route (:meth:`by_route`)."""

    spec: CellSpec
    # The cell rule's params as the cell was measured with them (servegrid.config.Experiment.cell_settings).
    settings: dict[str, Any]
    spec_hash: str | None
    # The server session's facts (servegrid.serving.state.ServerFacts' fields; as far as it got, when refused).
    server: dict[str, Any]
    started_at: str
    ended_at: str
    format_version: int = cell_format.FORMAT_VERSION
    slurm_job: str | None = None
    gateway: dict[str, Any] | None = None  # the gateway the cell went through and what its check found
    refused: str | None = None  # the engine's reason, when it died at its first request (no request measured)
    route: str = "direct"
    duration_s: float | None = None  # the measured phase's, every stage and repeat
    server_metrics: dict[str, Any] | None = None  # {delta, derived, gauges} over the measured phase
    client: dict[str, Any] | None = None  # the client's own load (event-loop lag, CPU, cores)
    sampling: dict[str, Any] | None = None  # why the cell stopped sampling, its rule and stages
    cache_state: str | None = None  # reset | fresh content
    open_loop: list[dict[str, Any]] | None = None  # an open-loop cell's runs, one per repeat
    repeats: list[dict[str, Any]] = field(default_factory=list)
    other_routes: dict[str, dict[str, Any]] = field(default_factory=dict)  # the other routes' phase facts
    # What the server's GPUs did during the stages (servegrid.measuring.gpu_watch); None: a file from before.
    gpus: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys of the footer this servegrid has no field for
    # In memory only, never in a footer: the top-ups pooled into this record (servegrid.analysis.pooled_cells), each
    # its round and its job's wall time.
    top_ups: tuple[dict[str, Any], ...] = ()

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def cell_settings(self) -> CellSettings:
        """The settings, typed for reading."""
        return CellSettings(self.settings)

    @property
    def lacks(self) -> list[str]:
        """What today's tables report that this cell's (older) format does not hold (cell_format.lacks)."""
        return cell_format.lacks(self.facts() | {"format_version": self.format_version})

    @property
    def wall_s(self) -> float | None:
        """The cell job's wall time (its server's start included, if it started it), and its top-ups' jobs'."""
        try:
            own = (datetime.fromisoformat(self.ended_at) - datetime.fromisoformat(self.started_at)).total_seconds()
        except (TypeError, ValueError):
            return None
        return own + sum(float(t["wall_s"] or 0.0) for t in self.top_ups)

    def by_route(self) -> list[CellRecord]:
        """This record, and one per other route the cell was measured by (its rows are told apart by the route
        column): each with that route's phase facts."""
        others = [
            replace(self, **(_phase_fields(measured) | {"route": route, "other_routes": {}}))
            for route, measured in self.other_routes.items()
        ]
        return [self, *others]

    def facts(self) -> dict[str, Any]:
        """The footer as servegrid has always written it (format_version aside: cell_format.encode adds it)."""
        out: dict[str, Any] = {
            "cell": self.spec.entry() | {"id": self.spec.id},
            "settings": self.settings,
            "spec_hash": self.spec_hash,
            "server": self.server,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "slurm_job": self.slurm_job,
            "gateway": self.gateway,
        }
        if self.refused is not None:
            out["refused"] = self.refused
        else:
            out |= {
                "route": self.route,
                "duration_s": self.duration_s,
                "server_metrics": self.server_metrics,
                "client": self.client,
                "sampling": self.sampling,
                "cache_state": self.cache_state,
                "open_loop": self.open_loop,
                "repeats": self.repeats,
                "other_routes": self.other_routes,
            }
            if self.gpus is not None:  # a file from before the GPU watch keeps its footer as it was written
                out["gpus"] = self.gpus
        return out | self.extra

    @classmethod
    def measured(
        cls, spec: CellSpec, settings: dict[str, Any], server: Mapping[str, Any], phase: Mapping[str, Any], **facts: Any
    ) -> CellRecord:
        """A measured cell: ``phase`` is what the measured phase returned (servegrid.measuring.measured_phase)."""
        return cls(spec, settings, server.get("spec_hash"), dict(server), **facts, **_phase_fields(phase))

    @classmethod
    def from_facts(cls, facts: Mapping[str, Any]) -> CellRecord:
        """A record from a footer already upgraded to today's keys (cell_format.upgrade)."""
        known = {f.name for f in fields(cls)} - {"spec", "extra", "top_ups"}
        settings = facts.get("settings")
        arrival = CellSettings(settings).arrival if isinstance(settings, Mapping) else None
        pattern = str((arrival or {}).get("pattern", ""))
        values = {k: v for k, v in facts.items() if k in known}
        extra = {k: v for k, v in facts.items() if k not in known and k != "cell"}
        values["other_routes"] = values.get("other_routes") or {}
        values["repeats"] = values.get("repeats") or []
        values.setdefault("route", "direct")
        return cls(spec=CellSpec.from_entry(facts["cell"], pattern), extra=extra, **values)


_PHASE_KEYS = (
    "duration_s",
    "server_metrics",
    "client",
    "sampling",
    "cache_state",
    "open_loop",
    "repeats",
    "route",
    "gpus",
)


def _phase_fields(phase: Mapping[str, Any]) -> dict[str, Any]:
    """A measured phase's facts as record fields (other_routes included where the phase has them)."""
    out = {k: phase[k] for k in _PHASE_KEYS if k in phase}
    if "other_routes" in phase:
        out["other_routes"] = dict(phase["other_routes"] or {})
    return out
