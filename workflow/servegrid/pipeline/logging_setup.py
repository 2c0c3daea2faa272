"""Logging as the CLI and the Snakemake jobs set it up: one format, and libraries kept below WARNING.

WeasyPrint's font subsetting (fontTools) logs a line per glyph table at INFO, 240 lines a report; httpx
logs every control request; matplotlib and Pillow log their font and plugin searches. A job's own
progress lines would drown in them, so these loggers show warnings and errors only.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET = ("httpx", "httpcore", "fontTools", "weasyprint", "matplotlib", "PIL")


def configure(level: str | int, handlers: list[logging.Handler] | None = None) -> None:
    """Send servegrid's records at ``level`` (and other libraries' warnings) to ``handlers`` (default: stderr)."""
    logging.basicConfig(level=level, handlers=handlers, format=FORMAT, force=True)
    quiet_libraries()


def quiet_libraries() -> None:
    root = logging.getLogger().level
    for name in QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, root))
