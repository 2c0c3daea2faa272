"""What the host itself would do to a run: proxy variables that send loopback traffic elsewhere, and the GPUs'
free memory against what a configuration's server will take."""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from servegrid.serving import hostinfo

PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


@dataclass(frozen=True)
class GpuMemory:
    index: int
    name: str
    uuid: str
    free_bytes: int
    total_bytes: int


def proxies_reaching(host: str, environ: Mapping[str, str]) -> list[str]:
    """The proxy variables set in ``environ`` that ``no_proxy`` does not exempt ``host`` from (urllib's reading,
    which httpx's resembles): control calls to the servers would go through that proxy."""
    set_here = [v for v in PROXY_VARIABLES if environ.get(v)]
    if not set_here:
        return []
    saved = {k: v for k, v in environ.items() if k.lower() == "no_proxy"}
    exempt = bool(saved) and bool(
        urllib.request.proxy_bypass_environment(host, proxies={"no": next(iter(saved.values()))})
    )
    return [] if exempt else set_here


def gpu_memory() -> dict[int, GpuMemory] | None:
    """Each GPU's free and total memory by nvidia-smi's index, or None where there is no nvidia-smi."""
    out = hostinfo.nvidia_smi("--query-gpu=index,name,uuid,memory.free,memory.total", "--format=csv,noheader,nounits")
    if out is None:
        return None
    rows = {}
    for line in out.strip().splitlines():
        index, _, rest = line.partition(",")
        parts = [p.strip() for p in rest.rsplit(",", 3)]  # a GPU's name may hold a comma; the rest cannot
        if not index.strip().isdigit() or len(parts) != 4:
            continue
        name, uuid, free, total = parts
        try:  # MiB; "[N/A]" where the device does not say (unified memory, some vGPUs): left out, said unchecked
            rows[int(index)] = GpuMemory(int(index), name, uuid, int(float(free) * 2**20), int(float(total) * 2**20))
        except ValueError:
            continue
    return rows


def visible_gpu_findings(
    gpus: Sequence[int], memory: Mapping[int, GpuMemory], seen: Sequence[Mapping[str, str]]
) -> list[str]:
    """What is wrong when a CUDA process in the server's environment does not see exactly the GPUs nvidia-smi lists
    under the configuration's indices (``seen``: name and UUID of each, from the engine's probe)."""
    expected = [memory[i].uuid for i in gpus if i in memory]
    got = [d["uuid"] for d in seen]
    if any(u.startswith("MIG-") for u in got):  # torch names the MIG instance, nvidia-smi its parent: not comparable
        return []
    if got == expected:
        return []
    return [
        f"CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))} shows the server {len(got)} GPU(s) {got}, not the ones "
        f"nvidia-smi lists under {list(gpus)} ({expected}): set CUDA_DEVICE_ORDER=PCI_BUS_ID in engine.env, or "
        "check what else sets the visible devices"
    ]


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def memory_findings(
    gpus: Sequence[int], memory: Mapping[int, GpuMemory], weights_bytes: int | None, utilization: float
) -> list[str]:
    """What the configuration's GPUs lack: vLLM claims ``utilization`` × total on each at start-up and stops if that
    much is not free; the weights, split across the GPUs, must fit in what it claims."""
    problems = []
    share = weights_bytes / len(gpus) if weights_bytes and gpus else None
    for index in gpus:
        gpu = memory.get(index)
        if gpu is None:
            continue
        wanted = utilization * gpu.total_bytes
        if gpu.free_bytes < wanted:
            problems.append(
                f"GPU {index} ({gpu.name}) has {gib(gpu.free_bytes)} free of {gib(gpu.total_bytes)}; the "
                f"server claims {utilization:.0%} ({gib(wanted)}): another process holds the rest"
            )
        if share is not None and share > wanted:
            problems.append(
                f"GPU {index}: the weights' share ({gib(share)}) is more than the {gib(wanted)} the "
                "server may claim there"
            )
    return problems
