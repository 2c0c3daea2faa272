"""The registry itself (a module of its own, so that mode modules can register without importing the package)."""

from __future__ import annotations

from servegrid.errors import UnknownModeError
from servegrid.modes.base import Mode

_REGISTRY: dict[str, Mode] = {}


def register(mode: Mode) -> Mode:
    """Add ``mode`` (after those already registered); registering a name twice is an error."""
    if mode.name in _REGISTRY:
        raise ValueError(f"workload mode '{mode.name}' is registered already")
    _REGISTRY[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    """Remove a mode (tests that register a toy mode clean up with this)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> Mode:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownModeError(f"unknown workload mode '{name}' (registered: {', '.join(_REGISTRY)})") from None


def names() -> list[str]:
    """Registered modes in canonical order (the order of the report's sections)."""
    return list(_REGISTRY)


def registered() -> list[Mode]:
    return list(_REGISTRY.values())
