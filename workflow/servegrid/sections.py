"""The configuration's typed sections: frozen dataclasses made from the validated YAML.

:class:`servegrid.config.Experiment` builds them; every other module reads these,
never the configuration by string key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


def section(cls: type, data: Mapping[str, Any], **extra: Any) -> Any:
    """``cls`` from a validated mapping: lists become tuples, so sections stay immutable."""
    names = {f.name for f in fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
    return cls(**values, **extra)


Localized = str | Mapping[str, str]  # one text for every language, or one per language code


def localized(text: Localized, lang: str) -> str:
    """``text`` in ``lang``: a plain string is every language's (checks.py makes sure a mapping has each)."""
    return text if isinstance(text, str) else text[lang]


@dataclass(frozen=True)
class ExperimentInfo:
    title: Localized
    hardware: str = ""
    notes: str = ""


@dataclass(frozen=True)
class ModelSection:
    path: str
    served_name: str
    tiny: Mapping[str, Any] | None = None  # model.tiny as written; Experiment.tiny_model_spec() fills defaults


@dataclass(frozen=True)
class EngineSection:
    kind: str
    command: tuple[str, ...]
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    api_key_env: str | None = None


@dataclass(frozen=True)
class Configuration:
    """One server configuration to compare."""

    name: str
    label: Localized
    prefix_caching: bool
    speculative: Mapping[str, Any] | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    gpus: tuple[int, ...] = ()  # placement only
    cpus: tuple[int, ...] = ()  # placement only


@dataclass(frozen=True)
class Workload:
    """One enabled workload mode: where it sits in the grid and what its cells measure."""

    mode: str
    contexts: tuple[int, ...]
    concurrency: tuple[int, ...]
    settings: Mapping[str, Any]  # everything else: what shapes a cell's numbers (cell_settings' "workload")


@dataclass(frozen=True)
class Operations:
    """How to run, never what to measure: editing these reruns nothing."""

    host: str
    port_range: tuple[int, int]
    client_cpus: tuple[int, ...]
    startup_timeout_s: float
    request_timeout_s: float
    shutdown_timeout_s: float
    metrics_interval_s: float
    log_level: str
    stall_floor_s: float = 30.0


@dataclass(frozen=True)
class Validity:
    """When a cell's numbers cannot be trusted (docs/parquet-schema.md)."""

    max_send_delay_s: float
    max_loop_lag_s: float
    max_client_cpu: float
    min_hit_rate_fraction: float
    max_unexpected_hit_rate: float


@dataclass(frozen=True)
class ClassRule:
    """Which cell groups a workload class takes (all given conditions must hold)."""

    id: str
    mode: str | None = None
    kv_limited: bool | None = None
    min_context: int | None = None
    max_context: int | None = None
    min_concurrency: int | None = None
    max_concurrency: int | None = None

    def matches(self, group: Mapping[str, Any]) -> bool:
        checks = (
            self.mode is None or group["mode"] == self.mode,
            self.kv_limited is None or bool(group["kv_limited"]) == self.kv_limited,
            self.min_context is None or group["context"] >= self.min_context,
            self.max_context is None or group["context"] <= self.max_context,
            self.min_concurrency is None or group["concurrency"] >= self.min_concurrency,
            self.max_concurrency is None or group["concurrency"] <= self.max_concurrency,
        )
        return all(checks)


@dataclass(frozen=True)
class VerdictRules:
    """The verdict engine's thresholds and classes (docs/verdict.md)."""

    classes: tuple[ClassRule, ...]
    min_factor: float = 1.05
    range_style_ratio: float = 3.0

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> VerdictRules:
        return cls(
            classes=tuple(ClassRule(**c) for c in section["classes"]),
            min_factor=section["min_factor"],
            range_style_ratio=section["range_style_ratio"],
        )


# ---- service-level objectives (servegrid.slo computes with them) ------------------------------------

_KEY = re.compile(r"^(ttft|tpot|e2e)_p(\d+)_(ms|s)$")


@dataclass(frozen=True)
class Objective:
    key: str  # as written in the config: tpot_p90_ms
    metric: str  # ttft | tpot | e2e
    percentile: int
    limit_s: float  # in seconds, whatever the unit written

    @classmethod
    def parse(cls, key: str, limit: float) -> Objective:
        match = _KEY.match(key)
        if match is None:  # the schema lets no other key through
            raise ValueError(f"not an objective: {key}")
        metric, percentile, unit = match[1], int(match[2]), match[3]
        return cls(key, metric, percentile, float(limit) / (1000.0 if unit == "ms" else 1.0))


def objectives(written: Mapping[str, float] | None) -> tuple[Objective, ...]:
    return tuple(Objective.parse(k, v) for k, v in sorted((written or {}).items()))
