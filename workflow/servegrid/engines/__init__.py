"""The engine registry: ``engine.kind`` in the config → one :class:`~servegrid.engines.base.Engine`.

Built-in engines are named by import path and loaded on first use, so a
configuration that names one engine never imports another. Tests and plug-ins
add engines with :func:`register`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

from servegrid.engines.base import Engine, EngineFacts, EngineFinding, ServerLaunch, StartupFacts
from servegrid.errors import ConfigError

__all__ = ["Engine", "EngineFacts", "EngineFinding", "ServerLaunch", "StartupFacts", "get", "kinds", "register"]

_FACTORIES: dict[str, str | Callable[[], Engine]] = {"vllm": "servegrid.engines.vllm:VLLMEngine"}


def register(kind: str, factory: Callable[[], Engine]) -> None:
    """Make ``engine.kind: <kind>`` valid; ``factory()`` builds the engine."""
    _FACTORIES[kind] = factory
    get.cache_clear()


def kinds() -> list[str]:
    return sorted(_FACTORIES)


@cache
def get(kind: str) -> Engine:
    """The engine of ``kind``; :class:`ConfigError` for a kind nobody registered."""
    factory = _FACTORIES.get(kind)
    if factory is None:
        raise ConfigError(f"engine.kind: unknown engine '{kind}' (known: {', '.join(kinds())})")
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
    return factory()
