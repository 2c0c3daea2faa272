"""Prefix-cache hits counted in the blocks the server reports, not a dense model's (issue 29).

A hybrid model (linear-attention + full-attention layers, as the Qwen models that ship MTP layers are) caches a
prefix only where its recurrent state was saved: vLLM 0.32 switches it to "align" mode and enlarges the block
(384 tokens for the tiny Qwen3-Next-style model on the CPU build, ../shared/notes/vllm-cpu-hybrid-mtp.md: a
repeated 868-token prompt hit 768 tokens, a 213-token one none). A draft that reads the target's hidden states
(MTP, EAGLE) makes vLLM drop the last matched block of every hit.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pandas as pd
import pytest

from helpers import synthetic_cell_of, with_changes
from servegrid import modes
from servegrid.analysis.summary_table import peak_tokens_asked
from servegrid.config import Experiment
from servegrid.engines.base import EngineDeath, EngineFacts, PrefixCache
from servegrid.engines.vllm import VLLMEngine
from servegrid.engines.vllm_log import engine_death
from servegrid.records.cell_settings import CellSettings
from servegrid.testing.engine import CalibrationEngine

HYBRID = EngineFacts(version="0.32.0", max_model_len=4096, block_size=384, cache_mode="align")
DATA = Path(__file__).resolve().parents[1] / "data"


def serving(metrics_file: str) -> httpx.Client:
    """A client whose server answers /version, /v1/models and /metrics as a vLLM 0.32 server did."""
    exposition = (DATA / metrics_file).read_text(encoding="utf-8")

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 8192}]})
        return httpx.Response(200, text=exposition)

    return httpx.Client(transport=httpx.MockTransport(answer))


def test_a_hybrid_servers_cache_facts_are_read_from_what_it_reports():
    """The exposition of the tiny Qwen3-Next hybrid with prefix caching on vLLM 0.32's CPU build (2026-12-05):
    the engine enlarged its attention block to 384 tokens and caches recurrent states in "align" mode."""
    with serving("metrics_vllm_0_32_hybrid_align.txt") as client:
        facts = VLLMEngine().describe(client, "http://server", "tiny")
    assert facts == EngineFacts(version="0.32.0", max_model_len=8192, block_size=384, cache_mode="align")
    assert VLLMEngine().prefix_cache(facts, None) == PrefixCache(block=384, dropped=0, sightings=2)
    dense = EngineFacts(block_size=128)  # the dense tiny model on the CPU build: no recurrent state to align
    assert VLLMEngine().prefix_cache(dense, {"method": "mtp"}) == PrefixCache(block=128, dropped=1, sightings=1)


def test_in_align_mode_a_shared_prefix_hits_from_its_third_request():
    """Measured on the hybrid: a 1,180-token prompt sharing a 1,090-token prefix hit 0, 0, then 768 tokens from
    the third request on. The single-turn mode's warm-up carries the prefix; where it carries it fewer times than
    the cache needs, the first rounds of measured requests (one per session, sent together) miss."""
    single = modes.get("single_turn")
    measured = pd.DataFrame({"prompt_tokens_reported": [1216] * 12})
    full = 1152 / (1152 + 64)

    def expected(warmups: int, sessions: int, cache: PrefixCache) -> float:
        settings = CellSettings(
            {"context": 1152, "concurrency": sessions, "workload": {"suffix_tokens": 64, "warmup_requests": warmups}}
        )
        return single.expected_hit_rate(True, settings, measured, cache)

    align = PrefixCache(384, sightings=2)
    assert expected(2, 4, align) == pytest.approx(full)  # config/cpu-hybrid-demo.yaml: two warm-ups
    assert expected(1, 1, align) == pytest.approx(full * 11 / 12)
    assert expected(1, 4, align) == pytest.approx(full * 8 / 12)
    assert expected(0, 4, align) == pytest.approx(full * 4 / 12)
    assert expected(0, 8, align) == 0.0  # two rounds of eight: more than were measured
    assert expected(1, 4, PrefixCache(384)) == pytest.approx(full)  # a dense model: the first request caches


def test_an_engine_dead_of_its_own_error_is_told_from_one_killed():
    """vLLM 0.32's CPU build serving the hybrid with MTP and prefix caching: healthy, then dead at its first
    request in the align-mode pre-copy kernel (a Triton kernel with no CPU implementation)."""
    death = (DATA / "vllm_0_32_engine_death.log").read_text(encoding="utf-8")
    assert engine_death(death) == EngineDeath(
        "TypeError: 'function' object is not subscriptable "
        "(vllm/v1/worker/mamba_utils.py, line 1226, in run_fused_precopy)",
        transient=False,
    )
    # The tests' in-process engine (no worker): the engine core's fatal-error line first, its own traceback after.
    in_process = (DATA / "vllm_0_32_engine_death_in_process.log").read_text(encoding="utf-8")
    assert engine_death(in_process) == EngineDeath(
        "TypeError: 'function' object is not subscriptable "
        "(vllm/v1/worker/mamba_utils.py, line 1226, in run_fused_precopy)",
        transient=False,
    )
    alive = death.split("ERROR", 1)[0]  # up to the start-up's end: no death
    assert engine_death(alive) is None
    assert engine_death("Killed\n") is None  # the whole server killed: no word from the engine
    # Only the API server's word that its engine is gone: an engine core killed from outside, not a refusal.
    assert engine_death("EngineDeadError: EngineCore encountered an issue.") == EngineDeath(
        "the engine core died without a root cause in the log (killed from outside?)", transient=True
    )


API = "(APIServer pid=7395) ERROR 12-05 05:21:22 [async_llm.py:906] "
WORKER = "(Worker pid=7472) ERROR 12-05 05:21:22 [multiproc_executor.py:1063] "


def traceback(prefix: str, cause: str, path: str = "/venv/vllm/v1/worker/gpu_model_runner.py") -> str:
    return (
        f"{prefix}Traceback (most recent call last):\n"
        f'{prefix}  File "{path}", line 7, in execute_model\n'
        f"{prefix}    run()\n"
        f"{prefix}{cause}\n"
    )


FATAL = "(EngineCore pid=7461) ERROR 12-05 05:21:22 [core.py:1512] EngineCore encountered a fatal error.\n"


@pytest.mark.parametrize(
    ("log", "cause", "transient"),
    [
        # Issue 42: a CUDA out-of-memory at the first request was taken for the configuration's refusal.
        (
            traceback(WORKER, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.") + FATAL,
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
            "(vllm/v1/worker/gpu_model_runner.py, line 7, in execute_model)",
            True,
        ),
        (traceback(WORKER, "RuntimeError: NCCL error: unhandled system error") + FATAL, None, True),
        (traceback(WORKER, "RuntimeError: CUDA error: uncorrectable ECC error encountered") + FATAL, None, True),
        # An engine core the OOM killer took: the API server's EngineDeadError and the client's word on it.
        (
            "(APIServer pid=7395) ERROR 12-05 05:21:22 [core_client.py:818] [shutdown] MPClient: engine core exited "
            "unexpectedly; starting cleanup\n"
            + traceback(API, "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."),
            "the engine core died without a root cause in the log (killed from outside?)",
            True,
        ),
        # A worker killed while the engine core raised an error of its own: not the configuration's either.
        (
            "(EngineCore pid=7461) ERROR 12-05 05:21:22 [multiproc_executor.py:316] Worker proc VllmWorker-0 died "
            "unexpectedly (exit code: -9), shutting down executor.\n"
            + traceback(WORKER, "RuntimeError: cancelled")
            + FATAL,
            None,
            True,
        ),
        # The root cause is the last traceback before the death: an earlier one is something the engine lived through.
        (
            traceback(WORKER, "ValueError: a warning the engine logged and lived on")
            + "(Worker pid=7472) INFO 12-05 05:21:23 [gpu_model_runner.py:1] went on\n"
            + traceback(WORKER, "TypeError: the configuration's own error")
            + FATAL
            + traceback(API, "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."),
            "TypeError: the configuration's own error (vllm/v1/worker/gpu_model_runner.py, line 7, in execute_model)",
            False,
        ),
    ],
)
def test_a_death_of_the_moment_is_told_from_the_configurations_own(log, cause, transient):
    death = engine_death(log)
    assert death is not None and death.transient is transient
    if cause is not None:
        assert death.cause == cause


@pytest.mark.parametrize(
    ("speculative", "dropped"),
    [
        (None, 0),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, 0),
        ({"method": "mtp", "num_speculative_tokens": 1}, 1),
        ({"method": "qwen3_next_mtp", "num_speculative_tokens": 2}, 1),  # renamed "mtp" by vLLM 0.32
        ({"method": "eagle3", "model": "some/eagle3-head", "num_speculative_tokens": 3}, 1),
        ({"method": "mtp", "num_speculative_tokens": 1, "disable_eagle_block_drop": True}, 0),
        ({"method": "draft_model", "model": "some/small-model", "num_speculative_tokens": 3}, 0),
    ],
)
def test_vllm_says_which_drafts_keep_the_last_matched_block_from_reuse(speculative, dropped):
    assert VLLMEngine().prefix_cache(HYBRID, speculative) == PrefixCache(block=384, dropped=dropped, sightings=2)


def test_the_stand_in_reuses_every_matched_block():
    assert CalibrationEngine().prefix_cache(EngineFacts(block_size=128), {"method": "mtp"}) == PrefixCache(128, 0)


def test_hits_come_in_the_servers_blocks():
    aligned, with_mtp = PrefixCache(384), PrefixCache(384, dropped=1)
    assert [aligned.hit_tokens(n) for n in (213, 383, 384, 868)] == [0, 0, 384, 768]  # 868 → 768, as measured
    assert [with_mtp.hit_tokens(n) for n in (213, 384, 868)] == [0, 0, 384]
    assert PrefixCache(16).hit_tokens(868) == 864  # the same prompt on a dense model's GPU blocks
    assert [aligned.held_tokens(n) for n in (1, 384, 385)] == [384, 384, 768]


def test_single_turn_expects_the_prefix_in_whole_blocks():
    single = modes.get("single_turn")
    settings = CellSettings({"context": 868, "concurrency": 1, "workload": {"suffix_tokens": 32, "warmup_requests": 1}})
    measured = pd.DataFrame({"prompt_tokens_reported": [900]})
    assert single.expected_hit_rate(True, settings, measured, PrefixCache(128)) == pytest.approx(768 / 900)
    assert single.expected_hit_rate(True, settings, measured, PrefixCache(384)) == pytest.approx(768 / 900)
    assert single.expected_hit_rate(True, settings, measured, PrefixCache(384, 1)) == pytest.approx(384 / 900)
    assert single.expected_hit_rate(False, settings, measured, PrefixCache(384)) == 0.0
    short = CellSettings({"context": 213, "concurrency": 1, "workload": {"suffix_tokens": 32, "warmup_requests": 1}})
    assert single.expected_hit_rate(True, short, measured, PrefixCache(384)) == 0.0  # under one block: no hit


def test_multi_turn_expects_each_previous_turn_in_whole_blocks():
    multi = modes.get("multi_turn")
    # One conversation of three turns: prompts of 500, 900 and 1300 tokens.
    measured = pd.DataFrame(
        {"session": [0, 0, 0], "seq": [0, 0, 0], "turn": [1, 2, 3], "prompt_tokens_reported": [500, 900, 1300]}
    )
    total = 500 + 900 + 1300
    anything = CellSettings({})  # multi-turn's rule reads the measured turns only
    assert multi.expected_hit_rate(True, anything, measured, PrefixCache(128)) == pytest.approx((384 + 896) / total)
    assert multi.expected_hit_rate(True, anything, measured, PrefixCache(384)) == pytest.approx((384 + 768) / total)
    assert multi.expected_hit_rate(True, anything, measured, PrefixCache(384, 1)) == pytest.approx((0 + 384) / total)


def test_each_repeat_expects_its_own_hits_from_a_reset_cache():
    """A cell's repeats, and a top-up's (sampling.policy: verdict), each run the workload again from a reset cache with
    the same sessions and sequence numbers: a repeat's first turn finds nothing of the repeat before. Pooled as one
    conversation, a top-up of the CPU demo's multi-turn cell expected 0.79 against the 0.59 both passes measured, and
    the pooled cell was marked invalid."""
    multi, single = modes.get("multi_turn"), modes.get("single_turn")
    one = pd.DataFrame(
        {"session": [0, 0, 0], "seq": [0, 0, 0], "turn": [1, 2, 3], "prompt_tokens_reported": [500, 900, 1300]}
    )
    twice = pd.concat([one.assign(repeat=0), one.assign(repeat=1)], ignore_index=True)
    alone = multi.expected_hit_rate(True, CellSettings({}), one, PrefixCache(128))
    assert multi.expected_hit_rate(True, CellSettings({}), twice, PrefixCache(128)) == pytest.approx(alone)
    # A hybrid whose warm-up carried the prefix once: each repeat's first round misses it again.
    hybrid = CellSettings({"context": 868, "concurrency": 2, "workload": {"suffix_tokens": 32, "warmup_requests": 1}})
    rounds = pd.DataFrame({"prompt_tokens_reported": [900] * 6, "repeat": [0] * 3 + [1] * 3})
    assert single.expected_hit_rate(True, hybrid, rounds, PrefixCache(384, 0, 2)) == pytest.approx(768 / 900 * 2 / 6)


def test_a_cells_live_tokens_count_whole_blocks():
    measured = pd.DataFrame({"prompt_tokens_requested": [290, 300], "output_tokens_requested": [8, 8]})
    assert peak_tokens_asked(measured, 4) == 4 * 308
    assert peak_tokens_asked(measured, 4, PrefixCache(384)) == 4 * 384


@pytest.fixture
def single_turn_at_868(demo_raw, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The demo's prefix_cache configuration with one single-turn cell (an 868-token prefix, one session), the test
    run in ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    raw = with_changes(demo_raw)
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    raw["workloads"] = {"single_turn": {**raw["workloads"]["single_turn"], "contexts": [868], "concurrency": [1]}}
    experiment = Experiment(raw)
    (cell,) = experiment.cells()
    return experiment, cell


def test_a_hybrid_cell_is_judged_by_the_blocks_it_can_hit(single_turn_at_868, tmp_path):
    """A hybrid server with MTP hit what its blocks allow (one 384-token block of an 868-token prefix): valid.
    Counted in a dense model's blocks, the same cell would have expected 768 tokens and been marked invalid."""
    from servegrid.analysis import aggregation
    from servegrid.paths import RunTables

    experiment, cell = single_turn_at_868
    measured_rate = 384 / (868 + 64)  # synthetic_cell's suffix: 64 tokens
    hybrid = {"block_size": 384, "cache_mode": "align", "hit_blocks_dropped": 1}
    synthetic_cell_of(tmp_path, cell, ttft_s=0.05, interval_s=0.005, requests=30, hit_rate=measured_rate, server=hybrid)
    summary = aggregation.aggregate(experiment, [cell.path], RunTables.under(tmp_path / "hybrid")).set_index("cell_id")
    row = summary.loc[cell.id]
    assert row["block_size"] == 384 and row["cache_mode"] == "align"
    assert row["expected_hit_rate"] == pytest.approx(measured_rate)
    assert not row["cache_contradiction"] and row["valid"]
    # The same measurement judged with every matched block reused (the rule before the server said otherwise):
    synthetic_cell_of(
        tmp_path,
        cell,
        ttft_s=0.05,
        interval_s=0.005,
        requests=30,
        hit_rate=measured_rate,
        server={**hybrid, "hit_blocks_dropped": 0},
    )
    dense_rule = aggregation.aggregate(experiment, [cell.path], RunTables.under(tmp_path / "dense")).set_index(
        "cell_id"
    )
    assert dense_rule.loc[cell.id, "expected_hit_rate"] == pytest.approx(768 / 932)
    assert dense_rule.loc[cell.id, "cache_contradiction"] and not dense_rule.loc[cell.id, "valid"]


