"""GPU placement without GPUs: what each server would get, and who may run beside whom.

The engine here is the calibration server (it ignores CUDA_VISIBLE_DEVICES),
so that Snakemake's scheduling and servegrid's device rules can be watched
with --cores 2 on a machine without a GPU.
"""

from __future__ import annotations

import sys
from datetime import datetime
from itertools import combinations

import pytest

from helpers import copy_workflow, snakemake, write_yaml
from servegrid.config import Experiment
from servegrid.errors import ServerError
from servegrid.records import cell_file
from servegrid.serving import placement, server

pytestmark = pytest.mark.exclusive  # Snakemake runs that place servers on cores


def test_each_configuration_gets_its_own_gpus(seed_raw):
    seed = Experiment(seed_raw)
    for name, expected in (("prefix_cache", "0"), ("mtp", "1")):
        runtime = server.Runtime.from_config(seed.operations, seed.configuration(name))
        argv, env = server.launch_command(seed.launch_spec(name), runtime, 8100)
        assert env["CUDA_VISIBLE_DEVICES"] == expected
        assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3.8-27B-FP8"]
        assert "CUDA_VISIBLE_DEVICES" not in " ".join(argv)


def test_in_a_slurm_job_the_config_names_counts_and_slurm_the_devices(seed_raw, monkeypatch):
    """The seed's mtp server asks for GPU 1; in a Slurm job given one GPU (CUDA_VISIBLE_DEVICES=3, no device
    cgroup) that GPU is Slurm's 3, not the node's 1, which another job may hold."""
    seed = Experiment(seed_raw)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    runtime = server.Runtime.from_config(seed.operations, seed.configuration("mtp"))
    _, env = server.launch_command(seed.launch_spec("mtp"), runtime, 8100)
    assert runtime.gpus == [3] and env["CUDA_VISIBLE_DEVICES"] == "3"


def test_in_a_slurm_job_cpus_are_the_jobs_first_ones():
    where = placement.place("a", cpus=[0], gpus=[], client_cpus=[1], environ={"SLURM_JOB_ID": "7"}, allowed_cpus=[6, 4])
    assert (where.server_cpus, where.client_cpus, where.slurm_job) == ([4], [6], "7")
    outside = placement.place("a", cpus=[0], gpus=[1], client_cpus=[1], environ={}, allowed_cpus=[6, 4])
    assert (outside.server_cpus, outside.client_cpus, outside.gpus, outside.slurm_job) == ([0], [1], [1], None)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"SLURM_JOB_ID": "7"}, "asks for 1 GPU(s); Slurm job 7 shows 0"),
        ({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "GPU-5f2e"}, "places servers by GPU index only"),
    ],
)
def test_a_slurm_job_without_the_gpus_asked_for_fails_naming_the_key(environ, message):
    with pytest.raises(ServerError, match=r"configurations\.a\.gpus") as error:
        placement.place("a", cpus=[], gpus=[0], client_cpus=[], environ=environ, allowed_cpus=[0])
    assert message in str(error.value)


def test_a_slurm_job_with_too_few_cpus_fails_naming_the_keys():
    with pytest.raises(ServerError, match=r"cpus and operations.client_cpus ask for 2 CPU\(s\); Slurm job 7 may use 1"):
        placement.place("a", cpus=[0], gpus=[], client_cpus=[1], environ={"SLURM_JOB_ID": "7"}, allowed_cpus=[3])


def placement_config() -> dict:
    def conf(gpus: list[int]) -> dict:
        return {"label": f"gpus {gpus}", "prefix_caching": True, "gpus": gpus}

    return {
        "experiment": {"title": "placement"},
        "model": {"path": "none", "served_name": "calibration"},
        "engine": {
            "command": [sys.executable, "-m", "servegrid.testing.calibration", "--model", "{model}"],
            "args": ["--interval", "0.01"],
        },
        "configurations": {"on_gpu0": conf([0]), "on_gpu1": conf([1]), "also_gpu0": conf([0])},
        "workloads": {
            "decode": {
                "contexts": [32],
                "concurrency": [1, 2],
                "output_tokens": 60,
                "requests_per_session": 2,
                "warmup_requests": 0,
            }
        },
        # preflight off: the calibration stand-in serves no checkpoint (model.path "none" would be its error).
        "operations": {"port_range": [8700, 8760], "startup_timeout_s": 60, "preflight": False},
    }


def intervals(workdir) -> dict[str, list[tuple[datetime, datetime, str]]]:
    out: dict[str, list] = {}
    for path in sorted((workdir / "results" / "cells").glob("*/*/*.parquet")):
        meta = cell_file.read_record(path)
        span = (
            datetime.fromisoformat(meta.started_at),
            datetime.fromisoformat(meta.ended_at),
            meta.server["session"],
        )
        out.setdefault(meta.spec.configuration, []).append(span)
    return out


def overlaps(a, b) -> bool:  # type: ignore[no-untyped-def]
    return a[0] < b[1] and b[0] < a[1]


@pytest.fixture(scope="module")
def placed(tmp_path_factory):  # type: ignore[no-untyped-def]
    workdir = copy_workflow(tmp_path_factory.mktemp("placement"))
    write_yaml(workdir / "placement.yaml", placement_config())
    result = snakemake(workdir, "--cores", "2", "aggregate", "--configfile", "placement.yaml", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir, intervals(workdir)


def test_configurations_on_different_gpus_run_side_by_side(placed):
    _, spans = placed
    assert any(overlaps(a, b) for a in spans["on_gpu0"] + spans["also_gpu0"] for b in spans["on_gpu1"])


def test_never_two_cells_on_one_gpu(placed):
    _, spans = placed
    for a, b in combinations(spans["on_gpu0"] + spans["also_gpu0"], 2):
        assert not overlaps(a, b)
    for a, b in combinations(spans["on_gpu1"], 2):
        assert not overlaps(a, b)


def test_each_server_started_once(placed):
    _, spans = placed
    for name, cells in spans.items():
        assert len({session for *_, session in cells}) == 1, name
