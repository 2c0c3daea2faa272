"""The report's section "through the gateway": the topology, the gateway's version and config (secrets
masked), what it adds per mode and concurrency, what it changes in the stream, and whether it changes a verdict.

Built from gateway.parquet and gateway_verdict.parquet (servegrid.analysis.gateway_cost); shown when the run went
through a gateway (route: proxy or both).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import yaml

from servegrid import modes
from servegrid.config import Experiment
from servegrid.stats import intervals


@dataclass
class GatewayView:
    """What the template's gateway section shows (None fields: not known for this run)."""

    route: str
    started_by_servegrid: bool
    url: str | None
    version: str | None
    master_key_env: str | None
    model_list_yaml: str | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    per_chunk_usage: bool | None = None
    reframed: bool | None = None  # the gateway merged or split chunks of the same greedy output
    same_text: bool | None = None

    @property
    def measured_both_ways(self) -> bool:
        return bool(self.rows)

    @property
    def verdict_changed(self) -> bool:
        return any(v["changed"] for v in self.verdicts)


def _value(row: dict[str, Any], name: str) -> float | None:
    value = row.get(name)
    return None if value is None or intervals.missing(value) else float(value)


def gateway_view(
    experiment: Experiment, added: pd.DataFrame | None, changes: pd.DataFrame | None
) -> GatewayView | None:
    """The section's data, or None when the run did not go through a gateway."""
    proxy = experiment.proxy
    if experiment.route == "direct" or proxy is None:
        return None
    records = added.to_dict("records") if added is not None and len(added) else []
    first = records[0] if records else {}
    # Each proxy start served the configurations whose servers were up then: the union, by model name.
    entries = {e["model_name"]: e for r in records for e in json.loads(r.get("gateway_model_list") or "null") or []}
    model_list = [entries[name] for name in experiment.configurations if name in entries] or None
    out = GatewayView(
        route=experiment.route,
        started_by_servegrid=proxy.url is None,
        url=proxy.url or first.get("gateway_url"),
        version=first.get("gateway_version") or proxy.version,
        master_key_env=proxy.master_key_env,
        model_list_yaml=yaml.safe_dump({"model_list": model_list}, sort_keys=False) if model_list else None,
    )
    order = {name: i for i, name in enumerate(experiment.configurations)}
    mode_order = {name: i for i, name in enumerate(experiment.modes())}
    records.sort(
        key=lambda r: (mode_order.get(r["mode"], 99), r["context"], r["concurrency"], order.get(r["configuration"], 99))
    )
    for row in records:
        out.rows.append(
            {
                "configuration": row["configuration"],
                "mode_title": modes.get(row["mode"]).short_title,
                "context": int(row["context"]),
                "concurrency": int(row["concurrency"]),
                **{
                    f"{figure}_{part}": _value(row, f"{figure}_added_p{q}_{suffix}s")
                    for figure in ("ttft", "tpot", "e2e")
                    for q, part, suffix in (
                        (50, "p50", ""),
                        (50, "low", "ci_low_"),
                        (50, "high", "ci_high_"),
                        (99, "p99", ""),
                    )
                },
            }
        )
    if records:
        out.per_chunk_usage = all(bool(r.get("per_chunk_usage")) for r in records)
        out.reframed = any(r.get("chunks_direct") != r.get("chunks_proxy") for r in records)
        out.same_text = all(bool(r.get("same_text")) for r in records)
    for change in changes.to_dict("records") if changes is not None and len(changes) else []:
        out.verdicts.append(change)
    return out
