"""The configuration's typed sections: frozen dataclasses made from the validated YAML.

:class:`servegrid.config.Experiment` builds them; every other module reads these,
never the configuration by string key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from servegrid.errors import ConfigError
from servegrid.stats.sampling import SamplingRule


def section(cls: type, data: Mapping[str, Any], **extra: Any) -> Any:
    """``cls`` from a validated mapping: lists become tuples, so sections stay immutable."""
    names = {f.name for f in fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
    return cls(**values, **extra)


@dataclass(frozen=True)
class Cost:
    """The ``cost:`` section: an hour of one device, and optionally a kilowatt-hour, in ``currency``."""

    device_per_hour: float
    currency: str = "USD"
    energy_per_kwh: float | None = None
    rank_by: str = "capacity"  # what makes a production winner: capacity, or cost (servegrid.analysis.cost.rerank)


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
    rates: tuple[float, ...] = ()  # open-loop offered rates, requests/s (servegrid.config.grid)
    open_loop: Mapping[str, Any] = field(default_factory=dict)  # arrival and open_loop: open-loop cells' settings
    # A trace mode's speedups, and its windows: per window's label, the settings of its cells (what they replay, and
    # its rate at 1x: a cell's offered rate is that times its speedup).
    speedups: tuple[float, ...] = ()
    windows: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def cell_settings(self, window: str) -> Mapping[str, Any]:
        """The workload settings of this mode's cells at ``window`` (a trace's; every other mode's: its settings)."""
        return self.windows[window] if self.windows else self.settings

    def variants(self) -> list[Mapping[str, Any]]:
        """Every distinct workload settings its cells have: one per window of a trace, else the mode's."""
        return list(self.windows.values()) or [self.settings]

    def offered_rate(self, speedup: float, window: str) -> float:
        """A trace cell's offered rate (requests/s); 0.0 where the mode has no such speedup or window."""
        if speedup not in self.speedups or window not in self.windows:
            return 0.0
        return float(self.windows[window]["trace"]["rate"]) * speedup


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
    preflight: bool = True


@dataclass(frozen=True)
class ProxySection:
    """The gateway in front of the servers (servegrid.serving.gateway): a LiteLLM proxy servegrid starts, or an
    existing one at ``url``."""

    kind: str = "litellm"
    version: str | None = None
    command: tuple[str, ...] = (".venv-litellm/bin/litellm",)
    args: tuple[str, ...] = ()
    model_params: Mapping[str, Any] | None = None
    master_key_env: str = "SERVEGRID_PROXY_KEY"
    port: int = 4000
    url: str | None = None
    models: Mapping[str, str] | None = None
    startup_timeout_s: float = 120.0
    cpus: tuple[int, ...] = ()  # placement only


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
    goodput_share: float = 0.9  # open loop: the goodput, as a share of the offered rate, that sustains it

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> VerdictRules:
        return cls(
            classes=tuple(ClassRule(**c) for c in section["classes"]),
            min_factor=section["min_factor"],
            range_style_ratio=section["range_style_ratio"],
            goodput_share=section["goodput_share"],
        )


# ---- service-level objectives (servegrid.analysis.slo computes with them) ------------------------------------

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


# The sequential-sampling keys, in the top-level sampling section and in a mode's own (servegrid.stats.sampling).
RULE_KEYS = ("target_rel_ci", "min_samples", "max_samples", "max_duration_s")


def rule_fields(rule: SamplingRule | None) -> dict[str, Any] | None:
    # Its fields are numbers: asdict's deep copy (75% of cell_settings' time, which the grid line and Snakemake's DAG
    # pay for every cell: docs/scale.md) copies nothing more.
    return None if rule is None else {f.name: getattr(rule, f.name) for f in fields(rule)}


def sampling_rules(written: Mapping[str, Any], filled: Mapping[str, Any], enabled: list[str]) -> dict[str, Any]:
    """Each enabled mode's sequential-sampling rule (None: a fixed count), its own keys over the top-level ones.
    Under ``sampling.policy: verdict`` a cell's own run is the first pass: it stops at ``min_samples`` (its rule's
    ``max_samples``), and top-ups add repeats where the verdict needs them (servegrid.analysis.top_ups).

    ``written`` is the config as given (before defaults), so that a fixed count or time limit the user wrote
    next to sequential sampling is refused rather than silently ignored.
    """
    top = {key: filled["sampling"][key] for key in RULE_KEYS}
    # The top-level keys first, named as such (a mode's rule may take any of them), whether or not a target is set.
    SamplingRule(**{**top, "target_rel_ci": 0.05 if top["target_rel_ci"] is None else top["target_rel_ci"]})
    rules: dict[str, SamplingRule | None] = {}
    for mode in enabled:
        settings = filled["workloads"][mode]
        own = settings.get("sampling") or {}
        merged = top | {key: own[key] for key in RULE_KEYS if key in own}
        prefix = f"workloads.{mode}." if own else ""  # the top-level keys are sound: the mode's own are not
        if merged["target_rel_ci"] is None:
            rules[mode] = None
            continue
        try:
            rule = SamplingRule(**merged)
            rules[mode] = (
                replace(rule, max_samples=rule.min_samples) if filled["sampling"]["policy"] == "verdict" else rule
            )
        except ConfigError as exc:
            raise ConfigError(f"{prefix}{exc}") from None
        as_written = (written.get("workloads") or {}).get(mode) or {}
        for key, instead in (("requests_per_session", "min_samples/max_samples"), ("duration_s", "max_duration_s")):
            if as_written.get(key) is not None:
                raise ConfigError(
                    f"workloads.{mode}.{key}: a fixed count or time limit, but this mode samples sequentially "
                    f"(sampling.target_rel_ci is set): remove it, or set sampling.{instead}"
                )
        if settings["repeats"] > 1:
            raise ConfigError(
                f"workloads.{mode}.repeats: {settings['repeats']} repeats with sequential sampling "
                "(sampling.target_rel_ci is set); a cell samples until precise in one run: use repeats: 1"
            )
    return rules
