"""What the host itself would do to a run: proxy variables that send loopback traffic elsewhere, and the GPUs'
free memory against what a configuration's server will take."""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from servegrid.engines.base import KvDemand
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
        # Public in CPython's urllib.request (what urllib itself calls), undeclared in typeshed's stubs.
        urllib.request.proxy_bypass_environment(  # type: ignore[attr-defined]
            host, proxies={"no": next(iter(saved.values()))}
        )
    )
    return [] if exempt else set_here


EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports() -> tuple[int, int] | None:
    """The kernel's range of source ports for outgoing connections (Linux), or None where it does not say."""
    try:
        with open(EPHEMERAL_PORTS, encoding="ascii") as handle:
            low, high = handle.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return None


def ephemeral_overlap(port_range: Sequence[int]) -> str | None:
    """Why ``port_range`` (first, last) is unsafe for servers, or None: inside the ephemeral range, any outgoing
    connection of the host (a health check, a download) may take a server's port as its source port between the
    pipeline's check and the server's bind (seen in a test run: twice in a row, the same even port)."""
    ephemeral = ephemeral_ports()
    if ephemeral is None or port_range[1] < ephemeral[0] or port_range[0] > ephemeral[1]:
        return None
    return (
        f"operations.port_range {port_range[0]}-{port_range[1]} overlaps the kernel's ephemeral ports "
        f"{ephemeral[0]}-{ephemeral[1]} ({EPHEMERAL_PORTS}), which any outgoing connection of this host may take as "
        "its source port: a server may then find its port taken at start-up; choose ports below "
        f"{ephemeral[0]} (the default, 8100-8199, is)"
    )


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


# The part of a GPU's memory vLLM's activations, CUDA graphs and CUDA context may take besides the weights and the
# KV cache: a full-length request this close to the bound is a warning, not an error.
TIGHT_MARGIN = 0.05


def kv_pool_findings(
    gpus: Sequence[int], memory: Mapping[int, GpuMemory], weights_bytes: int | None, utilization: float, kv: KvDemand
) -> list[tuple[str, str]]:
    """(level, message) where one request of the server's full length does not fit each GPU's KV pool: what vLLM
    claims there, less the weights' share, before its activations and CUDA graphs take their part. Beyond that
    bound vLLM refuses to start (its "To serve at least one request with the model's max seq len"); within
    ``TIGHT_MARGIN`` of it, it may."""
    if not weights_bytes or not gpus:
        return []
    found = []
    need = kv.max_model_len * kv.bytes_per_token
    for index in gpus:
        gpu = memory.get(index)
        if gpu is None:
            continue
        pool = utilization * gpu.total_bytes - weights_bytes / len(gpus)
        said = (
            f"GPU {index} ({gpu.name}): one request of {kv.max_model_len:,} tokens (--max-model-len) needs "
            f"{gib(need)} of KV cache there ({kv.bytes_per_token:,.0f} B a token), and the server's claim "
            f"({utilization:.0%} of {gib(gpu.total_bytes)}) leaves at most {gib(max(pool, 0))} after the weights' "
            "share"
        )
        if need > pool:
            advice = "lower --max-model-len or raise --gpu-memory-utilization"
            found.append(("error", f"{said}, before its activations: vLLM refuses to start; {advice}"))
        elif need > pool - TIGHT_MARGIN * gpu.total_bytes:
            found.append(("warning", f"{said}; its activations and CUDA graphs take part of that: it may not start"))
    return found
