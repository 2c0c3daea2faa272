"""Before the seed experiment on a GPU host: does each configuration get the GPU(s) it names?

Checks, without starting vLLM (a 27B model takes minutes to load):
- the GPUs every configuration names are on this host (servegrid.serving.hostinfo.check_gpus,
  the check each server start makes);
- under each configuration's server environment (its engine's server_env, the API key
  left out), a CUDA process sees exactly that many GPUs, and they are the ones nvidia-smi
  lists under those indices (by UUID);
- the host description the report prints (servegrid.serving.hostinfo.describe).

    python benchmarks/gpu_host_check.py [--config config.yaml] [--cuda-python PATH]

``--cuda-python`` is an interpreter with PyTorch (vLLM's own, say); it defaults to this
one. Prints one line per configuration and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from servegrid import engines
from servegrid.config import Experiment
from servegrid.errors import ConfigError, ServerError
from servegrid.serving import hostinfo

REPO = Path(__file__).resolve().parents[1]

# What a CUDA process under the server's environment sees: count, names and UUIDs.
CUDA_PROBE = """
import json, torch
n = torch.cuda.device_count()
print(json.dumps([{"name": torch.cuda.get_device_name(i),
                   "uuid": "GPU-" + str(torch.cuda.get_device_properties(i).uuid)} for i in range(n)]))
"""


def nvidia_smi_uuids() -> dict[int, str]:
    out = hostinfo.nvidia_smi("--query-gpu=index,uuid", "--format=csv,noheader") or ""
    return {int(index): uuid.strip() for index, uuid in (line.split(",") for line in out.strip().splitlines())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "config.yaml")
    parser.add_argument("--cuda-python", default=sys.executable)
    args = parser.parse_args()
    try:
        experiment = Experiment.from_file(args.config)
    except ConfigError as exc:
        print(f"config: {exc}")
        return 1
    present = hostinfo.gpu_indices()
    print(f"nvidia-smi lists GPUs {present}")
    print(f"host: {json.dumps(hostinfo.describe(present or []))}")
    uuids = nvidia_smi_uuids() if present else {}
    failures = 0
    for name, configuration in experiment.configurations.items():
        gpus = list(configuration.gpus)
        try:
            hostinfo.check_gpus(gpus, f"configurations.{name}.gpus")
        except ServerError as exc:
            print(f"{name}: FAIL {exc}")
            failures += 1
            continue
        spec = experiment.launch_spec(name)
        env = engines.get(spec["engine"]).server_env(spec["env"], gpus, api_key=None)
        probe = subprocess.run(
            [args.cuda_python, "-c", CUDA_PROBE], env={**os.environ, **env},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if probe.returncode != 0:
            print(f"{name}: FAIL the CUDA probe failed: {probe.stderr.strip()[-500:]}")
            failures += 1
            continue
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        expected = [uuids[g] for g in gpus]
        ok = [d["uuid"] for d in seen] == expected
        failures += not ok
        print(
            f"{name}: {'ok' if ok else 'FAIL'} CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')} "
            f"-> CUDA sees {[d['name'] for d in seen]} {[d['uuid'] for d in seen]}, expected {expected}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