# The engine core's start-up lines where the KV cache has several groups, as vLLM 0.32 logs them (logger.info_once
# in v1/core/kv_cache_utils.py resolve_kv_cache_block_sizes); the tiny hybrid of test_hybrid_on_vllm logged
# "kv cache group sizes (256, 256, 256)" and "kv lcm block sizes 256" in the clean-clone run of 2026-12-07.
GROUP_LINES = (
    "(EngineCore pid=4242) INFO 12-07 05:01:02 [kv_cache_utils.py:853] kv cache group sizes {sizes}\n"
    "(EngineCore pid=4242) INFO 12-07 05:01:02 [kv_cache_utils.py:854] kv lcm block sizes {lcm}\n"
)


@pytest.mark.parametrize(
    ("sizes", "lcm", "block", "match_unit", "judged"),
    [
        (None, None, 128, None, True),  # one group: vLLM logs nothing, hits land on its block
        ((384, 384), 384, 384, None, True),  # the tiny hybrid in align mode: every group at the front end's block
        ((16, 32), 32, 16, None, False),  # hits on 32 (the LCM) or 16 (partial hits): the engine does not say
        ((384, 384), 384, 384, 32, False),  # a finer --prefix-match-unit: hits at 32 where partial hits are on
    ],
)
def test_hits_are_judged_only_where_the_engine_leaves_their_granularity_certain(sizes, lcm, block, match_unit, judged):
    log = "CPU KV cache size: 9,216 tokens\n" + (GROUP_LINES.format(sizes=sizes, lcm=lcm) if sizes else "")
    startup = VLLMEngine().startup_facts(log)
    assert startup.kv_group_block_sizes == sizes and startup.kv_cache_tokens == 9216
    facts = EngineFacts(block_size=block, prefix_match_unit=match_unit)
    assert VLLMEngine().prefix_cache(facts, None, startup).judged is judged


