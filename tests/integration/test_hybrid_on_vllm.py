"""The seed's shape on the real vLLM CPU build: the tiny Qwen3-Next hybrid the pipeline builds (with its MTP layer
and real weight files), its prefix cache in "align" mode judged in the blocks it reports, and MTP with prefix
caching refused by the engine at its first request, written as the configuration's result.

Two server starts (one dies at its first request); `make demo-hybrid` measures the whole grid, MTP's acceptance
included (docs/verdict.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from helpers import ANOTHER_USER, REPO, VLLM_PYTHON, as_another_user, engine_for_tests, free_port_range, placed
from helpers.fault_matrix import MATRIX
from servegrid.analysis import aggregation
from servegrid.config import Experiment
from servegrid.paths import RunTables
from servegrid.pipeline.cell_job import run_cell
from servegrid.serving import procs, server, tiny_model

pytestmark = pytest.mark.vllm

TINY = {
    "architecture": "qwen3_next",
    "mtp": "repeat",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "corpus_sentences": 2000,
}
# The shared prefix in whole attention blocks: vLLM forces the hybrid's block up until a page holds the mamba state,
# 384 tokens on the machines of 2026-12-02..05 and 256 on this project's 2-core AMD EPYC of 2026-12-06 (same vLLM,
# same model: "Setting attention block size to 256 tokens" in its log); either way 768 of the 1,000 tokens. A request
# of 1,064 tokens ends past its last block boundary: it saves no state a later request can reuse (docs/verdict.md),
# so the prefix is cached only where the second request carrying it parts from it.
CONTEXT, SUFFIX, REQUESTS = 1000, 64, 4


ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
# One warm-up: in align mode the first measured request is the prefix's second sighting, a miss.
SINGLE_TURN = {
    "contexts": [CONTEXT],
    "concurrency": [1],
    "suffix_tokens": SUFFIX,
    "output_tokens": 8,
    "requests_per_session": REQUESTS,
    "warmup_requests": 1,
}


# Another user of the host (issue 42, item 11): empties the server's prefix cache every 50 ms until its standard input
# closes, then tries the routes that would stop or inspect the server; prints what each answered.
INTRUDER = """
import json, select, sys, urllib.error, urllib.request
def call(path, data=None):
    request = urllib.request.Request(sys.argv[1] + path, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as refused:
        return refused.code
    except Exception as failed:  # a server put to sleep, or gone
        return type(failed).__name__
resets = []
while not select.select([sys.stdin], [], [], 0.05)[0]:
    resets.append(call("/reset_prefix_cache", b""))
print(json.dumps({"resets": resets, "sleep": call("/sleep?level=1", b""), "server_info": call("/server_info"),
                  "collective_rpc": call("/collective_rpc", b'{"method": "get_model"}'), "health": call("/health")}))
"""


def hybrid_config(model_dir: Path) -> dict[str, Any]:
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    vllm = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}"]
    return placed(
        {
            "experiment": {"title": "hybrid"},
            "model": {"path": str(model_dir), "served_name": "tiny-hybrid", "tiny": TINY},
            "engine": {"command": vllm, **engine_for_tests({"args": ["--max-model-len", "4096"], "env": ENV})},
            "configurations": {
                "prefix_cache": {"label": "prefix caching", "prefix_caching": True},
                "both": {"label": "prefix caching + MTP", "prefix_caching": True, "speculative": mtp},
            },
            "sampling": {"temperature": 0.0},
            "workloads": {"single_turn": SINGLE_TURN},
            "operations": {"startup_timeout_s": 600, "shutdown_timeout_s": 20, "request_timeout_s": 300},
        }
    )


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):  # type: ignore[no-untyped-def]
    """(experiment, runtime, folder) with the hybrid built offline; servers stopped at the end."""
    root = tmp_path_factory.mktemp("hybrid")
    raw = hybrid_config(root / "tiny-hybrid")
    experiment = Experiment(raw, source="hybrid")
    tiny_model.build(root / "tiny-hybrid", tiny_model.TinyModelSpec(**TINY), [str(VLLM_PYTHON)])
    runtime = server.Runtime(
        port_range=free_port_range(),
        startup_timeout_s=600,
        shutdown_timeout_s=20,
        state_dir=str(root / "state"),
        cwd=str(REPO),
        cpus=raw["configurations"]["both"]["cpus"],
    )
    cwd = os.getcwd()
    os.chdir(root)
    try:
        yield experiment, runtime, root
    finally:
        server.stop_all(runtime, reason="hybrid tests done")
        os.chdir(cwd)


def test_mtp_with_prefix_caching_is_refused_by_the_engine_and_written_as_such(hybrid):
    experiment, runtime, root = hybrid
    (cell,) = experiment.cells("both")
    started = time.monotonic()
    meta = run_cell(experiment, cell, root / "both.parquet", owner=procs.ProcessRef.of(os.getpid()), runtime=runtime)
    took = time.monotonic() - started
    # The engine's own words: the align-mode pre-copy is a Triton kernel this CPU build cannot run.
    assert meta.refused.startswith("TypeError: 'function' object is not subscriptable"), meta.refused
    assert "vllm/v1/worker/mamba_utils.py" in meta.refused
    assert took < 300, took  # a start-up and one request, not a timeout
    assert len(pd.read_parquet(root / "both.parquet")) == 0
    assert not any(row["alive"] for row in server.status(runtime) if row.get("configuration") == "both")


def test_the_hybrids_prefix_cache_is_judged_in_the_blocks_it_reports(hybrid):
    """Measured while another user of the host empties the server's cache, over and over (issue 42): refused."""
    experiment, runtime, root = hybrid
    (cell,) = experiment.cells("prefix_cache")
    owner = procs.ProcessRef.of(os.getpid())
    facts = server.ensure(experiment.launch_spec("prefix_cache"), runtime, owner)
    intruder = None
    if os.getuid() == 0:  # switching to another user needs root (the CI runs as root)
        argv = ["python3", "-c", INTRUDER, facts.url]
        intruder = as_another_user(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    started = time.monotonic()
    try:
        record = run_cell(experiment, cell, root / "pc.parquet", owner=owner, runtime=runtime)
    finally:
        said = intruder.communicate(b"", timeout=120)[0] if intruder else b"{}"
    took = time.monotonic() - started
    tried = json.loads(said)
    summary = aggregation.aggregate(experiment, [str(root / "pc.parquet")], RunTables.under(root / "tables"))
    (row,) = summary.to_dict("records")
    # The block the server reports is the one its engine chose, and the cell is judged in it.
    (log_path,) = pd.read_parquet(root / "tables" / "servers.parquet")["log_path"]
    (forced,) = {
        int(n) for n in re.findall(r"Setting attention block size to (\d+) tokens", Path(log_path).read_text())
    }
    assert (row["block_size"], row["cache_mode"]) == (forced, "align") and forced > 128  # forced up from the default
    # Before any cell, the server's warm-up crossed two of those blocks and hit both the second time, by the
    # server's own counter (issue 42; 2026-12-06: 640 tokens in blocks of 256, 512 hit; 2026-12-07: 960 tokens in
    # blocks of 384 hit none, on CI and here, so the warm-up is now two blocks and one token: 769, 768 hit).
    warm = record.server["warmup_cache"]
    assert warm["block_tokens"] == forced and warm["prompt_tokens"] > 2 * forced, warm
    assert warm["hit_tokens"] >= 2 * forced, warm
    # The prefix's whole blocks of 1,064 tokens per request, hit from the prefix's third sighting on: the warm-up is
    # the first, the first measured request the second (a miss), the other three hit.
    expected = CONTEXT // forced * forced / (CONTEXT + SUFFIX) * (REQUESTS - 1) / REQUESTS
    assert row["expected_hit_rate"] == pytest.approx(expected)
    assert row["server_prefix_cache_hit_rate"] == pytest.approx(expected, abs=0.01)
    # Judged valid as a cache measurement: no contradiction, every request answered with its exact tokens. The
    # client-timing checks (sends slipped, loop lag) are left out on purpose: on a 2-core CI box the vLLM server
    # shares the client's cores, and those checks flag that honestly; they are tested on their own elsewhere.
    assert not row["cache_contradiction"], row["invalid_reasons"]
    assert row["n_requests"] == REQUESTS
    assert (row["n_errors"], row["n_token_mismatch"], row["n_unmeasured_errors"]) == (0, 0, 0), row["invalid_reasons"]
    assert record.cache_state == "reset", record

    # The other user's calls were all refused, each logged; the cell's own reset answered, and the server still
    # serves (the cell above measured as if alone).
    if intruder is None:
        pytest.skip("the other user's half: switching to another user needs root")
    assert tried["resets"] and set(tried["resets"]) == {403}, tried
    assert (tried["sleep"], tried["server_info"], tried["collective_rpc"], tried["health"]) == (403, 403, 403, 200)
    log = Path(facts.log_path).read_text()
    assert "servegrid peer guard: refused POST /reset_prefix_cache from 127.0.0.1:" in log
    assert f"(uid {ANOTHER_USER})" in log
    MATRIX.record("dev-route-intruder", took, f"the cell, {len(tried['resets'])} resets refused meanwhile")
