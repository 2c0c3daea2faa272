"""The workload-mode registry: one :class:`~servegrid.modes.base.Mode` per mode, in canonical order.

Config validation, the grid, cells, aggregation, the verdict, figures and the
report all look modes up here; a name nobody registered is an
:class:`~servegrid.errors.UnknownModeError` everywhere. Adding a mode is one
module that calls :func:`register` (imported below, or by whoever adds it at
run time, as the tests do) plus its strings in the catalogues.
"""

from __future__ import annotations

from servegrid.modes.base import FigureSpec, Mode, Primary
from servegrid.modes.registry import get, names, register, registered, unregister

__all__ = ["FigureSpec", "Mode", "Primary", "get", "names", "register", "registered", "unregister"]

# The built-in modes, registered in the order the report shows them.
from servegrid.modes import decode, single_turn, multi_turn, trace  # noqa: F401, I001