def test_a_cell_whose_hits_may_land_elsewhere_is_reported_not_judged(single_turn_at_868, tmp_path):
    """A server whose KV-cache groups have different block sizes: a hit rate far below what its front end's block
    would give is reported, with no expected rate and no contradiction."""
    from servegrid.analysis import aggregation
    from servegrid.paths import RunTables

    experiment, cell = single_turn_at_868
    summaries = {}
    for judged in (True, False):
        server = {"block_size": 16, "kv_group_block_sizes": [16, 48], "hits_judged": judged}
        synthetic_cell_of(tmp_path, cell, ttft_s=0.05, interval_s=0.005, requests=30, hit_rate=0.1, server=server)
        tables = RunTables.under(tmp_path / str(judged))
        summaries[judged] = aggregation.aggregate(experiment, [cell.path], tables).set_index("cell_id").loc[cell.id]
    assert summaries[True]["cache_contradiction"] and not summaries[True]["valid"]  # the block's rule: 864 of 932
    unjudged = summaries[False]
    assert pd.isna(unjudged["expected_hit_rate"]) and unjudged["server_prefix_cache_hit_rate"] == pytest.approx(0.1)
    assert not unjudged["cache_contradiction"] and unjudged["valid"], unjudged["invalid_reasons"]
    servers = pd.read_parquet(RunTables.under(tmp_path / "False").servers)
    assert servers["kv_group_block_sizes"].iloc[0].tolist() == [16, 48] and not servers["hits_judged"].iloc[0]


