"""The experiment: validated configuration, the grid of cells, launch specs.

Everything a cell's result depends on is derived here, and nothing else:
:func:`Experiment.launch_spec` (what the server is) and
:func:`Experiment.cell_settings` (what the cell measures). Snakemake compares
both between runs to decide what reruns, so operational settings (ports,
timeouts, GPU placement) deliberately appear in neither.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError

from servegrid import paths

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "config.schema.yaml"

# Bump when the way a cell is measured changes: every cell reruns.
MEASUREMENT_VERSION = 4  # 4: /metrics parsed after the measured phase, not during it

MODES = ("decode", "single_turn", "multi_turn")

# Flags servegrid sets itself; a configuration that also set them would be ambiguous.
RESERVED_FLAGS = (
    "--host",
    "--port",
    "--model",
    "--served-model-name",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--speculative-config",
)


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


@dataclass(frozen=True, order=True)
class Cell:
    """One grid point: configuration × workload mode × context × concurrency."""

    configuration: str
    mode: str
    context: int
    concurrency: int

    @property
    def id(self) -> str:
        return f"{self.configuration}/{self.mode}/ctx{self.context}_c{self.concurrency}"

    @property
    def path(self) -> str:
        return paths.cell(self.configuration, self.mode, self.context, self.concurrency)


def _validator_with_defaults() -> type:
    """jsonschema's documented recipe: fill in ``default`` while validating (as Snakemake's validate() does)."""
    base = Draft202012Validator
    validate_properties = base.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):  # type: ignore[no-untyped-def]
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema:
                    instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return validators.extend(base, {"properties": set_defaults})


def load_schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def _key_path(error: ValidationError) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def validate(raw: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """Validate against the JSON schema and fill defaults; raise :class:`ConfigError`."""
    config = copy.deepcopy(dict(raw))
    validator = _validator_with_defaults()(load_schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        # The deepest error is the most specific one for oneOf/anyOf failures.
        lines = [f"{source}: {_key_path(e)}: {e.message}" for e in errors[:10]]
        raise ConfigError("invalid configuration\n  " + "\n  ".join(lines))
    return config


class Experiment:
    """A validated configuration with the derived grid."""

    def __init__(self, raw: Mapping[str, Any], source: str = "config") -> None:
        self.source = source
        self.raw = validate(raw, source)
        self._check_semantics()

    @classmethod
    def from_file(cls, path: str | Path) -> Experiment:
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        return cls(raw, source=str(path))

    # ---- accessors -------------------------------------------------------
    @property
    def configurations(self) -> dict[str, dict[str, Any]]:
        return self.raw["configurations"]

    @property
    def operations(self) -> dict[str, Any]:
        return self.raw["operations"]

    @property
    def languages(self) -> list[str]:
        return self.raw["report"]["languages"]

    def modes(self) -> list[str]:
        """Enabled workload modes, in canonical order."""
        workloads = self.raw["workloads"]
        return [m for m in MODES if m in workloads and workloads[m]["enabled"]]

    def mode_settings(self, mode: str) -> dict[str, Any]:
        return self.raw["workloads"][mode]

    def cells(self, configuration: str | None = None) -> list[Cell]:
        names = [configuration] if configuration else list(self.configurations)
        return [
            Cell(name, mode, context, concurrency)
            for name in names
            for mode in self.modes()
            for context in self.mode_settings(mode)["contexts"]
            for concurrency in self.mode_settings(mode)["concurrency"]
        ]

    def cell(self, configuration: str, mode: str, context: int, concurrency: int) -> Cell:
        wanted = Cell(configuration, mode, int(context), int(concurrency))
        if wanted not in self.cells():
            raise ConfigError(f"{self.source}: cell {wanted.id} is not in the grid")
        return wanted

    def tiny_model_spec(self) -> dict[str, Any] | None:
        """model.tiny with every default spelled out, or None."""
        from servegrid.model import TinyModelSpec

        tiny = self.raw["model"]["tiny"]
        return None if tiny is None else asdict(TinyModelSpec(**tiny))

    # ---- identities that decide reruns -------------------------------------
    def configuration_flags(self, name: str) -> list[str]:
        conf = self.configurations[name]
        flags = ["--enable-prefix-caching" if conf["prefix_caching"] else "--no-enable-prefix-caching"]
        if conf["speculative"]:
            flags += ["--speculative-config", canonical_json(conf["speculative"])]
        return flags + list(conf["args"])

    def launch_spec(self, name: str) -> dict[str, Any]:
        """What the server of configuration ``name`` is; placement and ports excluded."""
        engine, model = self.raw["engine"], self.raw["model"]
        conf = self.configurations[name]
        return {
            "configuration": name,
            "command": list(engine["command"]),
            "model": model["path"],
            "served_name": model["served_name"],
            "tiny_model": self.tiny_model_spec(),
            "args": list(engine["args"]) + self.configuration_flags(name),
            "env": {**engine["env"], **conf["env"]},
            "api_key_env": engine["api_key_env"],
            "prefix_caching": conf["prefix_caching"],
            "speculative": conf["speculative"],
        }

    def cell_settings(self, cell: Cell) -> dict[str, Any]:
        """Everything that cell's numbers depend on besides the server itself."""
        workload = {
            k: v for k, v in self.mode_settings(cell.mode).items() if k not in ("contexts", "concurrency", "enabled")
        }
        return {
            "measurement_version": MEASUREMENT_VERSION,
            "cell": cell.id,
            "mode": cell.mode,
            "context": cell.context,
            "concurrency": cell.concurrency,
            "workload": workload,
            "sampling": self.raw["sampling"],
        }

    def role(self, name: str) -> str:
        """caching (prefix caching, no speculation), speculative (the reverse), both, or baseline."""
        conf = self.configurations[name]
        speculates = conf["speculative"] is not None
        if conf["prefix_caching"]:
            return "both" if speculates else "caching"
        return "speculative" if speculates else "baseline"

    def roles(self) -> dict[str, str]:
        return {name: self.role(name) for name in self.configurations}

    def configuration_index(self, name: str) -> int:
        return list(self.configurations).index(name)

    # ---- checks the schema cannot express -----------------------------------
    def _check_semantics(self) -> None:
        src = self.source
        engine = self.raw["engine"]
        if not any("{model}" in part for part in engine["command"]):
            raise ConfigError(f"{src}: engine.command: needs a '{{model}}' placeholder where the model goes")
        for where, args in [("engine.args", engine["args"])] + [
            (f"configurations.{n}.args", c["args"]) for n, c in self.configurations.items()
        ]:
            for arg in args:
                flag = arg.split("=", 1)[0]
                if flag in RESERVED_FLAGS:
                    raise ConfigError(
                        f"{src}: {where}: '{flag}' is set by servegrid "
                        "(use prefix_caching, speculative, model.served_name or operations instead)"
                    )
        for name, conf in self.configurations.items():
            if "CUDA_VISIBLE_DEVICES" in conf["env"] or "CUDA_VISIBLE_DEVICES" in engine["env"]:
                raise ConfigError(f"{src}: configurations.{name}.env: set GPUs with 'gpus', not CUDA_VISIBLE_DEVICES")
        if self.raw["model"]["tiny"] is not None:
            joined = " ".join(engine["args"])
            if "--load-format dummy" not in joined and "--load-format=dummy" not in joined:
                raise ConfigError(
                    f"{src}: engine.args: model.tiny builds a folder without weights, "
                    "so the engine needs '--load-format dummy'"
                )
        if not self.modes():
            raise ConfigError(f"{src}: workloads: no workload mode is enabled")
        from servegrid.catalogues import available_languages

        missing = [lang for lang in self.languages if lang not in available_languages()]
        if missing:
            raise ConfigError(
                f"{src}: report.languages: no catalogue for {', '.join(missing)} "
                "(add report/locales/<language>/LC_MESSAGES/messages.po)"
            )
        low, high = self.operations["port_range"]
        if low > high:
            raise ConfigError(f"{src}: operations.port_range: {low} > {high}")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def spec_hash(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(spec).encode()).hexdigest()[:16]
