"""Which CPUs and GPUs a configuration's server, and the client, run on.

On a host of one's own, ``configurations.<name>.cpus`` / ``gpus`` and ``operations.client_cpus`` are that
host's own numbers and are used as written. Inside a Slurm job (``SLURM_JOB_ID`` set) they are counts: the
Slurm profile asks for as many CPUs and GPUs as the configuration names (``workflow/rules/common.smk``) and
Slurm picks which, so the server takes the first ``len(cpus)`` CPUs the job may use, the client the next
``len(client_cpus)``, and the server the first ``len(gpus)`` of the GPUs Slurm made visible
(``CUDA_VISIBLE_DEVICES``). A node's numbers written in the config would name another job's devices.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from servegrid.errors import ServerError


@dataclass(frozen=True)
class Placement:
    server_cpus: list[int]
    client_cpus: list[int]
    gpus: list[int]
    slurm_job: str | None  # the Slurm job that chose them; None: as the config wrote them


def slurm_job(environ: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job this process runs in, if any."""
    return (os.environ if environ is None else environ).get("SLURM_JOB_ID") or None


def place(
    configuration: str,
    cpus: Sequence[int],
    gpus: Sequence[int],
    client_cpus: Sequence[int],
    *,
    environ: Mapping[str, str] | None = None,
    allowed_cpus: Sequence[int] | None = None,
) -> Placement:
    """The devices of ``configuration`` here; :class:`ServerError` naming the key when a Slurm job lacks them."""
    env = os.environ if environ is None else environ
    job = slurm_job(env)
    if job is None:
        return Placement(list(cpus), list(client_cpus), list(gpus), None)
    allowed = sorted(os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus)
    wanted = len(cpus) + len(client_cpus)
    if wanted > len(allowed):
        raise ServerError(
            f"configurations.{configuration}.cpus and operations.client_cpus ask for {wanted} CPU(s); "
            f"Slurm job {job} may use {len(allowed)} ({allowed}): its cpus_per_task is too small"
        )
    server_cpus = allowed[: len(cpus)]
    client = allowed[len(cpus) : wanted]
    visible = [part.strip() for part in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if part.strip()]
    if len(visible) < len(gpus):
        raise ServerError(
            f"configurations.{configuration}.gpus asks for {len(gpus)} GPU(s); Slurm job {job} shows "
            f"{len(visible)} (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')!r}): submit it with as many"
        )
    chosen = visible[: len(gpus)]
    if not all(part.isdigit() for part in chosen):
        raise ServerError(
            f"configurations.{configuration}.gpus: Slurm job {job} names its GPUs {chosen} (CUDA_VISIBLE_DEVICES); "
            "servegrid places servers by GPU index only"
        )
    return Placement(server_cpus, client, [int(part) for part in chosen], job)
