"""Secrets never reach disk, logs or reports: whatever looks like one is masked wherever servegrid writes.

A secret is the value of an environment variable whose name says so (``*_KEY``,
``*_TOKEN``, ``*SECRET*``, ``*PASSWORD*``) or of a command-line flag that carries
one (``--api-key``, ``--token``, ``--password``, with ``_`` or ``-``, with ``=`` or
a separate value). The values are used where they are needed, in a server's
environment, and masked in every description of it: launch specs (and so
Snakemake's params), server records, cell files, tables and reports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

MASK = "***"
_SECRET_NAME = re.compile(r"(_KEY|_TOKEN)$|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
_SECRET_FLAGS = ("--api-key", "--token", "--hf-token", "--password", "--secret")


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def env(variables: Mapping[str, str]) -> dict[str, str]:
    """``variables`` with the value of every secret-looking name masked."""
    return {k: (MASK if is_secret_name(k) else v) for k, v in variables.items()}


def flag_name(arg: str) -> str:
    """The long flag an argument sets, as argparse-style parsers (vLLM's among them) read it:
    ``--a_b=1`` sets ``--a-b``. Anything else is returned as it is."""
    flag = arg.split("=", 1)[0]
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def is_secret_flag(arg: str) -> bool:
    """A command-line flag that carries a secret (``--token``, ``--hf-token``, ..., in any spelling)."""
    return flag_name(arg).lower() in _SECRET_FLAGS


def argv(args: Sequence[str]) -> list[str]:
    """``args`` with the value of every secret-carrying flag masked (``--api-key X``, ``--api-key=X``)."""
    out: list[str] = []
    mask_next = False
    for arg in args:
        if mask_next:
            out.append(MASK)
            mask_next = False
        elif is_secret_flag(arg):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + MASK)
            else:
                out.append(arg)
                mask_next = True
        else:
            out.append(arg)
    return out
