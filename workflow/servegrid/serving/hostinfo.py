"""The machine the servers run on: its description for the report, and the checks that its CPUs and
GPUs are the ones a configuration names (made before any server starts)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from functools import cache
from typing import Any

import psutil

from servegrid.errors import ServerError


@cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output for ``args``, or None where there is no nvidia-smi or it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_indices() -> list[int] | None:
    """The GPU indices nvidia-smi lists (the numbering CUDA_VISIBLE_DEVICES uses), or None without nvidia-smi."""
    out = nvidia_smi("--query-gpu=index", "--format=csv,noheader")
    return None if out is None else sorted(int(line) for line in out.split() if line.strip().isdigit())


def gpus(indices: list[int]) -> list[dict[str, str]]:
    """Name and memory of the given GPUs, from nvidia-smi when there is one."""
    if not indices:
        return []
    out = nvidia_smi(
        "--query-gpu=index,name,memory.total,driver_version",
        "--format=csv,noheader",
        "-i",
        ",".join(str(i) for i in indices),
    )
    rows = []
    for line in (out or "").strip().splitlines():
        index, name, memory, driver = (part.strip() for part in line.split(","))
        rows.append({"index": index, "name": name, "memory": memory, "driver": driver})
    return rows


def describe(gpu_indices: list[int]) -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpus(gpu_indices),
    }


def check_cpus(cpus: Sequence[int], key: str) -> None:
    """Fail, naming ``key``, when ``cpus`` asks for cores this process may not use."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ServerError(f"{key}: CPU(s) {missing} are not available here (this process may use {sorted(allowed)})")


def check_gpus(gpus: Sequence[int], key: str) -> None:
    """Fail, naming ``key``, when ``gpus`` asks for GPUs nvidia-smi does not list.

    A 27B model takes minutes to load before the engine finds its GPU missing; this takes a second.
    Hosts without nvidia-smi are not checked.
    """
    if not gpus:
        return
    present = gpu_indices()
    missing = sorted(set(gpus) - set(present)) if present is not None else []
    if missing:
        raise ServerError(f"{key}: GPU(s) {missing} are not on this host (nvidia-smi lists {present})")