@pytest.mark.parametrize(("refusals", "state", "asked"), [(0, "reset", 1), (2, "reset", 3), (99, "fresh content", 7)])
def test_a_reset_refused_while_blocks_are_held_is_tried_again(refusals, state, asked, monkeypatch, caplog):
    """Issue 42: vLLM 0.32 answers {"success": false} while blocks are still held and says callers may retry; a
    refused reset was taken for none, and the repeat silently went on with fresh prompt content."""
    from servegrid.measuring import measured_phase

    monkeypatch.setattr(measured_phase, "RESET_RETRY_PAUSES_S", (0.0,) * 6)
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, json={"success": len(calls) > refusals})

    with httpx.Client(transport=httpx.MockTransport(answer)) as client, caplog.at_level("INFO"):
        assert measured_phase._reset_prefix_cache(VLLMEngine(), client, "http://server") == state
    assert calls == ["/reset_prefix_cache"] * asked
    assert caplog.text.count("blocks still held") == min(refusals, 6)
    assert ("prefix cache not reset" in caplog.text) is (state == "fresh content")


def test_a_server_without_the_dev_routes_is_not_asked_again():
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(404))) as client:
        assert VLLMEngine().reset_prefix_cache(client, "http://server") == "unavailable"


def test_the_warm_up_crosses_two_of_the_servers_blocks_and_hits_them(monkeypatch):
    """Issue 42: an 8-token warm-up crossed no cache block, so the code a cell runs first (a hybrid's align-mode copy,
    the cache-hit path, MTP with caching) first ran in a measured cell. The server here is vLLM 0.32's exposition of
    the hybrid (block 384), its hit counter moved by what is sent."""
    exposition = (DATA / "metrics_vllm_0_32_hybrid_align.txt").read_text(encoding="utf-8")
    prompts: list[list[int]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "hy", "max_model_len": 4096}]})
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": [11, 12, 13]})
        if path == "/v1/completions":
            prompts.append(json.loads(request.content)["prompt"])
            return httpx.Response(200, text="data: [DONE]\n\n")
        hits = 768.0 if len(prompts) == 2 else 0.0  # the second send hit two whole blocks
        counter = 'vllm:prefix_cache_hits_total{engine="0",model_name="hy"}'
        return httpx.Response(200, text=exposition.replace(f"{counter} 0.0", f"{counter} {hits}"))

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        facts = VLLMEngine().warm_up_cache(client, "http://server", "hy")
    # Two blocks and one token: a hybrid's align mode hits on the second send only where the prompt ends close past a
    # block boundary (on vLLM 0.32's CPU build, block 384: 769-895 tokens hit 768, 960 none).
    assert facts == {"prompt_tokens": 769, "block_tokens": 384, "hit_tokens": 768}
    assert len(prompts) == 2 and prompts[0] == prompts[1] and len(prompts[0]) == 769 > 2 * 384
    assert prompts[0][:4] == [11, 12, 13, 11]
