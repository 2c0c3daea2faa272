"""A real LiteLLM proxy (.venv-litellm, the pinned version) in front of the real vLLM CPU server.

Shares the session's vLLM server (conftest.vllm_server). Each LiteLLM start costs about 9 s here, so the
tests go in this order and reuse one proxy where they can: cells both ways, reuse, then the proxy settings
that must fail (a dropped field, a bad flag) and the owner's kill -9.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from helpers import REPO, free_port_range, with_changes
from servegrid import engines
from servegrid.analysis import aggregation
from servegrid.config import Experiment
from servegrid.errors import GatewayError
from servegrid.measuring import gateway_check
from servegrid.paths import RunTables
from servegrid.pipeline.cell_job import run_cell
from servegrid.records import cell_file, per_request
from servegrid.serving import gateway, procs, server, state

pytestmark = pytest.mark.vllm

LITELLM = REPO / ".venv-litellm" / "bin" / "litellm"
KEY_ENV = "SERVEGRID_TEST_PROXY_KEY"
PINNED = next(
    line.split("==")[1].strip()
    for line in (REPO / "envs" / "litellm.txt").read_text().splitlines()
    if line.startswith("litellm")
)


@pytest.fixture(scope="module")
def proxied(vllm_server):  # type: ignore[no-untyped-def]
    """(experiment through the gateway, facts, runtime); the gateway is stopped at the end."""
    if not LITELLM.exists():
        pytest.fail(f"{LITELLM} is missing: run `make setup` (or `make test`, which sets up first)")
    experiment, facts, runtime = vllm_server
    os.environ[KEY_ENV] = "sk-test-" + os.urandom(8).hex()
    raw = with_changes(
        experiment.raw,
        route="both",
        # 8 requests a side for decode: enough for a median (servegrid.stats.sampling); multi-turn has 6 conversations.
        **{"workloads.decode.requests_per_session": 4},
        proxy={"version": PINNED, "command": [str(LITELLM)], "master_key_env": KEY_ENV, "port": free_port_range()[0]},
    )
    yield Experiment(raw, source="integration-gateway"), facts, runtime
    record = state.read(state.record_path(runtime, state.GATEWAY))
    if record:
        server.stop_record(record, runtime, reason="gateway tests done")


def test_cells_both_ways_are_token_exact_through_the_gateway(proxied, tmp_path):
    experiment, facts, runtime = proxied
    owner = procs.ProcessRef.of(os.getpid())
    paths = []
    for mode in ("decode", "multi_turn"):
        (cell,) = [c for c in experiment.cells() if c.mode == mode and not c.open_loop]
        out = tmp_path / f"{mode}.parquet"
        meta = run_cell(experiment, cell, out, owner=owner, runtime=runtime)
        paths.append(str(out))
        assert meta.server["session"] == facts.session  # the shared vLLM server, reused
        found = meta.gateway["check"]
        # LiteLLM 1.106 keeps only the final usage; the check says so instead of failing every request.
        assert found["per_chunk_usage"] is False
        assert found["same_text"] is True
        assert meta.gateway["facts"]["version"] == PINNED
        frame = per_request.derive(cell_file.read_cell(out)[0].to_pandas())
        rows = frame[frame["phase"] == "measured"]
        assert set(rows["route"]) == {"direct", "proxy"}
        through = rows[rows["route"] == "proxy"]
        # Exact prompts and outputs through the gateway: the server's own usage, passed on.
        assert through["valid"].all(), through[["error", "prompt_tokens_reported", "output_tokens_reported"]]
        assert (through["output_tokens_reported"] == through["output_tokens_requested"]).all()
        assert (through["prompt_tokens_reported"] == through["prompt_tokens_requested"]).all()
        assert frame["request_id"].is_unique
        # vLLM counted exactly the requests the client sent in each route's phase: the gateway added none (no
        # retries, no health-check completions), so neither route reports foreign traffic.
        for phase in (meta.facts(), *meta.other_routes.values()):
            ttft_count = phase["server_metrics"]["delta"]["time_to_first_token_seconds_count"]
            assert ttft_count == phase["client"]["requests_in_window"], phase["route"]
    # The shared server speculates (ngram): some chunks carry several tokens, which only the direct stream counts.
    decode = per_request.derive(cell_file.read_cell(paths[0])[0].to_pandas())
    assert decode.loc[decode["route"] == "direct", "chunk_tokens_exact"].all()
    tables = RunTables.under(tmp_path)
    summary = aggregation.aggregate(experiment, paths, tables)
    assert len(summary) == 2 and (pd.read_parquet(tables.requests)["route"] == "direct").all()
    added = pd.read_parquet(tables.gateway)
    assert len(added) == 2 and added["gateway_version"].eq(PINNED).all()
    assert added["ttft_added_p50_s"].notna().all() and added["e2e_added_p50_s"].notna().all()
    assert os.environ[KEY_ENV] not in added["gateway_model_list"].iloc[0]  # the key's value, in no table


def test_the_gateway_is_reused_while_its_servers_stay(proxied):
    experiment, _, runtime = proxied
    owner = procs.ProcessRef.of(os.getpid())
    with gateway.lease(runtime):
        first = gateway.ensure(experiment, "both", runtime, owner)
        again = gateway.ensure(experiment, "both", runtime, owner)
    assert first.session == again.session and first.started_by_servegrid
    config = (state.directory(runtime) / f"{state.GATEWAY}.{first.session}.yaml").read_text()
    assert os.environ[KEY_ENV] not in config and f"os.environ/{KEY_ENV}" in config  # the key stays off disk
    assert "openai/tiny-qwen3" in config


def test_an_existing_gateway_is_used_as_it_is(proxied, tmp_path):
    """proxy.url: servegrid starts no proxy and measures through that one (here: the proxy the tests started,
    standing in for a gateway someone else runs), route: proxy (the seed's way)."""
    experiment, _, runtime = proxied
    owner = procs.ProcessRef.of(os.getpid())
    with gateway.lease(runtime):
        running = gateway.ensure(experiment, "both", runtime, owner)
    existing = Experiment(
        with_changes(
            experiment.raw,
            route="proxy",
            proxy={"url": running.url, "models": {"both": "both"}, "master_key_env": KEY_ENV},
        ),
        source="existing",
    )
    (cell,) = [c for c in existing.cells() if c.mode == "decode" and not c.open_loop]
    meta = run_cell(existing, cell, tmp_path / "decode.parquet", owner=owner, runtime=runtime)
    assert meta.gateway["facts"]["started_by_servegrid"] is False and meta.route == "proxy"
    rows = cell_file.read_cell(tmp_path / "decode.parquet")[0].to_pandas()
    assert set(rows["route"]) == {"proxy"}
    assert state.read(state.record_path(runtime, state.GATEWAY))["session"] == running.session  # none started


def test_a_dropped_field_is_named_at_the_first_request(proxied):
    experiment, facts, runtime = proxied
    # LiteLLM's own setting that drops a field: without stream_options the usage it reports is its own count.
    dropping = Experiment(
        with_changes(experiment.raw, **{"proxy.model_params": {"additional_drop_params": ["stream_options"]}}),
        source="drop",
    )
    owner = procs.ProcessRef.of(os.getpid())
    with gateway.lease(runtime):
        facts_gw = gateway.ensure(dropping, "both", runtime, owner)  # another model_list: started again
        with pytest.raises(GatewayError, match="stream_options"):
            gateway_check.check(
                engines.get("vllm"),
                facts.url,
                {},
                "tiny-qwen3",
                facts_gw.url,
                gateway.headers(dropping.proxy),
                "both",
                chat=False,
            )


def test_a_proxy_that_cannot_start_fails_fast_with_its_log(proxied):
    experiment, _, runtime = proxied
    broken = Experiment(with_changes(experiment.raw, **{"proxy.args": ["--no-such-flag"]}), source="broken")
    started = time.monotonic()
    with gateway.lease(runtime), pytest.raises(GatewayError, match="exited during start-up") as failure:
        gateway.ensure(broken, "both", runtime, procs.ProcessRef.of(os.getpid()))
    assert time.monotonic() - started < 60
    assert "no-such-flag" in str(failure.value)  # the log's tail says what was wrong


def test_the_gateway_goes_when_its_owner_is_killed(proxied):
    experiment, _, runtime = proxied
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # plays Snakemake
    try:
        with gateway.lease(runtime):
            record = state.read(state.record_path(runtime, state.GATEWAY))
            if record and state.anything_running(record):
                server.stop_record(record, runtime, reason="a fresh one for this owner")
            gateway.ensure(experiment, "both", runtime, procs.ProcessRef.of(stand_in.pid))
        record = state.read(state.record_path(runtime, state.GATEWAY))
        assert record and state.server_processes(record)
        os.kill(stand_in.pid, signal.SIGKILL)
        stand_in.wait()
        deadline = time.monotonic() + 60
        while state.server_processes(record) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not state.server_processes(record), "the gateway outlived its owner"
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
