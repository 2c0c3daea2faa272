"""The config schema, assembled: ``workflow/schemas/config.schema.yaml`` plus each registered
workload mode's own settings; validation that fills defaults and names the offending key."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError

from servegrid import modes
from servegrid.errors import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` merges; it is no key of its own
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"{self.name}:{key_node.start_mark.line + 1}: duplicate key '{key}' "
                    f"(first at line {seen[key]}); YAML would keep only the last one"
                )
            seen[key] = key_node.start_mark.line + 1
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def read_yaml(path: str | Path) -> Any:
    """A config file's content; :class:`ConfigError` naming the file (and line) when it cannot be read."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    loader = _StrictLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    finally:
        loader.dispose()


def _integer(checker: Any, instance: Any) -> bool:
    # JSON Schema counts 2.0 as an integer; a grid value of 2.0 would name a cell file no rule makes.
    return isinstance(instance, int) and not isinstance(instance, bool)


def _validator_with_defaults() -> type:
    """jsonschema's documented recipe: fill in ``default`` while validating (as Snakemake's validate() does);
    "integer" means an integer as written, never 2.0."""
    base = Draft202012Validator
    validate_properties = base.VALIDATORS["properties"]

    def set_defaults(
        validator: Any, properties: dict[str, Any], instance: Any, schema: dict[str, Any]
    ) -> Iterator[Any]:
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema:
                    instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    extended: type = validators.extend(
        base, {"properties": set_defaults}, type_checker=base.TYPE_CHECKER.redefine("integer", _integer)
    )
    return extended


def load_schema() -> dict[str, Any]:
    """The config schema with one ``workloads`` entry per registered mode (its module's settings)."""
    schema: dict[str, Any] = yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))
    common = schema["$defs"]["mode_common"]
    workloads = schema["properties"]["workloads"]
    for mode in modes.registered():
        properties = {"enabled": {"type": "boolean", "default": True}}
        for key, subschema in common.items():
            properties[key] = {**subschema, **({"default": mode.defaults[key]} if key in mode.defaults else {})}
        properties.update(copy.deepcopy(dict(mode.schema)))
        workloads["properties"][mode.name] = {
            "type": "object",
            "additionalProperties": False,
            # A mode that gives its contexts a default (trace: [0]) does not need them written.
            "required": [] if "default" in properties["contexts"] else ["contexts"],
            "properties": properties,
        }
    schema["properties"]["slo"]["properties"] = {name: {"$ref": "#/$defs/objectives"} for name in modes.names()}
    classes = schema["properties"]["verdict"]["properties"]["classes"]
    classes["items"]["properties"]["mode"]["enum"] = modes.names()
    # By default: the KV-limited corner, then one class per mode, so a new mode has its verdict row.
    classes["default"] = [{"id": "kv_limit", "kv_limited": True}] + [{"id": m, "mode": m} for m in modes.names()]
    return schema


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
    if len(errors) == 1:
        raise ConfigError(f"{source}: {_key_path(errors[0])}: {errors[0].message}")
    if errors:
        lines = [f"{source}: {_key_path(e)}: {e.message}" for e in errors[:10]]
        raise ConfigError(f"{source}: {len(errors)} problems\n  " + "\n  ".join(lines))
    return config
