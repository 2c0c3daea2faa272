"""Helpers shared by the tests (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import copy
import socket
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FAKE_SERVER = REPO / "tests" / "helpers" / "fake_server.py"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def free_port_range(width: int = 20) -> tuple[int, int]:
    """A range of ports that are free right now (best effort)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    base = min(base, 65000 - width)
    return base, base + width


def fake_spec(name: str = "fake", *flags: str) -> dict[str, Any]:
    return {
        "configuration": name,
        "command": [sys.executable, str(FAKE_SERVER), "--model-path", "{model}"],
        "model": "fake-model",
        "served_name": "fake",
        "tiny_model": None,
        "args": list(flags),
        "env": {},
        "api_key_env": None,
        "prefix_caching": True,
        "speculative": None,
    }


def with_changes(raw: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of ``raw`` with dotted keys replaced: with_changes(raw, **{"a.b": 1})."""
    out = copy.deepcopy(raw)
    for dotted, value in changes.items():
        node = out
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out
