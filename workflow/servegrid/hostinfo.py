"""A short description of the machine the servers run on, for the report's setup section."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from functools import cache
from typing import Any

import psutil


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
