"""servegrid's one error hierarchy.

Every failure servegrid expects (bad input, a server that will not start, a cell
that measured nothing, an unreadable cell file, a report that cannot be built)
is a :class:`ServegridError`. The CLI and the Snakemake jobs catch this root in
one place (:func:`guarded`) and print its message as one clear first line; anything
else is a bug and keeps its traceback.

    ServegridError
    ├── ConfigError        the configuration (or a command-line argument) is wrong
    │   └── UnknownModeError   a workload mode no module registered
    ├── ServerError        an inference server: start-up, health, identity, teardown
    │   ├── EngineRefused      its engine died of its own error at its first request: the configuration's result
    │   ├── StartRaced         its start met a passing condition (its port taken in between): started once more
    │   └── GatewayError       the gateway (LiteLLM proxy): start-up, or a field it drops or alters
    ├── CellError          a cell could not be measured; nothing was written
    │   ├── CellStalled        its server stopped making progress: it is stopped, never reused
    │   └── ServerLost         its server stopped answering outside a measured stream (a control call, a connect)
    ├── PreflightError     the host or the user's engine would refuse a configuration (servegrid preflight)
    ├── CellFileError      a cell file cannot be read back (damaged, truncated, not servegrid's)
    ├── NewerFormatError   a file servegrid reads back was written by a newer servegrid: kept as it is, never set aside
    ├── OutputError        an output cannot be written (disk full, file too large, permissions)
    └── ReportError        figures or a report could not be built
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable


class ServegridError(Exception):
    """Root of every error servegrid raises on purpose; the message names what is wrong."""

    exit_code = 1


class ConfigError(ServegridError, ValueError):
    """The configuration is invalid; the message names the offending key."""

    exit_code = 2


class UnknownModeError(ConfigError, KeyError):
    """A workload mode that no module registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ServerError(ServegridError):
    """A server could not be brought up or used; the message says why and where its log is."""


class EngineRefused(ServerError):
    """The server came up healthy and its engine died of its own error at its first request: this engine cannot
    serve the configuration (e.g. vLLM's CPU build with MTP and a hybrid model's prefix caching). A result, not a
    fault: its cells are written as refused, naming ``reason``, and the run goes on with the other configurations.
    ``server``: what is known of the server (its ServerFacts' fields as far as it got)."""

    def __init__(self, message: str, reason: str, server: dict | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.server = server or {}


class StartRaced(ServerError):
    """A start-up failed for a reason that a second try would not meet: another process took its port between the
    probe and the server's bind, or its first request timed out just after it turned healthy. The server is started
    once more (on another port), saying so in the log; a second failure is a failure."""


class GatewayError(ServerError):
    """The gateway in front of the servers could not be started, or changes what a request asks for (a
    field dropped or altered): the message names the field, so nothing else is measured silently."""


class PreflightError(ServegridError):
    """Before any server starts: the host or the user's own engine would refuse a configuration; the message names
    the key to change."""


class CellError(ServegridError):
    """The cell could not be measured; nothing was written."""


class CellStalled(CellError):
    """The server made no progress for longer than the cell's work allows: hung, and stopped."""


class ServerLost(CellError):
    """The cell's server stopped answering where no measured request could count it: a control call (metrics,
    tokenizer, cache reset) or the connections opened before a stage. Raised whatever the transport (httpx or
    aiohttp), so the cell job adds the server log's tail in one place."""


class CellFileError(ServegridError):
    """A cell file cannot be read: damaged, truncated or not servegrid's; the message names the file."""


class NewerFormatError(ServegridError):
    """A file servegrid reads back (a cell file, a server record, a plan) was written by a newer servegrid in a
    format this one does not know. Not damage: the file is left where it is, and the message says to upgrade."""


class OutputError(ServegridError):
    """An output cannot be written (disk full, file too large, no permission); the message names it.
    Nothing that looks complete is left: outputs are written atomically (servegrid.atomic)."""


class ReportError(ServegridError):
    """Figures or a report could not be built."""


def guarded(body: Callable[[], int | None], log: logging.Logger | None = None) -> int:
    """Run ``body``; a :class:`ServegridError` becomes one ``servegrid: error: …`` message and an exit code.

    The one place where expected failures are caught, for the CLI and for every
    Snakemake job alike, so the terminal and the job's log show the same text.
    """
    try:
        return int(body() or 0)
    except ServegridError as exc:
        message = f"servegrid: error: {exc}"
        if log is not None:
            log.error("%s", message)
        else:
            print(message, file=sys.stderr)
        return exc.exit_code
