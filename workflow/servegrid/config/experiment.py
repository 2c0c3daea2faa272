"""The experiment: validated configuration, typed sections, the grid of cells, launch specs.

The YAML is validated against ``workflow/schemas/config.schema.yaml`` (each
workload mode's settings come from its module, :mod:`servegrid.modes`), then
turned into frozen dataclasses: no code reads the configuration by string key.

Everything a cell's result depends on is derived here, and nothing else:
:meth:`Experiment.launch_spec` (what the server is) and
:meth:`Experiment.cell_settings` (what the cell measures). Snakemake compares
both between runs to decide what reruns, so operational settings (ports,
timeouts, GPU placement) deliberately appear in neither. What figures and
reports show of the configuration is :meth:`Experiment.presentation`
(:mod:`servegrid.config.presentation`), a declared input of those rules alone.

Every identity that decides a rerun (launch specs, cell settings, the
gateway's) is computed in this one place.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from servegrid import engines, modes, redact
from servegrid.config.checks import check
from servegrid.config.grid import OPEN_LOOP_KEYS
from servegrid.config.presentation import Presentation
from servegrid.config.schema import read_yaml, validate
from servegrid.config.sections import (
    ClassRule,
    Configuration,
    Cost,
    EngineSection,
    ExperimentInfo,
    ModelSection,
    Objective,
    Operations,
    ProxySection,
    Validity,
    VerdictRules,
    Workload,
    objectives,
    rule_fields,
    sampling_rules,
    section,
)
from servegrid.config.tiny_model_spec import TinyModelSpec
from servegrid.errors import ConfigError
from servegrid.records.cell_spec import CellSpec, Load, Rate, Replay, Sessions, parse_load
from servegrid.stats.sampling import SamplingRule

__all__ = ["CellSpec", "ClassRule", "Configuration", "Experiment", "Operations", "Validity", "VerdictRules", "Workload"]


# Bump when the way a cell is measured changes: every cell reruns.
MEASUREMENT_VERSION = 5  # 5: the measured phase in stages (sequential sampling); 4: /metrics parsed afterwards

# Keys of a workload section that place it in the grid rather than shape what a cell measures.
GRID_KEYS = ("enabled", "contexts", "concurrency", "rates", "speedups", "windows")


class Experiment(Presentation):
    """A validated configuration: typed sections and the derived grid."""

    def __init__(self, raw: Mapping[str, Any], source: str = "config") -> None:
        self.source = source
        # The validated dict with defaults filled in: hashed for provenance, never read by key.
        self.raw = validate(raw, source)
        r = self.raw
        self.info: ExperimentInfo = section(ExperimentInfo, r["experiment"])
        self.model: ModelSection = section(ModelSection, r["model"])
        self.engine: EngineSection = section(EngineSection, r["engine"])
        self.configurations: dict[str, Configuration] = {
            name: section(Configuration, conf, name=name) for name, conf in r["configurations"].items()
        }
        self.temperature: float = r["sampling"]["temperature"]
        enabled = [m for m in modes.names() if (w := r["workloads"].get(m)) is not None and w["enabled"]]
        try:
            self.sampling_rules: dict[str, SamplingRule | None] = sampling_rules(raw, r, enabled)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        self.workloads: dict[str, Workload] = {
            mode: Workload(
                mode=mode,
                contexts=tuple(written["contexts"]),
                concurrency=tuple(written["concurrency"]),
                rates=tuple(float(r) for r in written["rates"]),
                open_loop={k: written[k] for k in OPEN_LOOP_KEYS},
                # A mode's sampling keys are resolved into sampling_rules; a sequential cell has no fixed
                # count or time limit, so those defaults are not part of what it measures.
                settings=(settings := self._mode_settings(mode, written)),
                speedups=tuple(float(x) for x in written.get("speedups", [])),
                windows=self._windows(mode, written, settings),
            )
            for mode in enabled
            if (written := r["workloads"][mode]) is not None
        }
        self.operations: Operations = section(Operations, r["operations"])
        self.validity: Validity = section(Validity, r["validity"])
        # How cells reach the servers, and the gateway in front of them when they go through one.
        self.route: str = r["route"]
        self.proxy: ProxySection | None = section(ProxySection, r["proxy"]) if r["proxy"] is not None else None
        self.verdict = VerdictRules.from_config(r["verdict"])
        # What servegrid estimate assumes where no earlier run says (pairs, low first); it shapes no measurement.
        self.estimate: dict[str, tuple[float, float]] = {
            k: (float(v[0]), float(v[1])) for k, v in r["estimate"].items()
        }
        for key, (low, high) in self.estimate.items():
            if low > high:
                raise ConfigError(f"estimate.{key}: [{low:g}, {high:g}] is not [low, high] (speeds: [slow, fast])")
        # Prices for the production table's cost per million tokens (servegrid.analysis.cost); None: not priced.
        self.cost: Cost | None = section(Cost, r["cost"]) if r.get("cost") is not None else None
        # Sampling that serves the verdict (docs/sampling.md): None under the precision policy, else the most rounds
        # of top-ups a cell group gets.
        self.top_up_rounds: int | None = (
            int(r["sampling"]["top_up_rounds"]) if r["sampling"]["policy"] == "verdict" else None
        )
        # Under it, a cell's own ceiling as its rule is written (max_samples, max_duration_s, per sequential mode): its
        # top-ups stop there, so that the verdict policy never samples a cell past what the precision policy would.
        self.top_up_ceilings: dict[str, tuple[int, float]] = {}
        if self.top_up_rounds is not None:
            as_written = sampling_rules(raw, r | {"sampling": r["sampling"] | {"policy": "precision"}}, enabled)
            self.top_up_ceilings = {
                mode: (rule.max_samples, rule.max_duration_s) for mode, rule in as_written.items() if rule is not None
            }
        self.languages: list[str] = list(r["report"]["languages"])
        self.report_formats: list[str] = list(r["report"]["formats"])
        self.report_baseline: str | None = r["report"]["baseline"]
        # Service-level objectives per enabled mode (servegrid.analysis.slo); a mode without any has no production row.
        # A disabled mode keeps its objectives for when it is enabled again (the schema names only real modes).
        self.slo: dict[str, tuple[Objective, ...]] = {
            m: objectives(o) for m, o in r["slo"].items() if m in self.workloads
        }
        check(self)

    def _mode_settings(self, mode: str, written: Mapping[str, Any]) -> dict[str, Any]:
        """What shapes a mode's cells besides their load, with what the mode derives from it (a trace's hash)."""
        settings = {
            k: v
            for k, v in written.items()
            if k not in (*GRID_KEYS, *OPEN_LOOP_KEYS, "sampling")
            # A sequential cell has no fixed count or time limit, so those defaults are not part of what it measures.
            and not (self.sampling_rules[mode] and k in ("requests_per_session", "duration_s"))
        }
        resolve = modes.get(mode).resolve
        try:
            return settings | dict(resolve(settings)) if resolve else settings
        except ConfigError as exc:
            raise ConfigError(f"{self.source}: workloads.{mode}: {exc}") from None

    def _windows(
        self, mode: str, written: Mapping[str, Any], settings: Mapping[str, Any]
    ) -> dict[str, Mapping[str, Any]]:
        """A trace mode's windows: per label, its cells' settings (servegrid.modes.base.Mode.windows); {} for other
        modes. The drain after a window is as many arrivals as the client may hold in flight."""
        hook = modes.get(mode).windows
        if hook is None or not written.get("speedups"):
            return {}
        drain = int(written["open_loop"]["max_in_flight"])
        try:
            windows: dict[str, Mapping[str, Any]] = {
                label: dict(w) for label, w in hook({**settings, "windows": written["windows"]}, drain).items()
            }
        except ConfigError as exc:
            raise ConfigError(f"{self.source}: workloads.{mode}: {exc}") from None
        for label, cell_workload in windows.items():
            if not cell_workload["trace"]["rate"] > 0:
                raise ConfigError(
                    f"{self.source}: workloads.{mode}.windows: the window {label or 'of the whole trace'} has no "
                    "rate: its arrivals come at one instant (give the window a duration_s)"
                )
        return windows

    @classmethod
    def from_file(cls, path: str | Path) -> Experiment:
        raw = read_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        return cls(raw, source=str(path))

    # ---- the grid ------------------------------------------------------------------------------
    def modes(self) -> list[str]:
        """Enabled workload modes, in the registry's order."""
        return list(self.workloads)

    def workload(self, mode: str) -> Workload:
        if mode not in self.workloads:
            modes.get(mode)  # an unknown mode says so; a known one is merely not enabled
            raise ConfigError(f"{self.source}: workloads.{mode}: not enabled in this configuration")
        return self.workloads[mode]

    def cells(self, configuration: str | None = None) -> list[CellSpec]:
        names = [configuration] if configuration else list(self.configurations)
        # Closed-loop cells first, then open-loop ones: each in the order the config lists its loads.
        # A trace's cells window by window, each at every speedup.
        loads = {m: self._loads(w) for m, w in self.workloads.items()}
        return [
            CellSpec(name, w.mode, context, load)
            for name in names
            for w in self.workloads.values()
            for context in w.contexts
            for load in loads[w.mode]
        ]

    @staticmethod
    def _loads(workload: Workload) -> list[Load]:
        pattern = str(workload.open_loop.get("arrival", {}).get("pattern", "")) if workload.rates else ""
        return [
            *(Sessions(c) for c in workload.concurrency),
            *(Rate(r, pattern) for r in workload.rates),
            *(
                Replay(x, window, workload.offered_rate(x, window))
                for window in workload.windows
                for x in workload.speedups
            ),
        ]

    def cell(self, configuration: str, mode: str, context: int, load: int | str) -> CellSpec:
        """The grid's cell at ``load``: sessions (an int, or ``"c4"``), an offered rate (``"r0.5"``) or a trace's
        speedup in one of its windows (``"x2"``, ``"x2_w600+300"``)."""
        name = f"{configuration}/{mode}/ctx{context}_{load}"
        try:
            parsed = parse_load(load)
        except ValueError as exc:
            raise ConfigError(f"{self.source}: cell {name}: {exc}") from None
        workload = self.workloads.get(mode)
        # Checked in place, not against self.cells(): Snakemake asks once per cell job, and rebuilding the
        # grid each time made the DAG grow with the square of the grid (docs/scale.md).
        wanted: Load | None = None
        if workload is not None and configuration in self.configurations and int(context) in workload.contexts:
            wanted = next((known for known in self._loads(workload) if known.label == parsed.label), None)
        if wanted is None:
            raise ConfigError(f"{self.source}: cell {name} is not in the grid")
        return CellSpec(configuration, mode, int(context), wanted)

    def configuration(self, name: str) -> Configuration:
        if name not in self.configurations:
            raise ConfigError(
                f"{self.source}: no configuration named '{name}' (have: {', '.join(self.configurations)})"
            )
        return self.configurations[name]

    def configuration_index(self, name: str) -> int:
        return list(self.configurations).index(name)

    def tiny_model_spec(self) -> dict[str, Any] | None:
        """model.tiny with every default spelled out, or None."""
        tiny = self.model.tiny
        if tiny is None:
            return None
        spec = TinyModelSpec(**tiny)
        spec.check()
        return asdict(spec)

    # ---- identities that decide reruns -----------------------------------------------------------
    def configuration_flags(self, name: str) -> list[str]:
        conf = self.configuration(name)
        return engines.get(self.engine.kind).feature_flags(conf.prefix_caching, conf.speculative) + list(conf.args)

    def launch_spec(self, name: str) -> dict[str, Any]:
        """What the server of configuration ``name`` is; placement and ports excluded."""
        conf = self.configuration(name)
        return {
            "configuration": name,
            "engine": self.engine.kind,
            "command": list(self.engine.command),
            "model": self.model.path,
            "served_name": self.model.served_name,
            "tiny_model": self.tiny_model_spec(),
            "args": list(self.engine.args) + self.configuration_flags(name),
            "env": {**(self.engine.env or {}), **(conf.env or {})},
            "api_key_env": self.engine.api_key_env,
            "prefix_caching": conf.prefix_caching,
            "speculative": dict(conf.speculative) if conf.speculative else None,
        }

    def public_launch_spec(self, name: str) -> dict[str, Any]:
        """:meth:`launch_spec` with every secret masked: what spec.json, Snakemake's params and the reports hold.
        A changed secret changes no measurement, so it reruns nothing; the server gets the real values."""
        spec = self.launch_spec(name)
        return {**spec, "args": redact.argv(spec["args"]), "env": redact.env(spec["env"])}

    def routes(self) -> list[str]:
        """The routes every cell is measured by, the verdict's first: ``direct``, ``proxy`` or both."""
        return {"direct": ["direct"], "proxy": ["proxy"], "both": ["direct", "proxy"]}[self.route]

    def gateway_identity(self) -> dict[str, Any] | None:
        """What the gateway is, as far as it shapes a proxied cell's numbers (placement and the key excluded):
        part of every proxied cell's settings, so a new LiteLLM version or model_params reruns those cells."""
        if self.route == "direct" or self.proxy is None:
            return None
        p = self.proxy
        if p.url is not None:
            return {"url": p.url, "models": dict(p.models or {})}
        return {
            "kind": p.kind,
            "version": p.version,
            "command": list(p.command),
            "args": redact.argv(p.args),
            "model_params": dict(p.model_params or {}),
        }

    def cell_settings(self, cell: CellSpec) -> dict[str, Any]:
        """Everything that cell's numbers depend on besides the server itself."""
        # Direct-only cells keep the settings they had before routes existed: adding the gateway reruns nothing
        # until a route uses it.
        routes = {} if self.route == "direct" else {"route": self.route, "gateway": self.gateway_identity()}
        workload = self.workload(cell.mode)
        # An open-loop cell has no sessions: its rate and how requests arrive (only its settings carry them, so a
        # closed-loop cell's settings are what they were before rates existed).
        load: dict[str, Any] = {"concurrency": cell.sessions}
        if isinstance(
            cell.load, Replay
        ):  # a replayed trace: its own arrivals (what the window replays is in its workload)
            window = workload.open_loop["open_loop"]
            load = {
                "concurrency": None,
                "rate": cell.load.per_s,
                "speedup": cell.load.speedup,
                "arrival": {"pattern": "trace"},
                # requests: the window's arrivals (what servegrid estimate and the Slurm time limit price)
                "open_loop": {
                    "ramp_s": window["ramp_s"],
                    "max_in_flight": window["max_in_flight"],
                    "requests": int(self.cell_workload(cell)["trace"]["arrivals"]),
                },
            }
        elif isinstance(cell.load, Rate):
            load = {
                "concurrency": None,
                "rate": cell.load.per_s,
                **{k: dict(workload.open_loop[k]) for k in OPEN_LOOP_KEYS},
            }
        return routes | {
            "measurement_version": MEASUREMENT_VERSION,
            "cell": cell.id,
            "mode": cell.mode,
            "context": cell.context,
            **load,
            "workload": dict(self.cell_workload(cell)),
            # An open-loop cell measures a fixed count (open_loop.requests): the sequential rule's interval assumes
            # independent samples, and queueing makes neighbouring requests alike.
            "sampling": {
                "temperature": self.temperature,
                "rule": None if cell.open_loop else rule_fields(self.sampling_rules[cell.mode]),
            },
        }

    def top_up_settings(self, cell: CellSpec, round_: int) -> dict[str, Any]:
        """A top-up's settings: its cell's, plus its round and the number of its first repeat. A top-up runs the
        cell's measured phase again (its ``repeats``, numbered after the cell's and the earlier rounds'), so that its
        requests never share a repeat number with the cell's."""
        settings = self.cell_settings(cell)
        first_repeat = int(settings["workload"].get("repeats") or 1) * round_
        return settings | {"top_up": {"round": round_, "first_repeat": first_repeat}}

    def cell_workload(self, cell: CellSpec) -> Mapping[str, Any]:
        """The workload settings of ``cell``: its mode's, or its trace window's (servegrid.modes.base.Mode.windows)."""
        return self.workload(cell.mode).cell_settings(cell.load.window if isinstance(cell.load, Replay) else "")

    def longest_request(self, cell: CellSpec) -> int:
        """Prompt + output tokens of the longest request of ``cell``."""
        return modes.get(cell.mode).request_tokens(cell.context, self.cell_workload(cell))


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_jsonable)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def spec_hash(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(spec).encode()).hexdigest()[:16]
