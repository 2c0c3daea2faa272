"""Real vLLM (CPU build) for the integration tests: one shared server where tests can share one.

Each vLLM CPU start costs about a minute, so the workload tests share a single
server that has both prefix caching and ngram speculative decoding on (vLLM
0.32 on CPU accepts both together), which lets one server show cache hits and
speculative acceptances.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from helpers import REPO, VLLM_PYTHON, engine_for_tests, free_port_range
from servegrid.config import Experiment
from servegrid.serving import procs, server, tiny_model


def shared_config(model_dir: Path) -> dict[str, Any]:
    return {
        "experiment": {"title": "integration tests"},
        "model": {"path": str(model_dir), "served_name": "tiny-qwen3", "tiny": {}},
        "engine": {
            "command": [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}"],
            **engine_for_tests(
                {
                    "args": ["--load-format", "dummy", "--max-model-len", "8192"],
                    "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
                },
                bind_threads=True,
            ),
        },
        "configurations": {
            "both": {
                "label": "prefix caching + ngram",
                "prefix_caching": True,
                "speculative": {
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2,
                },
            }
        },
        "sampling": {"temperature": 0.0},
        "workloads": {
            # rates: one open-loop cell (tests/integration/test_open_loop_on_vllm.py)
            "decode": {
                "contexts": [256],
                "concurrency": [2],
                "output_tokens": 48,
                "requests_per_session": 2,
                "rates": [4],
                "open_loop": {"requests": 16, "ramp_s": 1, "max_in_flight": 64},
            },
            "single_turn": {
                "contexts": [1024],
                "concurrency": [2],
                "suffix_tokens": 64,
                "output_tokens": 8,
                "requests_per_session": 2,
            },
            "multi_turn": {
                "contexts": [512],
                "concurrency": [2],
                "turns": 3,
                "tokens_per_turn": 128,
                "output_tokens": 16,
            },
            # A generated trace at 1x (tests/integration/test_trace_on_vllm.py): blocks of 128 tokens, the CPU
            # build's cache block, steady arrivals one a second with short outputs, so that no request waits on
            # another's prefill and the hit rate the server counts is the trace's own reuse.
            "trace": {
                "source": {
                    "generate": {
                        "seed": 3,
                        "duration_s": 12,
                        "rate": 1.0,
                        "burstiness": 4.0,
                        "input_median": 160,
                        "output_median": 4,
                        "max_output": 6,
                        "max_input": 1024,
                        "system_prompt_blocks": 2,
                        "think_mean_s": 0.3,
                    }
                },
                "block_tokens": 128,
                "speedups": [1],
                "open_loop": {"ramp_s": 0},
            },
        },
        "operations": {"startup_timeout_s": 600, "shutdown_timeout_s": 20, "request_timeout_s": 300},
    }


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):  # type: ignore[no-untyped-def]
    """(experiment, facts, runtime) of one real vLLM CPU server for the whole session."""
    if not VLLM_PYTHON.exists():
        # A missing engine is a set-up failure, never a silent skip.
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make setup` (or `make test`, which sets up first)")
    root = tmp_path_factory.mktemp("vllm")
    model_dir = root / "tiny-qwen3"
    tiny_model.build(model_dir)
    experiment = Experiment(shared_config(model_dir), source="integration")
    runtime = server.Runtime(
        port_range=free_port_range(),
        startup_timeout_s=600,
        shutdown_timeout_s=20,
        state_dir=str(root / "state"),
        cwd=str(REPO),
    )
    cwd = os.getcwd()
    os.chdir(root)  # server logs land under root/results
    try:
        facts = server.ensure(experiment.launch_spec("both"), runtime, procs.ProcessRef.of(os.getpid()))
        yield experiment, facts, runtime
    finally:
        server.stop_all(runtime, reason="integration tests done")
        os.chdir(cwd)
